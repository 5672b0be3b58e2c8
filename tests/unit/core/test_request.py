"""Req admission: every refusal names the field and the value."""

from __future__ import annotations

import msgspec
import pytest

from pd_cache.core.hashing import MAX_TOKEN
from pd_cache.core.request import Req, SamplingParams


def admit(vocab_size=MAX_TOKEN, max_context=None, **fields):
    req = Req(**{"rid": "r1", "input_ids": [1, 2, 3], **fields})
    req.check_model(vocab_size=vocab_size, max_context=max_context)
    return req


def test_defaults_are_greedy_and_empty_output() -> None:
    req = admit()
    assert req.sampling.greedy and req.output_ids == [] and req.max_new_tokens == 16
    assert req.namespace == (None, None)


@pytest.mark.parametrize("fields, field, value", [
    ({"input_ids": []}, "input_ids", "empty"),
    ({"input_ids": [1, -5]}, "input_ids[1]", "-5"),
    ({"input_ids": [2**32]}, "input_ids[0]", "4294967296"),
    ({"input_ids": [1, 2.5]}, "input_ids[1]", "2.5"),
    ({"input_ids": "abc"}, "input_ids", "str"),
    ({"input_ids": [5, 700], "vocab_size": 512}, "input_ids[1]", "700"),
    ({"extra_key": ""}, "extra_key", "''"),
    ({"cache_salt": ""}, "cache_salt", "''"),
    ({"cache_salt": 7}, "cache_salt", "7"),
    ({"extra_key": "x" * 257}, "extra_key", "257"),
    ({"cache_salt": "é" * 129}, "cache_salt", "258"),
    ({"max_new_tokens": -1}, "max_new_tokens", "-1"),
    ({"max_new_tokens": True}, "max_new_tokens", "True"),
    ({"rid": ""}, "rid", "''"),
    ({"input_ids": [1] * 10, "max_new_tokens": 7, "max_context": 16}, "input_ids", "16"),
])
def test_refusals_name_field_and_value(fields, field, value) -> None:
    with pytest.raises(ValueError) as info:
        admit(**fields)
    assert field in str(info.value)
    assert value in str(info.value)


def test_namespace_limits_are_inclusive() -> None:
    assert admit(extra_key="x" * 256, cache_salt="é" * 128).extra_key == "x" * 256
    assert admit(input_ids=[1] * 9, max_new_tokens=7, max_context=16)


def test_wire_round_trip_validates_on_decode() -> None:
    req = admit(extra_key="lora", cache_salt="t", sampling=SamplingParams(temperature=0.5))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=Req) == req
    bad = msgspec.json.encode({"rid": "x", "input_ids": [1], "cache_salt": ""})
    with pytest.raises(msgspec.ValidationError, match="cache_salt"):
        msgspec.json.decode(bad, type=Req)


def test_numpy_and_tuple_prompts_become_lists() -> None:
    import numpy as np

    assert admit(input_ids=np.array([4, 5])).input_ids == [4, 5]
    assert admit(input_ids=(4, 5)).input_ids == [4, 5]


def test_bad_sampling() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_stop_token_ids_are_token_ids_inside_the_vocabulary() -> None:
    assert SamplingParams(stop_token_ids=[7, 9]).stop_token_ids == (7, 9)
    assert SamplingParams(stop_token_ids=(7,)).stops([1, 7])
    assert not SamplingParams(stop_token_ids=(7,)).stops([7, 1])
    assert not SamplingParams().stops([7]) and not SamplingParams(stop_token_ids=(7,)).stops([])
    for bad in ([-1], ["7"], "7", [True], 7, [1.5]):
        with pytest.raises(ValueError, match="sampling.stop_token_ids"):
            SamplingParams(stop_token_ids=bad)
    with pytest.raises(ValueError, match=r"sampling.stop_token_ids: token id 999 .*\[0, 100\)"):
        admit(sampling=SamplingParams(stop_token_ids=(5, 999)), vocab_size=100)


def test_a_process_derives_the_seed_once_and_never_receives_it(monkeypatch) -> None:
    import pickle

    from pd_cache.core import request
    from pd_cache.core.hashing import namespace_seed, page_hashes
    from pd_cache.core.request import compute_prefix_hash

    calls = []

    def counted(*args):
        calls.append(args)
        return namespace_seed(*args)

    monkeypatch.setattr(request, "namespace_seed", counted)
    req = admit(input_ids=list(range(12)), extra_key="lora", cache_salt="t")
    assert req.namespace_seed() == namespace_seed("lora", "t")
    assert compute_prefix_hash(req, req.input_ids, page_size=4) == \
        page_hashes(req.input_ids, 4, extra_key="lora", cache_salt="t")
    assert req.namespace_seed("sha256") == namespace_seed("lora", "t", "sha256")
    assert len(calls) == 2                       # once per algorithm, in this process
    # Neither the wire nor pickle carries it: a receiver derives its own from its fields.
    for received in (msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=Req),
                     pickle.loads(pickle.dumps(req)),
                     msgspec.structs.replace(req, cache_salt="u")):
        assert received.namespace_seed() == namespace_seed("lora", received.cache_salt)
    assert len(calls) == 5


def test_admission_runs_once_per_model_in_a_process() -> None:
    import pickle

    req = admit(input_ids=[5, 700], vocab_size=1000)
    req.input_ids[1] = 2000                      # never done: fields do not change once admitted
    req.check_model(vocab_size=1000)             # admitted against this model already
    with pytest.raises(ValueError, match="input_ids\\[1\\]"):
        req.check_model(vocab_size=1500)         # another model checks again
    with pytest.raises(ValueError, match="input_ids\\[1\\]"):
        pickle.loads(pickle.dumps(req)).check_model(vocab_size=1000)   # another process too
