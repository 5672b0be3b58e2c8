"""One worker process: the ``engine`` over the KV tiers, decode ``batching`` and
``decoding``, the plain prefill/decode ``workers`` and the Ray ``actors`` that host them.
The model they run lives in ``pd_cache.model``."""
