"""The L3 storage interface: what a backend, a tier actor and the sharded client implement.
Keys are page names (``bytes`` of the hash algo's digest size; lowercase hex text is
accepted too). Values are :class:`~pd_cache.storage.record.PageRecord`.

v1 works on one pool, ``kv``; v2 on several pools per page (KV plus sidecar pools, such
as the recurrent state of a hybrid model), each moved by a :class:`PoolTransfer`. v1 is
implemented here in terms of v2, so the logic exists once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import msgspec

from pd_cache.core.vocab import MissReason
from pd_cache.storage.record import CHECKPOINT_POOLS, KV_POOL

if TYPE_CHECKING:
    from pd_cache.storage.record import PageRecord

T = TypeVar("T")
U = TypeVar("U")
Key = bytes | str


class ExtraInfo(msgspec.Struct, frozen=True, gc=False):
    """What a caller knows about the chain around ``keys``.

    ``prefix_keys`` has three states: ``None`` (feature off, no chain check), ``[]`` (on;
    the chain starts at the namespace seed, so the first key's prior must be
    ``namespace_seed`` when that is given) and non-empty (the names of all the pages before
    ``keys``, which place them: ``storage.placement``; the first key's prior must be
    ``prefix_keys[-1]``). With the feature on, each key's prior must be the key before it.
    It is per operation: in a v2 call the operation's keys are its longest key list (the
    KV pool's); a sidecar pool may cover only a trailing run, with the priors there.
    Accumulate it per batch as ``prefix_keys = prefix_keys + batch``: never mutate a list
    already handed over. ``request_id`` only labels log lines. ``tenant`` names whose key
    seals the pages (``storage.seal`` drops it); ``pin_ttl_s`` (``storage.pinned``).
    """

    prefix_keys: Sequence[Key] | None = None
    namespace_seed: bytes | None = None
    request_id: str | None = None
    tenant: str | None = None
    pin_ttl_s: float | None = None


class PoolTransfer(msgspec.Struct, frozen=True, gc=False):
    """One pool's share of a v2 batch: its name, its keys and (set / get result) its pages.

    KV-derived pools cover the operation's keys; a sidecar pool (recurrent state, a sliding
    window) may cover only its last keys (with a chain check on, anything else raises).

    ``priors`` (the expected prior of each key) is normally left ``None`` and derived from
    ``ExtraInfo``; the sharded client fills it in when it splits a batch over shards.
    """

    pool: str
    keys: Sequence[Key]
    pages: Sequence[PageRecord | None] | None = None
    priors: Sequence[bytes | None] | None = None


class PoolHits(NamedTuple):
    """Consecutive hits from the first key, per pool, and the pages usable whole.

    ``checkpoints``: per checkpoint pool of the call (``state``), which of its keys are
    stored, since a usable prefix may end at any of them (see :func:`usable_end`).
    """

    per_pool: dict[str, int]
    usable: int
    checkpoints: dict[str, list[bool]] | None = None


class Usage(NamedTuple):
    records: int
    bytes: int
    capacity_bytes: int


class ShardFault(NamedTuple):
    """A shard that did not answer; its keys count as misses for ``reason``."""

    shard: int
    reason: MissReason  # TIMEOUT or STORAGE_ERROR
    detail: str


class Pending(ABC, Generic[T]):
    """A submitted batch whose result is collected later (prefetch overlapping compute)."""

    @abstractmethod
    def done(self) -> bool:
        """True once :meth:`result` would return without waiting."""

    @abstractmethod
    def result(self, timeout: float | None = None) -> T:
        """The batch's result; waits at most ``timeout`` seconds (``None``: the default).

        A shard that failed or did not answer in time never raises here: its keys come
        back as misses (``None`` pages, ``False`` acks, a shorter hit prefix) and the fault
        is listed in :attr:`faults`. Bad input raises ``ValueError`` at submission.
        """

    @property
    def faults(self) -> list[ShardFault]:
        return []

    def then(self, fn: Callable[[T], U]) -> Pending[U]:
        return _Mapped(self, fn)


class Ready(Pending[T]):
    """A result that is already there (what local backends return)."""

    def __init__(self, value: T) -> None:
        self._value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> T:
        return self._value


class _Mapped(Pending[U]):
    def __init__(self, inner: Pending[Any], fn: Callable[[Any], U]) -> None:
        self._inner, self._fn = inner, fn

    def done(self) -> bool:
        return self._inner.done()

    def result(self, timeout: float | None = None) -> U:
        return self._fn(self._inner.result(timeout))

    @property
    def faults(self) -> list[ShardFault]:
        return self._inner.faults


class StorageBackend(ABC):
    """A store of verified page records, keyed by ``(pool, page name)``.

    ``checksums_in_reader``: every payload a get returns was checksummed in the calling
    process, on the bytes returned (not only where they were stored); readers need not
    hash them again.

    Contract shared by every implementation (``memory``, ``disk``, the sharded client):

    - Bad input raises ``ValueError`` naming the field, before anything changes: keys that
      are not page names of the store's algo, pages and keys of different lengths, an
      unknown pool name, a payload whose shape or dtype disagrees with its header.
    - A record is returned only after it verified against what was asked for: its key,
      its expected prior (when ``extra_info`` gives a chain), the record version, the
      store's layout fingerprint and hash algo, payload shapes, dtypes and checksums.
      A record that fails is deleted, counted (``verification_failed``) and is a miss.
      A store has no token ids (records keep none): the request's reader checks
      ``name == H(prior || its own tokens)`` before it uses a page.
    - A record set under a key it does not verify for (the same checks), or that breaks
      the chain given by ``extra_info``, is refused (``False``, counted as ``refused``),
      not raised.
    - Stores are bounded in bytes. Full, they evict chain tails first: a page is not
      evicted while a page after it in its chain (same pool) is kept, and the least
      recently used chain goes first; a new page that would be a chain's tail past the
      bound may go at once (its ack is still ``True``, counted stored then evicted).
    - Returned payloads may be views of the store's (or Ray's shared) memory: read-only.
    - Every hit, miss (by reason), store, eviction, refusal and verification failure is
      counted once in the store's :class:`~pd_cache.core.stats.Stats`; see :meth:`stats`.
      ``batch_exists*`` counts only the miss that ends the hit prefix; ``batch_get*``
      counts a hit or a miss for every key, so ``exists`` then ``get`` of the hit prefix
      counts each page once.
    """

    checksums_in_reader = False
    seals = False   # records are sealed on the way in: their writers compute no checksums

    algo: str = "xxh3_128"

    @abstractmethod
    def batch_exists_v2(self, transfers: Sequence[PoolTransfer],
                        extra_info: ExtraInfo | None = None) -> PoolHits:
        """Per pool, how many of its keys, from the first, are stored (pages ignored).

        ``usable``: the pages a request can load whole (:func:`usable_end`; a trailing
        sidecar pool starts late in the operation's keys).
        Changes nothing but counts; ``exists`` is a hint, ``get`` is authoritative.
        """

    @abstractmethod
    def batch_get_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[PoolTransfer]:
        """The same transfers with ``pages`` filled: a verified record or ``None`` per key.

        A hit refreshes the record's recency; a failed record is deleted.
        """

    @abstractmethod
    def batch_set_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[list[bool]]:
        """Store each transfer's pages (records holding its pool) under its keys.

        Returns one ack per key: ``True`` once the record is stored (or already was),
        ``False`` if refused. The store copies what it keeps: the caller may reuse its
        buffers when this returns. Storing may evict records (chain tails first).
        """

    def discard_v2(self, pool: str, keys: Sequence[Key]) -> int:
        """Delete ``keys``' records a reader found bad (a failed tag, a retired key), counted
        ``verification_failed``; how many (the sharded client does not wait: 0)."""
        return 0

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Snapshot of the event counts, ``{"event/reason": n}`` (see ``pd_cache.core.stats``)."""

    @abstractmethod
    def usage(self) -> Usage:
        """Records and bytes held now, and the byte bound."""

    # -- v1: one pool (``kv``), in terms of v2 -----------------------------------------
    def batch_exists(self, keys: Sequence[Key], extra_info: ExtraInfo | None = None) -> int:
        """Length of the consecutive hit prefix of ``keys``."""
        return self.batch_exists_v2([PoolTransfer(KV_POOL, keys)], extra_info).usable

    def batch_get(self, keys: Sequence[Key],
                  extra_info: ExtraInfo | None = None) -> list[PageRecord | None]:
        return _pages(self.batch_get_v2([PoolTransfer(KV_POOL, keys)], extra_info))

    def batch_set(self, keys: Sequence[Key], records: Sequence[PageRecord],
                  extra_info: ExtraInfo | None = None) -> list[bool]:
        _same_length(keys, records)
        return self.batch_set_v2([PoolTransfer(KV_POOL, keys, records)], extra_info)[0]

    # -- asynchronous submission: local stores answer at once, the client overrides ---
    def submit_exists_v2(self, transfers: Sequence[PoolTransfer],
                         extra_info: ExtraInfo | None = None) -> Pending[PoolHits]:
        return Ready(self.batch_exists_v2(transfers, extra_info))

    def submit_get_v2(self, transfers: Sequence[PoolTransfer],
                      extra_info: ExtraInfo | None = None) -> Pending[list[PoolTransfer]]:
        return Ready(self.batch_get_v2(transfers, extra_info))

    def submit_set_v2(self, transfers: Sequence[PoolTransfer],
                      extra_info: ExtraInfo | None = None) -> Pending[list[list[bool]]]:
        return Ready(self.batch_set_v2(transfers, extra_info))

    def submit_exists(self, keys: Sequence[Key],
                      extra_info: ExtraInfo | None = None) -> Pending[int]:
        return self.submit_exists_v2([PoolTransfer(KV_POOL, keys)], extra_info).then(
            _usable)

    def submit_get(self, keys: Sequence[Key],
                   extra_info: ExtraInfo | None = None) -> Pending[list[PageRecord | None]]:
        return self.submit_get_v2([PoolTransfer(KV_POOL, keys)], extra_info).then(_pages)

    def submit_set(self, keys: Sequence[Key], records: Sequence[PageRecord],
                   extra_info: ExtraInfo | None = None) -> Pending[list[bool]]:
        _same_length(keys, records)
        return self.submit_set_v2([PoolTransfer(KV_POOL, keys, records)], extra_info).then(
            _first)


class SubmittedBackend(StorageBackend):
    """A backend that implements ``submit_*_v2``; each sync call waits for its submit."""

    def batch_exists_v2(self, transfers: Sequence[PoolTransfer],
                        extra_info: ExtraInfo | None = None) -> PoolHits:
        return self.submit_exists_v2(transfers, extra_info).result()

    def batch_get_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[PoolTransfer]:
        return self.submit_get_v2(transfers, extra_info).result()

    def batch_set_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[list[bool]]:
        return self.submit_set_v2(transfers, extra_info).result()


def usable_prefix(transfers: Sequence[PoolTransfer]) -> int:
    """Pages loadable whole from a ``batch_get_v2`` result (:func:`usable_end`)."""
    if not transfers:
        return 0
    op = max((t.keys for t in transfers), key=len)
    return usable_end(len(op), [
        PoolRun(t.pool, pool_start(op, t.keys) or 0,
                [False] * len(t.keys) if t.pages is None else [p is not None for p in t.pages])
        for t in transfers])


class PoolRun(NamedTuple):
    """One pool of an operation: where its keys start in the operation's, which are stored."""

    pool: str
    start: int
    stored: Sequence[bool]


def usable_end(num_keys: int, runs: Sequence[PoolRun]) -> int:
    """How many of an operation's ``num_keys`` pages a request can load whole.

    A pool of per-page data (``kv``) must hold every page of the prefix that it covers: the
    prefix stops at its first miss. A checkpoint pool (``state``, taken after its page) is
    needed only where the prefix ends: the usable prefix is the longest run of those pages
    that ends at a page whose checkpoint is stored, in every checkpoint pool (0 if none)::

        page    0  1  2  3
        kv      1  1  1  1      data: every page, up to 4
        state         -  1      page 3's state is stored: 4 (page 2's is not: never 3)
    """
    end = num_keys
    ends: set[int] | None = None
    for run in runs:
        if run.pool in CHECKPOINT_POOLS:
            stored = {run.start + i + 1 for i, ok in enumerate(run.stored) if ok}
            ends = stored if ends is None else ends & stored
        else:
            end = min(end, run.start + next(
                (i for i, ok in enumerate(run.stored) if not ok), len(run.stored)))
    if ends is None:
        return end
    return max((e for e in ends if e <= end), default=0)


def pool_start(op_keys: Sequence[Any], keys: Sequence[Any]) -> int | None:
    """Where ``keys`` start in the operation's keys if they are a trailing run of them."""
    start = len(op_keys) - len(keys)
    if start < 0 or list(op_keys[start:]) != list(keys):
        return None
    return start


def _same_length(keys: Sequence[Any], records: Sequence[Any]) -> None:
    if len(keys) != len(records):
        raise ValueError(f"records: {len(records)} records for {len(keys)} keys")


def _usable(hits: PoolHits) -> int:
    return hits.usable


def _pages(transfers: list[PoolTransfer]) -> list[PageRecord | None]:
    return list(transfers[0].pages or [])


def _first(acks: list[list[bool]]) -> list[bool]:
    return acks[0]
