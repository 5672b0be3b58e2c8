"""One worker process: the reference ``model``, the ``engine`` over the KV tiers, decode
``batching``, the plain prefill/decode ``workers`` and the Ray ``actors`` that host them."""
