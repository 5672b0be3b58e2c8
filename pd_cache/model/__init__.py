"""The neural model, apart from any process that serves it: the built-in reference
``model`` and its ``layers``, the checkpoint model (``hf_model``), and the ``digest`` that
names a model's weights in every page. Imports only ``core`` and ``kv.pages``."""
