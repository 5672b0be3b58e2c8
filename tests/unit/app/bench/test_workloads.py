"""Generated workloads: stream structure, prompts assembled from answers, namespaces, lengths,
and the cache each one leaves for the oracle (page rule of the server)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pd_cache.app.bench.lengths import Fixed, LogNormal, Uniform, parse_length
from pd_cache.app.bench.oracle import OracleRequest, simulate
from pd_cache.app.bench.workloads import (
    BenchRequest,
    Segment,
    Workload,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
    tenant_namespace,
)

PS = 4
SYSTEM, USER, OUTPUT = 10, 3, 7


def fake_answers(workload: Workload) -> dict[int, list[int]]:
    """A distinct answer of ``max_tokens`` tokens per request (ids past the vocabulary)."""
    return {r.index: [100_000 + 100 * r.index + k for k in range(r.max_tokens)]
            for r in workload.requests}


def run_sequentially(workload: Workload, answers: dict[int, list[int]]) -> list[OracleRequest]:
    """Each request sent at ``index`` and done half a second later."""
    return [OracleRequest(r.index, r.cache_salt, r.extra_key, r.prompt_ids(answers),
                          answers[r.index], float(r.index), r.index + 0.5)
            for r in workload.requests]


def chat(turn_order: str = "round-robin") -> Workload:
    return multi_turn_workload(2, 3, 3, system_tokens=SYSTEM, user_tokens=USER,
                               output_tokens=OUTPUT, vocab_size=50, seed=5,
                               turn_order=turn_order)


@pytest.mark.parametrize("turn_order", ["round-robin", "random"])
def test_multi_turn_structure_and_prompts(turn_order: str) -> None:
    w = chat(turn_order)
    assert len(w.requests) == 2 * 3 * 3 and w.tenants == 2
    answers = fake_answers(w)
    sessions: dict[str, list[BenchRequest]] = {}
    for r in w.requests:
        sessions.setdefault(r.session, []).append(r)
    assert sorted(sessions) == ["t0u0", "t0u1", "t0u2", "t1u0", "t1u1", "t1u2"]
    for turns in sessions.values():
        assert [r.turn for r in turns] == [0, 1, 2]
        assert turns[0].depends_on is None
        assert [r.depends_on for r in turns[1:]] == [r.index for r in turns[:-1]]
        system = turns[0].segments[0].tokens
        users = [r.segments[-1].tokens for r in turns]
        for r in turns:
            want = list(system)
            for k in range(r.turn):
                want += list(users[k]) + answers[turns[k].index]
            assert r.prompt_ids(answers) == want + list(users[r.turn])
            assert (r.cache_salt, r.extra_key) == tenant_namespace(r.tenant)
            assert r.max_tokens == OUTPUT and r.offset_s is None
    # one system prompt per tenant, shared by its users
    for t in range(2):
        assert len({r.segments[0].tokens for r in w.requests if r.tenant == t}) == 1


def test_round_robin_reuse_distance_is_one_round() -> None:
    w = chat()
    assert [r.session for r in w.requests[:6]] == ["t0u0", "t1u0", "t0u1", "t1u1", "t0u2",
                                                   "t1u2"]
    assert all(r.index - r.depends_on == 6 for r in w.requests if r.depends_on is not None)
    distances = {r.index - r.depends_on for r in chat("random").requests if r.depends_on}
    assert len(distances) > 1


def test_a_preamble_starts_every_prompt_and_leaves_the_rest_of_the_stream_alone() -> None:
    plain = chat()
    w = multi_turn_workload(2, 3, 3, system_tokens=SYSTEM, user_tokens=USER,
                            output_tokens=OUTPUT, vocab_size=50, seed=5, preamble_tokens=9)
    answers = fake_answers(w)
    preamble = w.requests[0].prompt_ids(answers)[:9]
    assert len(set(preamble)) > 1
    for r, p in zip(w.requests, plain.requests):
        # the same tokens in every namespace, then exactly the stream without a preamble
        assert r.prompt_ids(answers) == preamble + p.prompt_ids(answers)
        assert (r.session, r.turn, r.depends_on) == (p.session, p.turn, p.depends_on)
    assert {r.cache_salt for r in w.requests} == {"tenant-0", "tenant-1"}
    assert "preamble 9" in w.describe() and "preamble" not in plain.describe()


def test_tenant_namespaces() -> None:
    assert tenant_namespace(0) == ("tenant-0", None)
    assert tenant_namespace(3) == ("tenant-3", "adapter-3")


def test_multi_turn_cached_tokens_follow_the_page_rule() -> None:
    w = chat()
    answers = fake_answers(w)
    hits = simulate(run_sequentially(w, answers), page_size=PS).ideal_hit_tokens
    first, second = w.requests[0], w.requests[2]   # t0u0 turn 0, t0u1 turn 0
    assert (first.session, second.session) == ("t0u0", "t0u1")
    assert hits[first.index] == 0
    # the second user of the tenant hits the system prompt's full pages: 10 // 4 = 2 pages
    assert hits[second.index] == 2 * PS
    assert hits[1] == 0   # tenant 1's first request: its own namespace, its own system
    # turn 1 of t0u0: turn 0 had 10 + 3 = 13 prompt tokens and 7 output tokens; decode has
    # KV for 13 + 7 - 1 = 19 tokens, 4 full pages. Turn 1's prompt is 13 + 7 + 3 = 23 tokens
    # and looks up (23 - 1) // 4 = 5 pages: 4 hit.
    turn1 = w.requests[6]
    assert (turn1.session, turn1.turn) == ("t0u0", 1)
    assert len(turn1.prompt_ids(answers)) == 23
    assert hits[turn1.index] == 4 * PS
    # turn 2: prompt 23 + 7 + 3 = 33; turn 1 stored (23 + 7 - 1) // 4 = 7 pages; lookup 8
    turn2 = w.requests[12]
    assert (turn2.session, turn2.turn) == ("t0u0", 2)
    assert hits[turn2.index] == 7 * PS


def test_missing_answer_is_a_clear_error() -> None:
    turn1 = chat().requests[6]
    with pytest.raises(ValueError, match="answers: request 6 embeds the answer of request 0"):
        turn1.prompt_ids({})


def test_shared_prefix_members_share_exactly_the_system_prompt() -> None:
    w = shared_prefix_workload(3, 4, system_len=12, question_len=5, output_len=2, tenants=2,
                               vocab_size=1000, seed=1)
    assert len(w.requests) == 12
    groups = [int(r.session[1:]) for r in w.requests]
    assert sorted(groups) == [0] * 4 + [1] * 4 + [2] * 4
    assert groups != sorted(groups)   # shuffled: groups interleave
    prompts = [r.prompt_ids({}) for r in w.requests]
    for r, g, p in zip(w.requests, groups, prompts):
        assert len(p) == 17 and r.tenant == g % 2 and r.max_tokens == 2
        for other, h, q in zip(w.requests, groups, prompts):
            if other.index != r.index:
                assert (p[:12] == q[:12]) == (g == h)
                assert p[12:] != q[12:]
    hits = simulate(run_sequentially(w, fake_answers(w)), page_size=PS).ideal_hit_tokens
    first_of = {g: groups.index(g) for g in range(3)}
    assert all(hits[i] == (0 if i == first_of[g] else 12) for i, g in enumerate(groups))


def test_random_lengths_stay_within_their_distributions() -> None:
    w = random_workload(300, input_len=Uniform(5, 9), output_len=Fixed(3), tenants=3,
                        vocab_size=20, seed=2)
    lengths = [len(r.prompt_ids({})) for r in w.requests]
    assert min(lengths) == 5 and max(lengths) == 9
    assert all(r.max_tokens == 3 and r.tenant == r.index % 3 for r in w.requests)
    assert all(0 <= t < 20 for r in w.requests for t in r.prompt_ids({}))
    again = random_workload(300, input_len=Uniform(5, 9), output_len=3, tenants=3,
                            vocab_size=20, seed=2)
    assert again.requests == w.requests
    assert "random: 300 requests, 3 tenants" in w.describe()


def test_lognormal_median_is_the_given_number() -> None:
    draws = LogNormal(256, 0.5).sample(np.random.default_rng(0), 20_000)
    assert min(draws) >= 1
    assert np.median(draws) == pytest.approx(256, rel=0.03)
    assert np.mean(draws) == pytest.approx(256 * np.exp(0.5**2 / 2), rel=0.03)


def test_parse_length() -> None:
    assert parse_length("128") == Fixed(128)
    assert parse_length("fixed:7") == Fixed(7)
    assert parse_length("uniform:64:256") == Uniform(64, 256)
    assert parse_length("lognormal:256:0.5") == LogNormal(256.0, 0.5)


@pytest.mark.parametrize(("text", "why"), [
    ("0", "length: expected an int >= 1"), ("abc", "invalid literal"),
    ("uniform:9:3", "high: expected >= low=9, got 3"), ("uniform:5", "expected 2 number"),
    ("zipf:1:2", "unknown kind 'zipf'"), ("lognormal:100:-1", "sigma: expected"),
])
def test_parse_length_errors_name_the_flag(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"^--input-len: '{text}': .*{why}"):
        parse_length(text, "--input-len")


def test_bad_fields_are_named() -> None:
    with pytest.raises(ValueError, match="^turn_order: "):
        multi_turn_workload(1, 1, 1, system_tokens=1, user_tokens=1, output_tokens=1,
                            turn_order="lifo")
    with pytest.raises(ValueError, match="^tenants: "):
        random_workload(3, input_len=4, output_len=4, tenants=0)
    with pytest.raises(ValueError, match="^input_len: "):
        random_workload(3, input_len=0, output_len=4)
    with pytest.raises(ValueError, match="^system_len: "):
        shared_prefix_workload(1, 1, system_len=0, question_len=1, output_len=1)
    with pytest.raises(ValueError, match="^segments: request 1 embeds the answer of request 1"):
        BenchRequest(1, 0, "s", 0, (Segment(answer_of=1),), 4)
    with pytest.raises(ValueError, match=r"^requests\[0\]: index is 1"):
        Workload("w", [BenchRequest(1, 0, "s", 0, (), 4)], 1)


def test_the_pure_modules_load_neither_torch_nor_ray() -> None:
    code = ("import sys\n"
            "import pd_cache.app.bench.arrivals, pd_cache.app.bench.oracle\n"
            "import pd_cache.app.bench.traces, pd_cache.app.bench.workloads\n"
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
