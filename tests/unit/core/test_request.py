"""Req admission: every refusal names the field and the value."""

from __future__ import annotations

import msgspec
import pytest

from pd_cache.core.request import Req, SamplingParams


def admit(**fields):
    base = {"rid": "r1", "input_ids": [1, 2, 3]}
    return Req.admit(**{**base, **fields})


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
