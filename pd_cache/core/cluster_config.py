"""``ClusterConfig``: the one source of a PD cluster's knobs.

Its fields (name, type, default, help) are what ``pd-cache run`` offers as flags and what
the Serve app accepts as ``args`` (``pd_cache.app.flags``, ``pd_cache.front.serve``); no
other place lists them. ``pd_config`` derives the ``PDCacheConfig`` every worker shares.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pd_cache.core.config import (
    MODEL_PRESETS,
    PREFETCH_POLICIES,
    STORAGE_BACKENDS,
    WRITE_POLICIES,
    CacheConfig,
    ModelConfig,
    PDCacheConfig,
    StorageConfig,
)
from pd_cache.core.fields import (
    DISK_RESERVE,
    WRITE_NICE,
    check_bool,
    check_int_at_least,
    check_non_negative,
    check_positive,
)
from pd_cache.core.pretrained import check_files


def model_config(model: str) -> ModelConfig:
    """A preset by name, else the checkpoint in the directory ``model`` (which must hold
    ``config.json``, ``*.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``)."""
    if model in MODEL_PRESETS:
        return ModelConfig.preset(model)
    if not isinstance(model, str) or not os.path.isdir(model):
        raise ValueError(f"model: {model!r} is neither a preset {sorted(MODEL_PRESETS)} nor a "
                         f"checkpoint directory")
    check_files(model)
    return ModelConfig.from_pretrained(model)


def check_model(key: str, model: str) -> None:
    """``ValueError`` naming ``key`` unless ``model`` is a preset or a checkpoint directory."""
    try:
        model_config(model)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def _knob(default: Any, text: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": text, **meta})


@dataclass(frozen=True)
class ClusterConfig:
    """Counts, model preset, cache tiers, L3 backend and policies of one cluster.

    ``cache=False`` turns reuse off at every tier (no L1/L2 pages, no L3): the baseline.
    ``num_storage=0`` runs without L3. ``decode_batch`` caps the requests a decode worker
    steps together in one forward (continuous batching; 1 = one request at a time, in both
    cache modes alike). ``decode_pack`` sends a request to the busiest decode worker whose
    batch still has room (fuller batches) rather than the least loaded. ``actor_cpus`` is
    what each worker actor reserves from Ray (0: place them regardless of the CPU count;
    they share the machine anyway).
    """

    num_prefill: int = _knob(2, "prefill workers")
    num_decode: int = _knob(2, "decode workers")
    num_storage: int = _knob(2, "storage actors (L3 shards); 0 runs without L3")
    model: str = _knob("small", f"model preset ({', '.join(sorted(MODEL_PRESETS))}) or a "
                                "local Hugging Face checkpoint directory", check=check_model)
    page_size: int = _knob(16, "tokens per KV page")
    device_pages: int = _knob(256, "L1 (device) pool pages per worker")
    host_pages: int = _knob(1024, "L2 (host) pool pages per worker")
    cache: bool = _knob(True, "reuse KV at every tier (off: the no-cache baseline)")
    storage_backend: str = _knob("memory", "L3 backend",
                                 choices=tuple(sorted(STORAGE_BACKENDS)))
    storage_capacity_bytes: int = _knob(1 << 30, "L3 capacity in bytes, split over shards")
    storage_replicas: int = _knob(1, "copies of each L3 page, on distinct shards (and nodes "
                                     "where there are several); R copies hold 1/R the pages")
    disk_path: str | None = _knob(None, "directory of the disk backend")
    disk_reserve: float = _knob(DISK_RESERVE, "free space the disk backend keeps on its "
                                              "filesystem: a fraction below 1, else bytes")
    prefetch_policy: str = _knob("wait_complete", "how long prefetch waits for L3",
                                 choices=PREFETCH_POLICIES)
    write_policy: str = _knob("write_through", "L1 -> L2 write policy", choices=WRITE_POLICIES)
    state_every_pages: int = _knob(4, "hybrid models: keep the recurrent state every this "
                                      "many pages (and at the end of each write)")
    balance_threshold: int = _knob(2, "prefix match loses to the least loaded prefill worker "
                                      "beyond this many requests of difference")
    threads: int = _knob(1, "torch threads per worker actor")
    lend_cores: bool = _knob(True, "a prompt's forward borrows the cores the node's other "
                                   "workers leave idle (more torch threads), and gives "
                                   "them back when it ends")
    decode_batch: int = _knob(8, "requests a decode worker steps together")
    prefill_queue_depth: int = _knob(2, "prefill calls a router gives each prefill worker "
                                        "at once; the rest wait, tenants in turn (0: no "
                                        "bound)")
    decode_pack: bool = _knob(False, "fill the busiest decode batch with room first")
    decode_spread_cores: int = _knob(0, "cores the workers share: while fewer workers than "
                                        "this have requests in flight, a request whose "
                                        "decode worker is busy goes to an idle one instead "
                                        "(0: never; -1: the CPUs Ray counts)")
    decode_cache: bool = _knob(True, "decode workers keep a prefix cache: a conversation's "
                                     "next turn is handed only the pages decode lacks")
    max_pinned_fraction: float = _knob(0.5, "the most of each pool and L3 shard that pinned "
                                            "prefixes may hold (a fraction)")
    actor_cpus: float = _knob(0.0, "CPUs each worker actor reserves from Ray")
    offload_min_pages: int = _knob(1, "decode's last write of a request only if it sends at "
                                      "least this many pages (a lone answer page's set "
                                      "costs more CPU than its recompute)")
    write_nice: int = _knob(WRITE_NICE, "nice value of each worker's L3 write thread (0-19; "
                                        "0: the worker's own priority)")
    storage_timeout_s: float = _knob(10.0, "bound on any wait for an L3 call (s)")
    storage_restarts: int = _knob(3, "restarts of a storage actor before it stays dead")
    worker_restarts: int = _knob(-1, "restarts of a prefill or decode actor (-1: always)")
    prefill_hold_s: float = _knob(0.0, "fault injection: a prefill worker's wait between its "
                                       "answer and the KV's handoff (s); 0 in service")
    metrics_interval_s: float = _knob(5.0, "how often each storage shard exports its counts (s)")
    index_shards: int = _knob(0, "page index actors fed by KV events (sharded by name); 0: "
                                 "each front routes by its own hints")
    index_timeout_s: float = _knob(0.1, "longest wait for the page index before routing by "
                                        "local hints (s)")
    index_mirror_s: float = _knob(2.0, "each front routes from its own copy of the page "
                                       "index, if every shard answered its feed within this "
                                       "long (s); else it asks the index. 0: always ask")
    route_compute_ms: float = _knob(2.0, "routing cost of a prompt page recomputed (ms)")
    route_host_ms: float = _knob(0.05, "routing cost of a page loaded from L2 (host) (ms)")
    route_l3_ms: float = _knob(0.3, "routing cost of a page loaded from L3 (ms)")
    route_queue_ms: float = _knob(25.0, "routing cost of a request in flight on the worker "
                                        "(ms)")

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "threads", "decode_batch",
                     "storage_replicas", "offload_min_pages"):
            check_int_at_least(name, getattr(self, name), 1)
        for name in ("num_storage", "balance_threshold", "storage_restarts", "index_shards",
                     "prefill_queue_depth"):
            check_int_at_least(name, getattr(self, name), 0)
        check_int_at_least("worker_restarts", self.worker_restarts, -1)
        check_int_at_least("decode_spread_cores", self.decode_spread_cores, -1)
        if self.with_storage and self.storage_replicas > self.num_storage:
            raise ValueError(f"storage_replicas: expected <= num_storage={self.num_storage}, "
                             f"got {self.storage_replicas!r}")
        check_bool("cache", self.cache)
        check_bool("decode_pack", self.decode_pack)
        check_bool("decode_cache", self.decode_cache)
        check_non_negative("actor_cpus", self.actor_cpus)
        check_non_negative("prefill_hold_s", self.prefill_hold_s)
        check_positive("storage_timeout_s", self.storage_timeout_s)
        check_positive("index_timeout_s", self.index_timeout_s)
        check_non_negative("index_mirror_s", self.index_mirror_s)
        for name in ("route_compute_ms", "route_host_ms", "route_l3_ms", "route_queue_ms"):
            check_non_negative(name, getattr(self, name))
        self.pd_config  # noqa: B018  (builds and so validates the worker config)

    @property
    def with_storage(self) -> bool:
        return self.cache and self.num_storage > 0

    @property
    def pd_config(self) -> PDCacheConfig:
        """The worker config every prefill, decode and storage actor shares."""
        on = self.cache
        return PDCacheConfig(
            model=model_config(self.model),
            cache=CacheConfig(page_size=self.page_size,
                              device_pages=self.device_pages if on else 0,
                              host_pages=self.host_pages if on else 0,
                              write_policy=self.write_policy,
                              state_every_pages=self.state_every_pages,
                              decode_cache=self.decode_cache and on,
                              max_pinned_fraction=self.max_pinned_fraction),
            storage=StorageConfig(enabled=self.with_storage, backend=self.storage_backend,
                                  capacity_bytes=self.storage_capacity_bytes,
                                  disk_path=self.disk_path,
                                  disk_reserve=self.disk_reserve,
                                  num_shards=max(1, self.num_storage),
                                  replicas=self.storage_replicas if self.with_storage else 1,
                                  prefetch_policy=self.prefetch_policy,
                                  offload_min_pages=self.offload_min_pages,
                                  write_nice=self.write_nice,
                                  metrics_interval_s=self.metrics_interval_s))
