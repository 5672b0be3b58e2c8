"""``pd-cache bench``: an open-loop load generator for a running pd-cache cluster.

Seeded workloads (random, shared-prefix, multi-turn chat, Mooncake trace replay) are sent
at open-loop arrival times; a cache oracle computed from the request stream itself says
how many prompt tokens each request could have found cached.
"""
