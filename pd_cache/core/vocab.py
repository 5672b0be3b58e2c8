"""The words that cross modules and processes, each defined once.

Tiers, event and miss-reason vocabularies, the counter kinds the tiering layer writes into
``Stats``, page and token kinds, and worker roles. They are small and fixed, so metrics use
them as label values as they are (``pd_cache.metrics.VOCABULARIES`` is built from here).
"""

from __future__ import annotations

from enum import Enum


class Tier(str, Enum):
    """Where a cached page was found: L1 device pool, L2 host pool, L3 storage."""

    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"


TIERS: tuple[str, ...] = tuple(t.value for t in Tier)


class MissReason(str, Enum):
    """Why an L3 lookup did not produce a usable page, or a store refused one
    (``refused/<reason>``)."""

    NOT_STORED = "not_stored"
    EVICTED = "evicted"
    VERIFICATION_FAILED = "verification_failed"
    NAMESPACE_REFUSED = "namespace_refused"
    TIMEOUT = "timeout"
    STORAGE_ERROR = "storage_error"
    CROSS_NAMESPACE = "cross_namespace"   # produced under another namespace seed: refused
    DISK_FULL = "disk_full"   # refused: storing it would eat the disk's free-space reserve
    KEY_RETIRED = "key_retired"   # sealed under a retired (or purged tenant's) key
    STALE_INDEX = "stale_index"   # a page index said L3 held it; the shard no longer did
    QUOTA = "quota"   # refused: its tenant's L3 quota is full of pages that may not go


class Event(str, Enum):
    """What happened to a page at a tier."""

    HIT = "hit"
    MISS = "miss"
    STORED = "stored"
    EVICTED = "evicted"
    REFUSED = "refused"
    VERIFICATION_FAILED = "verification_failed"


class StorageOp(str, Enum):
    """An L3 call a shard answers (``pd_cache_storage_calls_total{op}``)."""

    EXISTS = "exists"
    GET = "get"
    SET = "set"


STORAGE_OPS: tuple[str, ...] = tuple(o.value for o in StorageOp)


class Outcome(str, Enum):
    """How one L3 transfer (a request's prefetch or write) ended."""

    OK = "ok"           # every page L3 was asked for moved
    SHORT = "short"     # some did, then one failed (the rest are recomputed / not stored)
    FAILED = "failed"   # none did


# Counter kinds of a worker's ``Stats`` beside the events (``kind/reason`` keys).
PREFETCH_BATCH = "prefetch_batch"   # one per L3 get batch issued
PREFETCH_ACK = "prefetch_ack"       # reasons: ok | short
BACKUP = "backup"                   # prefill write-through; reasons: page | failed_batch
OFFLOAD = "offload"                 # decode's writes; same reasons, plus the page kinds
DECODE = "decode"                   # reasons: step (batched forwards), token (tokens drawn)
DEADLINE = "deadline"               # reason: dropped (requests past their deadline)
# Decode's prefix cache (``keep/<reason>``): pages reserved for a handoff, kept (used in
# place of handed-off ones), and the reservations that were lost or did not line up (their
# gap refilled from decode's own tiers, L3 or by recompute).
KEEP = "keep"
RESERVED, KEPT, LOST, SEAM, REFILLED = "reserved", "kept", "lost", "seam_mismatch", "refilled"
# A handoff's pages: sent from prefill, or kept on decode (metric label values).
HANDOFF_KINDS = ("sent", "kept")
PAGE, FAILED_BATCH = "page", "failed_batch"
SKIPPED = "skipped"   # ``offload/skipped``: pages of a last write too small to make
# A hybrid model's recurrent states at checkpoint pages: ``state/<reason>`` counts what
# the read path found (hit, or a MissReason) and ``backup|offload/state`` what was written.
STATE = "state"

# What an offloaded page holds: prompt KV, or KV of generated tokens.
PROMPT, GENERATED = "prompt", "generated"
PAGE_KINDS = (PROMPT, GENERATED)
TOKEN_KINDS = ("prompt", "computed", "generated")

ROLES = ("prefill", "decode")
NAMESPACE_KINDS = ("none", "extra_key", "cache_salt", "both")


def namespace_kind(extra_key: str | None, cache_salt: str | None) -> str:
    """Which namespace parts a request set (never their values): a metric label."""
    if extra_key is not None and cache_salt is not None:
        return "both"
    if extra_key is not None:
        return "extra_key"
    return "cache_salt" if cache_salt is not None else "none"


def text(value: Enum | str) -> str:
    """The plain string of a vocabulary word, whether given as enum member or str."""
    return value.value if isinstance(value, Enum) else value
