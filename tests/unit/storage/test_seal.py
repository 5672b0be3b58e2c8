"""Sealed L3 records on a real disk store: what a store (or a thief of its files) sees is
ciphertext; the tenant reads its pages back bit for bit; anyone else, a relabelled record,
a retired or purged key, reads nothing (a counted miss)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from pd_cache.core.config import PDCacheConfig
from pd_cache.core.sealing import Keyring
from pd_cache.core.vocab import MissReason
from pd_cache.model.model import Model
from pd_cache.storage import PageRecord, make_record, spread
from pd_cache.storage.base import ExtraInfo
from pd_cache.storage.disk import FRAME, MAGIC, DiskBackend
from pd_cache.storage.record import as_bytes, decode_header, encode_header
from pd_cache.storage.seal import AEADS, SealedStorage, Sealer
from tests.unit.storage.records import Chain, bits, layout_for
from tests.unit.storage.recovery import recover, vocabulary_v_rows

SECRET = bytes(range(32))


def sealed(inner: DiskBackend, *, enabled: bool = True,
           keyring: Keyring | None = None) -> SealedStorage:
    return SealedStorage(inner, Sealer(keyring or Keyring(SECRET), enabled=enabled))


def as_tenant(tenant: str) -> ExtraInfo:
    return ExtraInfo(tenant=tenant)


def test_a_sealed_round_trip_and_who_may_read(tmp_path: Path) -> None:
    layout = layout_for()
    chain = Chain(layout, 3)
    keys = Keyring(SECRET)
    store = sealed(DiskBackend(tmp_path, layout, 1 << 20), keyring=keys)
    assert store.batch_set(chain.names, chain.records, as_tenant("acme")) == [True] * 3
    # the store holds ciphertext: no payload byte string of the page is in its files
    files = sorted(tmp_path.rglob("*.rec"))
    assert len(files) == 3
    for f, rec in zip(files, sorted(chain.records, key=lambda r: r.name.hex())):
        assert bits(rec.payload())[:64] not in f.read_bytes()
    got = store.batch_get(chain.names, as_tenant("acme"))
    for g, want in zip(got, chain.records):
        assert g is not None and g.header.seal is None and g.header.name == want.name
        assert bits(g.payload()) == bits(want.payload())
    # another tenant, and the same tenant with another secret, get misses, counted
    assert store.batch_get(chain.names, as_tenant("other")) == [None] * 3
    thief = sealed(store.inner, keyring=Keyring(bytes(32)))
    assert thief.batch_get(chain.names, as_tenant("acme")) == [None] * 3
    assert store.stats()["miss/verification_failed"] == 3
    assert thief.stats()["miss/verification_failed"] == 3
    # rotation: a new version for new writes, the old records readable until retired
    keys.state = keys.state.rotated()
    assert all(store.batch_get(chain.names, as_tenant("acme")))
    keys.state = keys.state.retired()
    assert store.batch_get(chain.names, as_tenant("acme")) == [None] * 3
    assert store.stats()["miss/key_retired"] == 3
    assert store.inner.usage().records == 0   # the reader had the store discard them
    # a purge retires the tenant's keys at once, and the store reclaims its records
    other = Chain(layout, 2, seed=9)
    assert store.batch_set(chain.names, chain.records, as_tenant("acme")) == [True] * 3
    assert store.batch_set(other.names, other.records, as_tenant("beta")) == [True] * 2
    assert all(store.batch_get(chain.names, as_tenant("acme")))
    keys.state = keys.state.purged("acme")
    assert store.batch_get(chain.names[:1], as_tenant("acme")) == [None]
    assert store.inner.reclaim(owners=[keys.owner("acme")]) == 2
    assert len(list(tmp_path.rglob("*.rec"))) == 2
    assert all(store.batch_get(other.names, as_tenant("beta")))
    # a retirement lets the store reclaim every record sealed under an older version
    keys.state = keys.state.rotated()
    assert store.inner.reclaim(below=keys.state.version) == 2
    assert list(tmp_path.rglob("*.rec")) == []


def test_a_relabelled_record_is_refused(tmp_path: Path) -> None:
    """A store renames page 1's record to page 1 of another chain (same position, a valid
    name, shapes and header checksum intact): the reader asking for that page refuses it."""
    layout = layout_for()
    mine, theirs = Chain(layout, 2, seed=1), Chain(layout, 2, seed=2)
    disk = DiskBackend(tmp_path, layout, 1 << 20, fsync=False)
    store = sealed(disk)
    assert store.batch_set(mine.names, mine.records, as_tenant("t")) == [True, True]
    src = disk._path(("kv", mine.names[1]))
    raw = src.read_bytes()
    _, size, _ = FRAME.unpack_from(raw)
    header = decode_header(raw[FRAME.size:FRAME.size + size])
    forged = encode_header(msgspec.structs.replace(header, name=theirs.names[1],
                                                   prior=theirs.names[0]))
    assert len(forged) == size
    import xxhash
    out = FRAME.pack(MAGIC, size, xxhash.xxh3_64_intdigest(forged)) + forged \
        + raw[FRAME.size + size:]
    dst = disk._path(("kv", theirs.names[1]))
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(out)
    reopened = DiskBackend(tmp_path, layout, 1 << 20, fsync=False)  # indexes the forged file
    assert reopened.batch_get([theirs.names[1]])[0] is not None   # the store sees no fault
    reader = sealed(reopened)
    assert reader.batch_get([theirs.names[1]], as_tenant("t")) == [None]
    assert reader.stats()["miss/verification_failed"] == 1


@pytest.mark.parametrize("seal", [True, False])
def test_stored_records_give_no_prompt_back(tmp_path: Path, seal: bool) -> None:
    """Sealed: nothing recovered from the files. Unsealed (the baseline): the whole prompt
    is, so the attack works and the sealed result means something."""
    cfg = PDCacheConfig()
    layout, model = cfg.layout, Model(cfg.model)
    ps = layout.page_size
    prompt = torch.randint(0, cfg.model.vocab_size, (4 * ps,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    kv = model(prompt).kv   # [2, L, T, Hkv, D]
    from pd_cache.core.hashing import namespace_seed, page_hashes
    names = page_hashes(prompt, ps)
    priors = [namespace_seed(None, None), *names[:-1]]
    records = [make_record(names[i], priors[i], prompt[i * ps:(i + 1) * ps],
                           {"kv": kv[:, :, i * ps:(i + 1) * ps].contiguous()},
                           fingerprint=layout.fingerprint, sums=not seal)
               for i in range(len(names))]
    store = sealed(DiskBackend(tmp_path, layout, 1 << 24, fsync=False), enabled=seal)
    assert store.batch_set(names, records, as_tenant("acme")) == [True] * len(names)
    table = vocabulary_v_rows(model)
    dtype = getattr(torch, layout.kv_dtype)
    thief = DiskBackend(tmp_path, layout, 1 << 24, fsync=False)   # the files, no key
    stolen: list[PageRecord | None] = thief.batch_get(names)
    found = [t for rec in stolen if rec is not None
             for t in recover(rec.payload(), table, layout.page_shape, dtype)]
    assert len(found) == len(prompt)
    if seal:
        assert [t for t in found if t is not None] == []
    else:
        assert found == prompt


@pytest.mark.parametrize("aead", sorted(AEADS))
def test_each_aead_is_the_standard_one_over_payload_and_header(aead: str) -> None:
    """What a sealer writes opens with the textbook AEAD (key, nonce, header as associated
    data), and what it opens is the page's plaintext."""
    page = Chain(layout_for(), 1).records[0]
    keys = Keyring(SECRET)
    sealer = Sealer(keys, aead=aead)
    rec = sealer.seal(page, "t")
    assert rec.header.seal is not None
    key = keys.key("t", keys.current("t"))
    plain = AEADS[aead](key).decrypt(rec.header.seal.nonces[0], as_bytes(rec.payloads[0]),
                                     encode_header(rec.header))
    assert plain == bits(page.payload())
    opened = sealer.open(rec, "t").record
    assert opened is not None and bits(opened.payload()) == plain
    assert opened.header == msgspec.structs.replace(rec.header, seal=None)


@pytest.mark.parametrize("aead", sorted(AEADS))
def test_a_payload_of_the_wrong_length_is_a_verification_failure(aead: str) -> None:
    """A sealed payload cut short or grown (its header unchanged) opens into nothing: a
    counted refusal, not an error, and the slot it was read for is not written as valid."""
    page = Chain(layout_for(), 1).records[0]
    sealer = Sealer(Keyring(SECRET), aead=aead)
    rec = sealer.seal(page, "t")
    slot = torch.zeros_like(page.payload())
    for payload in (rec.payloads[0][:-1], torch.cat([rec.payloads[0], rec.payloads[0][:1]])):
        got = sealer.open(PageRecord(rec.header, (payload,)), "t", (slot,))
        assert got.record is None and got.reason == MissReason.VERIFICATION_FAILED
    assert bits(sealer.open(rec, "t", (slot,)).record.payload()) == bits(page.payload())


def test_no_nonce_repeats_under_a_key_across_payloads_and_the_counter_wrap() -> None:
    """Every payload of every record gets a nonce of its own: a record of two pools takes
    two, and the counter's wrap moves to a new random prefix instead of starting over."""
    chain = Chain(layout_for(), 1)
    two = chain.record(0, {"kv": chain.records[0].payload(), "state": torch.ones(4)})
    sealer = Sealer(Keyring(SECRET))
    sealer._count = 0xFFFFFFFF - 3   # a few nonces before the counter wraps
    seen = [n for _ in range(4) for n in sealer.seal(two, "t").header.seal.nonces]
    assert len(seen) == 8 and len(set(seen)) == 8
    assert all(len(n) == 12 for n in seen)
    assert len({n[:8] for n in seen}) == 2   # the prefix changed once, at the wrap


@pytest.mark.parametrize("seal", [True, False])
def test_pages_land_straight_in_the_slots_they_are_read_for(tmp_path: Path, seal: bool,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """Sets seal into one reused buffer, on two threads; a get into slots opens (sealed) or
    copies (unsealed) each page into its slot, the slot is the record's payload, and a
    damaged record is a counted miss while the pages around it still land."""
    monkeypatch.setattr(spread, "PARALLEL_MIN_BYTES", 1)   # two threads even for tiny pages
    layout = layout_for()
    chain, other = Chain(layout, 4, seed=1), Chain(layout, 4, seed=2)
    disk = DiskBackend(tmp_path, layout, 1 << 20, fsync=False)
    store = SealedStorage(disk, Sealer(Keyring(SECRET), enabled=seal), scratch_bytes=1 << 20,
                          threads=2)
    assert store.batch_set(chain.names, chain.records, as_tenant("t")) == [True] * 4
    # the next set reuses the buffer: what the first one stored is untouched
    assert store.batch_set(other.names, other.records, as_tenant("t")) == [True] * 4
    slots = torch.zeros((4, *layout.page_shape), dtype=torch.float32)
    got = store.submit_get_into(chain.names, list(slots), as_tenant("t")).result()
    for g, row, want in zip(got, slots, chain.records):
        assert g is not None and g.payload().data_ptr() == row.data_ptr()
        assert bits(row) == bits(want.payload())
    if not seal:
        return
    path = disk._path(("kv", chain.names[2]))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF   # the last byte of the tag
    path.write_bytes(bytes(raw))
    slots.zero_()
    got = store.submit_get_into(chain.names, list(slots), as_tenant("t")).result()
    assert [g is None for g in got] == [False, False, True, False]
    assert bits(slots[3]) == bits(chain.records[3].payload())
    assert store.stats()["miss/verification_failed"] == 1
    with pytest.raises(ValueError, match="into"):
        store.submit_get_into(chain.names, list(slots[:2]), as_tenant("t"))
