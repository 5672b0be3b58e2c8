"""Configuration: one frozen dataclass per component, combined in ``PDCacheConfig``.

Every invalid value raises ``ValueError`` at construction, naming the field. Environment
overrides are read in one place, :meth:`PDCacheConfig.from_env`, with the prefix
``PD_CACHE_``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any

from pd_cache.core.fields import (
    DISK_RESERVE,
    WRITE_NICE,
    check,
    check_bool,
    check_disk_reserve,
    check_fraction,
    check_int_at_least,
    check_non_negative,
    check_positive,
    check_positive_int,
    one_of,
    read_text,
)
from pd_cache.core.hashing import DIGEST_SIZES
from pd_cache.core.model_config import (  # noqa: F401  (re-exported: the config API)
    ATTENTION,
    KV_DTYPE_BYTES,
    KV_DTYPES,
    KV_NEUTRAL_FIELDS,
    LATE_FIELDS,
    MODEL_PRESETS,
    RECURRENT,
    ModelConfig,
    _digest,
    _set_fields,
)

WRITE_POLICIES = ("write_through", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
ENV_PREFIX = "PD_CACHE_"

# The L3 backend registry: name -> "module:Class" (a class with ``from_config``), imported
# lazily by ``pd_cache.storage.backend_class``. Adding a backend is one module and one entry
# (or ``pd_cache.storage.register_backend``); ``StorageConfig.backend`` is checked here.
STORAGE_BACKENDS: dict[str, str] = {
    "memory": "pd_cache.storage.memory:MemoryBackend",
    "disk": "pd_cache.storage.disk:DiskBackend",
}


@dataclass(frozen=True)
class KVLayout:
    """Layout of one KV page; its fingerprint partitions L3 between models and layouts.

    A page is ``[2, num_layers, page_size, num_kv_heads, head_dim]`` (K and V of the
    attention layers). A hybrid model also keeps, at checkpoint pages, the recurrent state
    after the page: ``[state_layers, state_dim]`` float32 (``state_shape``; none when
    ``state_layers`` is 0). ``model_id`` and ``weights_digest`` say which model computed
    it (see ``PDCacheConfig.layout``); ``weights_digest`` is empty only in hand-made layouts.
    """

    model_id: str
    kv_dtype: str
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1
    weights_digest: str = ""
    state_layers: int = 0
    state_dim: int = 0

    def __post_init__(self) -> None:
        check(isinstance(self.weights_digest, str), "layout.weights_digest",
              self.weights_digest, "a str")
        for name in ("state_layers", "state_dim"):
            check_int_at_least(f"layout.{name}", getattr(self, name), 0)
        check((self.state_layers == 0) == (self.state_dim == 0), "layout.state_dim",
              self.state_dim, f"0 exactly when state_layers is 0 (it is {self.state_layers})")
        for name in ("num_layers", "page_size", "num_kv_heads", "head_dim", "tp_size"):
            check_positive_int(f"layout.{name}", getattr(self, name))
        check(isinstance(self.tp_rank, int) and 0 <= self.tp_rank < self.tp_size,
               "layout.tp_rank", self.tp_rank, f"an int in [0, {self.tp_size})")
        one_of("layout.kv_dtype", self.kv_dtype, KV_DTYPES)

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_layers, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one KV page (``page_shape`` of ``kv_dtype``), without any state."""
        return math.prod(self.page_shape) * KV_DTYPE_BYTES[self.kv_dtype]

    @property
    def state_shape(self) -> tuple[int, int]:
        """Shape of one recurrent state (after a page): ``[state_layers, state_dim]``."""
        return (self.state_layers, self.state_dim)

    @property
    def has_state(self) -> bool:
        """Whether a prefix resumes from a recurrent state as well as from KV (hybrid)."""
        return self.state_layers > 0

    @functools.cached_property
    def fingerprint(self) -> str:
        """Stable hex digest of every field (never Python's salted ``hash()``); computed
        once per layout (it digests every field; the fields are frozen)."""
        return _digest(b"pd-cache/layout/v2", _set_fields(self, frozenset()))


@dataclass(frozen=True)
class CacheConfig:
    """The worker-local tiers: L1 device pool, L2 host pool and their radix tree.

    ``state_every_pages``: a hybrid model keeps its recurrent state at every page whose
    count is a multiple of this, and at the last full page of each write (the pages a
    cached prefix may resume from; see ``pd_cache.kv.state``). ``decode_cache``: a decode
    worker keeps the pages it received and computed in its own radix cache, so the next turn
    of a conversation is handed only the pages it lacks (``pd_cache.worker.decode_cache``).
    ``max_pinned_fraction``: the most of each pool (L1, L2, each L3 shard) that pinned
    prefixes may hold (``Req.pin_ttl_s``; ``pd_cache.core.pins``).
    """

    page_size: int = 16
    hash_algo: str = "xxh3_128"
    device_pages: int = 256
    host_pages: int = 1024
    write_policy: str = "write_through"
    state_every_pages: int = 4
    decode_cache: bool = True
    max_pinned_fraction: float = 0.5

    def __post_init__(self) -> None:
        check_positive_int("cache.page_size", self.page_size)
        check_fraction("cache.max_pinned_fraction", self.max_pinned_fraction)
        check_bool("cache.decode_cache", self.decode_cache)
        check_positive_int("cache.state_every_pages", self.state_every_pages)
        one_of("cache.hash_algo", self.hash_algo, tuple(DIGEST_SIZES))
        check_non_negative("cache.device_pages", self.device_pages)
        check_non_negative("cache.host_pages", self.host_pages)
        one_of("cache.write_policy", self.write_policy, WRITE_POLICIES)


@dataclass(frozen=True)
class StorageConfig:
    """The L3 storage tier and the controller that prefetches from it.

    ``disk_reserve``: the free space the ``disk`` backend keeps on its filesystem, evicting
    tails first to keep it and refusing (``refused/disk_full``) what would eat into it: a
    fraction of the filesystem's size below 1, else bytes. ``seal``: workers seal every
    record they write (``pd_cache.storage.seal``); ``False`` only for a benchmark's
    unsealed baseline. ``segment_pages``: a chain's pages live on the shards in runs of
    this many (``pd_cache.storage.placement``). ``replicas``: copies of each page, on that
    many shards (``pd_cache.storage.replicas``; at most ``num_shards``): R copies hold 1/R
    as many distinct pages in the same ``capacity_bytes``. ``offload_min_pages``: decode's
    last write of a request is made only if it sends at least this many pages (a lone
    answer page costs a set call, more CPU than recomputing it; ``1``, the default: every
    page). ``write_nice``: the nice value of each worker's L3 write thread (0-19; 0: the
    worker's own priority; never raised: a Ray worker, at nice 15, keeps 15).
    ``arena_prefault``: a ``memory`` shard in Ray allocates its arena's memory (its share of
    ``capacity_bytes``) when it starts, instead of page by page as writers first fill its
    slots (``pd_cache.storage.arena``).
    """

    enabled: bool = True
    backend: str = "memory"
    capacity_bytes: int = 1 << 30
    disk_path: str | None = None
    disk_reserve: float = DISK_RESERVE
    num_shards: int = 1
    batch_pages: int = 128
    prefetch_policy: str = "best_effort"
    prefetch_timeout_base_s: float = 0.05
    prefetch_timeout_per_1k_tokens_s: float = 0.05
    prefetch_timeout_max_s: float = 2.0
    prefix_keys: bool = True
    segment_pages: int = 256
    replicas: int = 1
    metrics_interval_s: float = 5.0
    seal: bool = True
    offload_min_pages: int = 1
    write_nice: int = WRITE_NICE
    arena_prefault: bool = True

    def __post_init__(self) -> None:
        one_of("storage.backend", self.backend, tuple(sorted(STORAGE_BACKENDS)))
        check_positive_int("storage.capacity_bytes", self.capacity_bytes)
        check(self.backend != "disk" or bool(self.disk_path), "storage.disk_path",
               self.disk_path, "a directory when backend='disk'")
        check_disk_reserve("storage.disk_reserve", self.disk_reserve)
        check_positive_int("storage.num_shards", self.num_shards)
        check_positive_int("storage.batch_pages", self.batch_pages)
        check_positive_int("storage.segment_pages", self.segment_pages)
        check_positive_int("storage.replicas", self.replicas)
        check_positive_int("storage.offload_min_pages", self.offload_min_pages)
        check(type(self.write_nice) is int and 0 <= self.write_nice <= 19, "storage.write_nice",
              self.write_nice, "an int from 0 to 19")
        check_bool("storage.arena_prefault", self.arena_prefault)
        check(self.replicas <= self.num_shards, "storage.replicas", self.replicas,
              f"<= storage.num_shards={self.num_shards}")
        one_of("storage.prefetch_policy", self.prefetch_policy, PREFETCH_POLICIES)
        for name in ("prefetch_timeout_base_s", "prefetch_timeout_per_1k_tokens_s",
                     "prefetch_timeout_max_s"):
            check_non_negative(f"storage.{name}", getattr(self, name))
        check_positive("storage.metrics_interval_s", self.metrics_interval_s)

    @property
    def shard_capacity_bytes(self) -> int:
        """Each tier actor's share: ``capacity_bytes`` is split evenly over the shards."""
        return max(1, self.capacity_bytes // self.num_shards)


@dataclass(frozen=True)
class PDCacheConfig:
    """Everything a worker needs; prefill and decode must share model and page size."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    def __post_init__(self) -> None:
        check(self.model.max_context >= self.cache.page_size, "cache.page_size",
               self.cache.page_size, f"<= model.max_context={self.model.max_context}")

    @property
    def layout(self) -> KVLayout:
        """The KV layout every worker and storage shard of this config uses.

        ``model_id`` is the preset name and ``model.kv_digest``. ``weights_digest`` is
        ``model.weights_digest`` if pinned, else derived from ``kv_digest`` (the weights the
        config seeds), so a caller with no model gets the layout a worker of the same config
        uses; a worker checks pinned weights against its own (``pd_cache.model.digest``).
        """
        m, kv = self.model, self.model.kv_digest
        state_layers = m.recurrent_layers
        return KVLayout(model_id=f"{m.name}/{kv}", kv_dtype=m.kv_dtype,
                        num_layers=m.attention_layers, page_size=self.cache.page_size,
                        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                        weights_digest=m.weights_digest or f"config:{kv}",
                        state_layers=state_layers,
                        state_dim=m.hidden_size if state_layers else 0)

    def check_compatible(self, other: PDCacheConfig) -> None:
        """Cross-role rule: two workers exchanging KV must agree on its layout."""
        if self.layout != other.layout or self.cache.hash_algo != other.cache.hash_algo:
            raise ValueError(f"layout: workers disagree: {self.layout} / {other.layout}, "
                             f"algo {self.cache.hash_algo} / {other.cache.hash_algo}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **base: Any) -> PDCacheConfig:
        """Build from defaults, ``base`` sections, then ``PD_CACHE_<SECTION>_<FIELD>``.

        For example ``PD_CACHE_MODEL_NAME=small`` or ``PD_CACHE_STORAGE_BACKEND=disk``.
        """
        env = os.environ if env is None else env
        sections: dict[str, Any] = {}
        for section, klass in (("model", ModelConfig), ("cache", CacheConfig),
                               ("storage", StorageConfig)):
            current = base.get(section) or klass()
            preset = env.get(f"{ENV_PREFIX}MODEL_NAME") if section == "model" else None
            if preset:
                current = ModelConfig.preset(preset)
            sections[section] = dataclasses.replace(current,
                                                    **_env_fields(env, section, klass))
        return cls(**sections)


def _env_fields(env: Any, section: str, klass: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(klass):
        key = f"{ENV_PREFIX}{section.upper()}_{f.name.upper()}"
        if key in env and not (section == "model" and f.name == "name"):
            out[f.name] = read_text(key, env[key], f.type)
    return out
