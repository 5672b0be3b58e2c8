"""Page records: building, verifying, encoding and pickling (no Ray)."""

from __future__ import annotations

import pickle
import struct

import msgspec
import numpy as np
import pytest
import torch
import xxhash

from pd_cache.core.hashing import namespace_seed, page_hashes
from pd_cache.storage.record import (
    RECORD_VERSION,
    PageRecord,
    PoolEntry,
    decode_header,
    encode_header,
    make_record,
    payload_problem,
    verify,
)
from tests.unit.storage.records import DTYPES, bits, layout_for, page, random_bits


@pytest.mark.parametrize("dtype", DTYPES)
def test_header_describes_payload(dtype: torch.dtype) -> None:
    layout = layout_for(dtype)
    rec = page(layout, seed=3)
    (entry,) = rec.header.pools
    payload = rec.payload("kv")
    assert entry.name == "kv" and entry.dtype == layout.kv_dtype
    assert entry.shape == layout.page_shape
    assert entry.checksum == xxhash.xxh3_64_intdigest(bits(payload))
    assert rec.header.prior == namespace_seed(None, None)
    assert rec.nbytes == payload.numel() * payload.element_size()
    assert verify(rec, layout, "xxh3_128", name=rec.name) is None
    assert verify(rec, layout, "xxh3_128", name=rec.name, tokens=[3, 4, 5, 6]) is None


def test_header_bytes_hold_no_token_ids() -> None:
    layout = layout_for()
    tokens = [0xDEADBEEF, 0x0BADF00D, 0xCAFEBABE, 0x5EEDFACE]
    name = page_hashes(tokens, layout.page_size)[0]
    rec = make_record(name, namespace_seed(None, None), tokens,
                      {"kv": random_bits(layout.page_shape, torch.float32, 5)},
                      fingerprint=layout.fingerprint, seed=namespace_seed(None, None))
    raw = encode_header(rec.header)
    assert struct.pack("<4I", *tokens) not in raw
    assert msgspec.msgpack.encode(tokens) not in raw
    for t in tokens:  # not even one of them, in either byte order
        assert struct.pack("<I", t) not in raw and struct.pack(">I", t) not in raw
    assert b"tokens" not in raw
    assert rec.header.version == RECORD_VERSION == 4


def test_reader_checks_the_name_against_its_own_tokens() -> None:
    layout = layout_for()
    rec = page(layout, seed=3)  # legitimately the page of tokens 3 4 5 6
    assert verify(rec, layout, "xxh3_128", name=rec.name, tokens=[3, 4, 5, 6]) is None
    # the same record asked for as the page of other tokens, under the same name
    for other in ([3, 4, 5, 7], [6, 5, 4, 3], np.array([9, 9, 9, 9])):
        problem = verify(rec, layout, "xxh3_128", name=rec.name, tokens=other)
        assert problem is not None and "H(prior || tokens)" in problem
    assert "token ids" in verify(rec, layout, "xxh3_128", name=rec.name, tokens=[3, 4, 5])
    assert "token" in verify(rec, layout, "xxh3_128", name=rec.name, tokens=[3, -4, 5, 6])
    # without tokens (the tier: it has none) everything else is still checked
    assert verify(rec, layout, "xxh3_128", name=rec.name) is None
    assert "version" in verify(tampered(rec, version=2), layout, "xxh3_128", name=rec.name,
                               tokens=[3, 4, 5, 6])


def test_make_record_checks_the_name_but_keeps_no_tokens() -> None:
    layout = layout_for()
    tokens = [1, 2, 3, 4]
    prior = namespace_seed(None, None)
    name = page_hashes(tokens, 4)[0]
    kv = {"kv": random_bits(layout.page_shape, torch.float32, 1)}
    with pytest.raises(ValueError, match=f"name: {name.hex()}"):
        make_record(name, prior, [1, 2, 3, 5], kv, fingerprint=layout.fingerprint)
    with pytest.raises(ValueError, match="name"):
        make_record(name, namespace_seed("lora", None), tokens, kv,
                    fingerprint=layout.fingerprint)
    rec = make_record(name, prior, tokens, kv, fingerprint=layout.fingerprint)
    assert "tokens" not in msgspec.structs.asdict(rec.header)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pickle_is_bit_exact_and_out_of_band(dtype: torch.dtype) -> None:
    rec = page(layout_for(dtype), seed=1)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(rec, protocol=5, buffer_callback=buffers.append)
    # NOTE: the payload travels as one out-of-band buffer: what lets Ray share it zero-copy.
    assert len(buffers) == 1 and len(data) < rec.nbytes
    back = pickle.loads(data, buffers=buffers)
    assert back.header == rec.header
    assert back.payload().dtype == dtype and bits(back.payload()) == bits(rec.payload())
    assert verify(back, layout_for(dtype), "xxh3_128", name=rec.name) is None


def test_header_encoding_round_trip() -> None:
    rec = page(layout_for(), seed=2)
    assert decode_header(encode_header(rec.header)) == rec.header
    with pytest.raises(ValueError, match="record header"):
        decode_header(b"\x93not a header")


def tampered(rec: PageRecord, **changes: object) -> PageRecord:
    return PageRecord(msgspec.structs.replace(rec.header, **changes), rec.payloads)


def test_verify_rejects_every_kind_of_mismatch() -> None:
    layout = layout_for()
    rec = page(layout)
    other_ns = page(layout, extra_key="lora-b")
    entry = rec.header.pools[0]
    flipped = rec.payload().clone()
    flipped.view(torch.uint8).view(-1)[17] ^= 0x01
    wrong_kv = make_record(rec.name, rec.header.prior, [0, 1, 2, 3],
                           {"kv": torch.zeros(2, 2)}, fingerprint=layout.fingerprint)
    cases = {
        "fingerprint": verify(tampered(rec, fingerprint=layout_for(tp_size=2).fingerprint),
                              layout, "xxh3_128", name=rec.name),
        "asked for": verify(rec, layout, "xxh3_128", name=other_ns.name),
        # another namespace's page presented under this namespace's name, to its reader
        "H(prior": verify(tampered(other_ns, name=rec.name), layout, "xxh3_128",
                          name=rec.name, tokens=[0, 1, 2, 3]),
        "prior ": verify(rec, layout, "xxh3_128", name=rec.name, prior=other_ns.name),
        "H(prior || tokens)": verify(rec, layout, "xxh3_128", name=rec.name,
                                     tokens=(0, 1, 2, 99)),
        "checksum": verify(PageRecord(rec.header, (flipped,)), layout, "xxh3_128",
                           name=rec.name),
        "checksum mismatch": verify(tampered(rec, pools=(msgspec.structs.replace(
            entry, checksum=entry.checksum ^ 1),)), layout, "xxh3_128", name=rec.name),
        "version": verify(tampered(rec, version=99), layout, "xxh3_128", name=rec.name),
        "algo": verify(rec, layout, "sha256", name=rec.name),
        "not in record": verify(rec, layout, "xxh3_128", name=rec.name, pool="state"),
        "kv pool": verify(wrong_kv, layout, "xxh3_128", name=rec.name),
        "token ids": verify(rec, layout, "xxh3_128", name=rec.name, tokens=(1, 2, 3)),
    }
    for expected, problem in cases.items():
        assert problem is not None and expected in problem, (expected, problem)


def test_payload_problem_names_shape_and_dtype() -> None:
    rec = page(layout_for())
    wrong_shape = PageRecord(rec.header, (rec.payload().reshape(-1),))
    wrong_dtype = PageRecord(rec.header, (rec.payload().to(torch.float16),))
    assert "shape" in payload_problem(wrong_shape)
    assert "dtype" in payload_problem(wrong_dtype)
    assert "payloads" in payload_problem(PageRecord(rec.header, ()))
    assert payload_problem(rec) is None


def test_sidecar_pools_are_described_and_verified() -> None:
    layout = layout_for()
    tokens = [1, 2, 3, 4]
    name = page_hashes(tokens, 4)[0]
    state = random_bits((3, 5), torch.bfloat16, 9)
    rec = make_record(name, namespace_seed(None, None), tokens,
                      {"kv": random_bits(layout.page_shape, torch.float32, 8), "state": state},
                      fingerprint=layout.fingerprint)
    assert [e.name for e in rec.header.pools] == ["kv", "state"]
    assert rec.header.pools[1] == PoolEntry("state", "bfloat16", (3, 5),
                                            xxhash.xxh3_64_intdigest(bits(state)))
    assert verify(rec, layout, "xxh3_128", name=name, pool="state") is None


@pytest.mark.parametrize("kwargs, match", [
    ({"name": b"short"}, "name"),
    ({"name": b"\x01" * 16}, "name: 01010101"),
    ({"prior": "00" * 16}, "prior"),
    ({"tokens": []}, "tokens"),
    ({"tokens": [1, -2, 3, 4]}, r"tokens\[1\]"),
    ({"pools": {}}, "pools"),
    ({"pools": {"kv/../x": torch.zeros(2)}}, "pools"),
    ({"pools": {"kv": np.zeros(2)}}, "torch.Tensor"),
    ({"pools": {"kv": torch.zeros(2, dtype=torch.complex64)}}, "dtype"),
    ({"algo": "md5"}, "algo"),
])
def test_make_record_rejects_bad_input(kwargs: dict[str, object], match: str) -> None:
    prior = b"\x02" * 16
    args: dict[str, object] = {"name": page_hashes([1, 2, 3, 4], 4, prior=prior)[0],
                               "prior": prior, "tokens": [1, 2, 3, 4],
                               "pools": {"kv": torch.zeros(2)}}
    args.update(kwargs)
    algo = args.pop("algo", "xxh3_128")
    with pytest.raises(ValueError, match=match):
        make_record(args["name"], args["prior"], args["tokens"], args["pools"],
                    fingerprint="f", algo=algo)
