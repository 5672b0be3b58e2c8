"""Many workers: the prefix-aware ``router``, ``PDCluster`` (``pd_cluster``) over prefill,
decode and storage actors, their ``health`` and operator ``operations``. The HTTP front
over it lives in ``pd_cache.front``."""
