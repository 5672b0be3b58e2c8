"""The page-hash chain against the spec vectors, and its properties."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_cache.core import hashing
from pd_cache.core.hashing import from_hex, namespace_seed, page_hashes, to_hex, token_buffer
from pd_cache.core.request import Req, compute_prefix_hash

# NOTE: the design's own copy of the vectors, when its folder sits beside the checkout.
DESIGN_VECTORS = Path(__file__).parents[4] / "shared" / "vectors" / "hash_chain_v1.json"
ALGOS = ("xxh3_128", "sha256")

tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=80)
namespace_st = st.one_of(st.none(), st.text(max_size=12))


def load_cases(data_dir: Path) -> list[dict]:
    return json.loads((data_dir / "hash_chain_v1.json").read_text())["cases"]


def test_vectors_copy_matches_the_design_vectors(data_dir: Path) -> None:
    if not DESIGN_VECTORS.exists():
        pytest.skip("the design vectors are not beside this checkout")
    ours = json.loads((data_dir / "hash_chain_v1.json").read_text())
    design = json.loads(DESIGN_VECTORS.read_text())
    assert (ours["version"], ours["cases"]) == (design["version"], design["cases"])


def test_every_vector_reproduced(data_dir: Path) -> None:
    cases = load_cases(data_dir)
    assert len(cases) >= 40
    for case in cases:
        ns = {"extra_key": case["extra_key"], "cache_salt": case["cache_salt"]}
        seed = namespace_seed(algo=case["algo"], **ns)
        assert to_hex(seed) == case["seed"]
        names = page_hashes(case["tokens"], case["page_size"], algo=case["algo"], **ns)
        assert [to_hex(n) for n in names] == case["page_hashes"]
        assert len(names) == len(case["tokens"]) // case["page_size"]


def test_vector_continuation_split(data_dir: Path) -> None:
    split = [c for c in load_cases(data_dir) if "split_at" in c]
    assert split
    for case in split:
        k = case["split_at"]
        ns = {"extra_key": case["extra_key"], "cache_salt": case["cache_salt"]}
        head = page_hashes(case["tokens"][:k], case["page_size"], algo=case["algo"], **ns)
        tail = page_hashes(case["tokens"][k:], case["page_size"], prior=head[-1],
                           algo=case["algo"], **ns)
        assert [to_hex(n) for n in head + tail] == case["page_hashes"]


def test_native_and_python_loops_agree() -> None:
    rng = np.random.default_rng(7)
    buf = rng.integers(0, 2**32, size=4099, dtype=np.uint64).astype("<u4")
    prior = namespace_seed("a", "b")
    raw = memoryview(buf).cast("B")
    for page_size in (1, 3, 16, 64):
        want = hashing._python_chain(hashing.digest_fn("xxh3_128"), prior, raw, page_size * 4,
                                     len(buf) // page_size)
        assert page_hashes(buf, page_size, prior=prior) == want


@settings(max_examples=150, deadline=None)
@given(tokens=tokens_st, page_size=st.integers(1, 9), cut=st.integers(0, 20),
       algo=st.sampled_from(ALGOS), ek=namespace_st, salt=namespace_st)
def test_continuation_equals_full_chain(tokens, page_size, cut, algo, ek, salt) -> None:
    full = page_hashes(tokens, page_size, extra_key=ek, cache_salt=salt, algo=algo)
    k = min(cut, len(full))
    prior = full[k - 1] if k else None
    rest = page_hashes(tokens[k * page_size:], page_size, extra_key=ek, cache_salt=salt,
                       prior=prior, algo=algo)
    assert full[:k] + rest == full


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
       page_size=st.integers(1, 4), a=st.tuples(namespace_st, namespace_st),
       b=st.tuples(namespace_st, namespace_st), algo=st.sampled_from(ALGOS))
def test_different_namespaces_share_no_name(tokens, page_size, a, b, algo) -> None:
    if a == b:
        return
    names_a = page_hashes(tokens, page_size, extra_key=a[0], cache_salt=a[1], algo=algo)
    names_b = page_hashes(tokens, page_size, extra_key=b[0], cache_salt=b[1], algo=algo)
    assert not set(names_a) & set(names_b)


@pytest.mark.parametrize("algo", ALGOS)
def test_none_and_empty_string_differ(algo: str) -> None:
    assert namespace_seed(None, None, algo) != namespace_seed("", None, algo)
    assert namespace_seed(None, None, algo) != namespace_seed(None, "", algo)
    assert namespace_seed("", None, algo) != namespace_seed(None, "", algo)
    assert namespace_seed("ab", None, algo) != namespace_seed("a", "b", algo)


@settings(max_examples=80, deadline=None)
@given(tokens=tokens_st, page_size=st.integers(1, 8))
def test_list_numpy_torch_inputs_agree(tokens, page_size) -> None:
    want = page_hashes(tokens, page_size)
    assert page_hashes(np.array(tokens, dtype=np.uint32), page_size) == want
    assert page_hashes(np.array(tokens, dtype=np.int64), page_size) == want
    assert page_hashes(torch.tensor(tokens, dtype=torch.int64), page_size) == want
    assert page_hashes(tuple(tokens), page_size) == want


def _names_in_child(args: tuple) -> list[str]:
    tokens, page_size, ek, salt, algo = args
    return [to_hex(n) for n in page_hashes(tokens, page_size, extra_key=ek, cache_salt=salt,
                                           algo=algo)]


def test_names_identical_in_a_spawned_process() -> None:
    rng = np.random.default_rng(3)
    jobs = [(rng.integers(0, 2**32, size=n, dtype=np.uint64).tolist(), ps, ek, salt, algo)
            for n, ps in ((100, 16), (257, 4)) for ek in (None, "lora")
            for salt in (None, "tenant") for algo in ALGOS]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        remote = pool.map(_names_in_child, jobs)
    assert remote == [_names_in_child(job) for job in jobs]


@pytest.mark.parametrize("bad, where", [
    ([1, -1], "tokens[1]"), ([2**32], "tokens[0]"), ([1, 2, True], "tokens[2]"),
    ([0.5], "tokens[0]"), ([1, "7"], "tokens[1]"), (np.array([3, -2]), "tokens[1]"),
    (np.array([1.0]), "dtype"), (torch.tensor([[1, 2]]), "1-D"), ("123", "sequence"),
    (np.array([2**33], dtype=np.uint64), "tokens[0]"),
])
def test_bad_tokens_name_the_position(bad, where) -> None:
    with pytest.raises(ValueError, match=where.replace("[", r"\[").replace("]", r"\]")):
        page_hashes(bad, 1)


def test_bad_page_size_algo_prior() -> None:
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1], 0)
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1], True)
    with pytest.raises(ValueError, match="algo"):
        page_hashes([1], 1, algo="md5")
    with pytest.raises(ValueError, match="prior"):
        page_hashes([1], 1, prior=b"short")
    with pytest.raises(ValueError, match="prior"):
        page_hashes([1], 1, prior=bytes(16), algo="sha256")
    with pytest.raises(ValueError, match="extra_key"):
        namespace_seed(3, None)  # type: ignore[arg-type]


def test_partial_page_has_no_name() -> None:
    assert page_hashes([1, 2, 3], 4) == []
    assert page_hashes([], 4) == []
    assert len(page_hashes(list(range(9)), 4)) == 2
    assert page_hashes(list(range(8)), 4) == page_hashes(list(range(9)), 4)


def test_compute_prefix_hash_reads_the_request_namespace() -> None:
    req = Req(rid="r", input_ids=[1, 2, 3, 4], extra_key="lora-x", cache_salt="t1")
    tokens = list(range(32))
    want = page_hashes(tokens, 8, extra_key="lora-x", cache_salt="t1")
    assert compute_prefix_hash(req, tokens, page_size=8) == want
    assert compute_prefix_hash(req, tokens[16:], want[1], page_size=8) == want[2:]
    assert compute_prefix_hash(req, tokens, page_size=8) != page_hashes(tokens, 8)


def test_hex_round_trip_and_refusals() -> None:
    name = page_hashes([1, 2], 2)[0]
    assert from_hex(to_hex(name)) == name
    assert to_hex(name) == to_hex(name).lower() and len(to_hex(name)) == 32
    assert from_hex(to_hex(page_hashes([1], 1, algo="sha256")[0]), "sha256")
    with pytest.raises(ValueError, match="not a hex"):
        from_hex("zz" * 16)
    with pytest.raises(ValueError, match="bytes"):
        from_hex("ab" * 15)
    with pytest.raises(ValueError, match="bytes"):
        from_hex(to_hex(name), "sha256")


def test_token_buffer_is_uint32_little_endian() -> None:
    buf = token_buffer([1, 2**32 - 1])
    assert buf.dtype == np.dtype("<u4") and buf.tobytes() == b"\x01\0\0\0\xff\xff\xff\xff"
