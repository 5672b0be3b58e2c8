"""The OpenAI answer's ``finish_reason``, and refusals that name the field the client sent
(in OpenAI's ranges and words) with OpenAI's error type."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pd_cache.core.request import Req, SamplingParams
from pd_cache.core.wire import Completion
from pd_cache.front.http import HTTPError, decode_json, value_error
from pd_cache.front.openai import (
    ChatRequest,
    Chunks,
    CompletionRequest,
    answer,
    client_names,
    finish_reason,
)
from pd_cache.front.tokenizer import ByteTokenizer


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


def refusal(body: dict[str, Any], chat: bool = False) -> HTTPError:
    """The 400 the front answers ``body`` with, at decoding (all the front checks alone)."""
    kind = ChatRequest if chat else CompletionRequest
    with pytest.raises(HTTPError) as err:
        decode_json(json.dumps({"model": "m", **body}).encode(), kind)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize("field, value", [
    ("temperature", 1e308), ("temperature", 2.01), ("temperature", -0.5),
    ("top_p", 1.5), ("top_p", -0.1), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("max_tokens", -1), ("max_completion_tokens", -1), ("n", 0), ("n", 2),
])
def test_sampling_fields_outside_openais_ranges_are_refused_naming_the_field(
        field: str, value: float) -> None:
    for chat, prompt in ((False, {"prompt": "x"}),
                         (True, {"messages": [{"role": "user", "content": "x"}]})):
        assert refusal({**prompt, field: value}, chat).param == field


def test_sampling_fields_at_openais_bounds_are_accepted() -> None:
    body = decode_json(json.dumps({"model": "m", "prompt": "x", "temperature": 2, "top_p": 0,
                                   "presence_penalty": -2, "frequency_penalty": 2,
                                   "max_tokens": 0, "n": 1}).encode(), CompletionRequest)
    assert body.temperature == 2 and body.new_tokens == 0


def test_a_bad_chat_role_names_the_message() -> None:
    with pytest.raises(ValueError) as err:
        ByteTokenizer(512).chat([{"role": "user", "content": "a"}, {"role": "robot"}])
    refused = value_error(err.value)
    assert refused.param == "messages[1].role" and "robot" in refused.message


@pytest.mark.parametrize("chat, sent, prompt_field, tokens_field", [
    (True, {"max_tokens": 600}, "messages", "max_tokens"),
    (False, {"max_completion_tokens": 600}, "prompt", "max_completion_tokens"),
    (False, {}, "prompt", "max_tokens"),
])
def test_a_context_overflow_names_what_the_client_sent(chat: bool, sent: dict[str, int],
                                                       prompt_field: str,
                                                       tokens_field: str) -> None:
    prompt = {"messages": [{"role": "user", "content": "x" * 500}]} if chat else \
        {"prompt": "x" * 1020}
    body = decode_json(json.dumps({"model": "m", **prompt, **sent}).encode(),
                       ChatRequest if chat else CompletionRequest)
    with pytest.raises(ValueError) as err:
        Req(rid="r", input_ids=[1] * 1020,
            max_new_tokens=body.new_tokens).check_model(max_context=1024)
    refused = value_error(err.value, client_names(body, chat))
    assert refused.param == prompt_field
    assert "input_ids" not in refused.message and "max_new_tokens" not in refused.message
    assert f"{tokens_field}={body.new_tokens}" in refused.message


def test_a_token_outside_the_vocabulary_names_the_prompt_or_the_messages() -> None:
    for chat, want in ((False, "prompt[2]"), (True, "messages")):
        body = ChatRequest(model="m", messages=[]) if chat else \
            CompletionRequest(model="m", prompt=[1, 2, 10**6])
        with pytest.raises(ValueError) as err:
            Req(rid="r", input_ids=[1, 2, 10**6]).check_model(vocab_size=512)
        assert value_error(err.value, client_names(body, chat)).param == want
    with pytest.raises(ValueError) as err:
        Req(rid="r", input_ids=[1],
            sampling=SamplingParams(stop_token_ids=(600,))).check_model(vocab_size=512)
    body = CompletionRequest(model="m", prompt="x")
    assert value_error(err.value, client_names(body, False)).param == "stop_token_ids"


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (405, "invalid_request_error"), (413, "invalid_request_error"),
    (415, "invalid_request_error"), (429, "rate_limit_error"), (503, "service_unavailable"),
])
def test_every_status_the_front_answers_has_openais_error_type(status: int, kind: str) -> None:
    assert HTTPError(status, "no").body()["error"]["type"] == kind
def test_admin_usage_chunk_carries_the_prefill_time_and_the_ingress_hops() -> None:


    out = completion([3, 2])._replace(prefill_s=0.0042)
    hops = {"received_ns": 10, "first_token_ns": 20}
    event = Chunks("cmpl-1", "m", False).usage(out, True, hops)
    shown = json.loads(event.removeprefix("data: "))["pd_cache"]
    assert shown["prefill_ms"] == 4.2 and shown["ttft_ms"] == 10.0
    assert shown["received_ns"] == 10 and shown["first_token_ns"] == 20
    assert "pd_cache" not in json.loads(
        Chunks("cmpl-1", "m", False).usage(out, False, hops).removeprefix("data: "))
