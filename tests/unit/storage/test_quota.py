"""L3 quotas per owner label: the order pages go in (``Shares``) and a shard enforcing it."""

from __future__ import annotations

from pd_cache.core.sealing import Keyring
from pd_cache.storage.base import ExtraInfo
from pd_cache.storage.eviction import Shares, Slot
from pd_cache.storage.memory import MemoryBackend
from pd_cache.storage.seal import SealedStorage, Sealer
from tests.unit.storage.records import Chain, layout_for

Q, N, U = b"quiet", b"noisy", b"unquoted"


def chain_of(policy: Shares, owner: bytes | None, tag: str, n: int) -> list[Slot]:
    """``n`` pages of one chain, each hanging from the one before, 10 bytes each."""
    slots = [("kv", f"{tag}{i}".encode()) for i in range(n)]
    for i, slot in enumerate(slots):
        policy.add(slot, slots[i - 1] if i else ("kv", b"seed"), owner=owner, nbytes=10)
    return slots


def drain(policy: Shares) -> list[Slot]:
    """Every slot in the order ``victim`` gives them."""
    out = []
    while (slot := policy.victim()) is not None:
        out.append(slot)
        policy.remove(slot)
    return out


def test_the_order_pages_go_in_with_quotas() -> None:
    p = Shares()
    p.quotas = {Q: 30, N: 20}
    q = chain_of(p, Q, "q", 3)            # at its quota: protected
    u = chain_of(p, U, "u", 2)            # no quota: shares the rest (the oldest first)
    n = chain_of(p, N, "n", 4)            # 40 bytes over a quota of 20: goes first
    v = chain_of(p, None, "v", 1)         # unsealed: no quota either
    assert p.owned == {Q: 30, U: 20, N: 40, None: 10}
    assert p.over(N) and not p.over(Q) and not p.over(U) and not p.over(None)
    assert p.excess(Q) is None and p.excess(N) == n[3] == p.excess()
    # N's own tails until it is within its quota; then the unquoted owners' least recently
    # used chains (tails first); pages within a quota only once nothing else is left
    # (quotas above the bound), the least recently used first
    assert drain(p) == [n[3], n[2], u[1], u[0], v[0], q[2], q[1], q[0], n[1], n[0]]


def test_a_touch_reorders_only_among_owners_that_share() -> None:
    p = Shares()
    p.quotas = {Q: 100}
    q = chain_of(p, Q, "q", 2)
    a = chain_of(p, U, "a", 1)
    b = chain_of(p, None, "b", 1)
    p.touch(a[0])                         # a is now more recent than b, across owners
    p.touch(q[1])
    assert drain(p) == [b[0], a[0], q[1], q[0]]


def sealed_store(capacity: int) -> SealedStorage:
    return SealedStorage(MemoryBackend(layout_for(), capacity), Sealer(Keyring(bytes(32))))


def test_a_shard_keeps_a_tenant_within_its_quota_and_others_out_of_its_share() -> None:
    layout = layout_for()
    quiet, noisy = Chain(layout, 4, extra_key="q"), [
        Chain(layout, 6, extra_key=f"n{i}", seed=i + 1) for i in range(5)]
    probe = sealed_store(1 << 20)
    probe.batch_set(quiet.names[:1], quiet.records[:1], ExtraInfo(tenant="quiet"))
    page_bytes = probe.inner.usage().bytes   # one sealed page
    store = sealed_store(10 * page_bytes)    # room for both quotas and 3 pages more
    backend = store.inner
    keys = Keyring(bytes(32))
    backend.set_quotas({keys.owner("quiet"): 4 * page_bytes, keys.owner("noisy"): 3 * page_bytes})
    assert store.batch_set(quiet.names, quiet.records, ExtraInfo(tenant="quiet")) == [True] * 4
    most = 0
    for chain in noisy:
        acks = store.batch_set(chain.names, chain.records, ExtraInfo(tenant="noisy"))
        # a chain's first pages fit (older chains of noisy's lose their tails for them);
        # the rest are refused: the page itself would be its quota's next victim
        assert acks == [True] * 3 + [False] * 3
        most = max(most, backend.owner_bytes()[keys.owner("noisy")])
    assert most == 3 * page_bytes
    assert backend.owner_bytes() == {keys.owner("quiet"): 4 * page_bytes,
                                     keys.owner("noisy"): 3 * page_bytes}
    # the quiet tenant's pages all stayed, readable; the noisy one's last chain is its 3
    assert store.batch_exists(quiet.names, ExtraInfo(tenant="quiet")) == 4
    assert store.batch_exists(noisy[-1].names, ExtraInfo(tenant="noisy")) == 3
    assert store.batch_exists(noisy[0].names, ExtraInfo(tenant="noisy")) == 0
    stats = backend.stats()
    assert stats["refused/quota"] == 15 and stats["evicted/"] == 12
    # an unquoted tenant shares what is left: its writes never take the quoted pages
    other = Chain(layout, 8, extra_key="o", seed=9)
    store.batch_set(other.names, other.records, ExtraInfo(tenant="other"))
    assert backend.owner_bytes()[keys.owner("quiet")] == 4 * page_bytes
    assert backend.owner_bytes()[keys.owner("noisy")] == 3 * page_bytes
    assert backend.usage().bytes <= backend.capacity_bytes
    # a lower quota takes effect at once, tails first
    backend.set_quotas({keys.owner("quiet"): 2 * page_bytes})
    assert backend.owner_bytes()[keys.owner("quiet")] == 2 * page_bytes
    assert store.batch_exists(quiet.names, ExtraInfo(tenant="quiet")) == 2
