"""The OpenAI answer's ``finish_reason``: ``stop`` when it ended on a stop id."""

from __future__ import annotations

from pd_cache.core.wire import Completion
from pd_cache.front.openai import Chunks, answer, finish_reason


def completion(output_ids: list[int]) -> Completion:
    return Completion("r", output_ids, 4, {"device": 0, "host": 0, "storage": 0}, 0, 0,
                      0.01, 0.02, 1, 0, 1, 0.01, 0.0, 0.01)


def test_finish_reason_is_stop_only_when_the_last_token_is_a_stop_id() -> None:
    assert finish_reason(completion([5, 9, 2]), (2,)) == "stop"
    assert finish_reason(completion([5, 2, 9]), (2,)) == "length"   # ran to max_tokens
    assert finish_reason(completion([5, 9, 2]), ()) == "length"
    assert finish_reason(completion([]), (2,)) == "length"
    body = answer("cmpl-1", "m", False, "text", completion([3, 2]), False, (2,))
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 2
    assert '"finish_reason": "stop"' in Chunks("cmpl-1", "m", True).token("", None, "stop")


def test_admin_usage_chunk_carries_the_prefill_time_and_the_ingress_hops() -> None:
    import json

    out = completion([3, 2])._replace(prefill_s=0.0042)
    hops = {"received_ns": 10, "first_token_ns": 20}
    event = Chunks("cmpl-1", "m", False).usage(out, True, hops)
    shown = json.loads(event.removeprefix("data: "))["pd_cache"]
    assert shown["prefill_ms"] == 4.2 and shown["ttft_ms"] == 10.0
    assert shown["received_ns"] == 10 and shown["first_token_ns"] == 20
    assert "pd_cache" not in json.loads(
        Chunks("cmpl-1", "m", False).usage(out, False, hops).removeprefix("data: "))
