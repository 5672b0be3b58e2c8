"""Many workers: the prefix-aware ``router``, ``PDCluster`` (``pd_cluster``) over prefill,
decode and storage actors, and the HTTP ingress (``serve``)."""
