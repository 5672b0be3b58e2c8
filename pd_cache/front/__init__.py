"""The HTTP front: the Ray Serve ingress (``serve``) with its OpenAI-compatible routes
(``openai``), request parsing (``http``), API keys and tenants (``tenants``), the app's
Serve args (``app_args``), and the tokenizers only the front uses (``tokenizer``,
``hf_tokenizer``). Sits above ``cluster``: it calls ``PDCluster``, never the reverse."""
