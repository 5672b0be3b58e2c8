"""Benchmark workloads: a seeded stream of requests whose prompts may embed earlier answers.

A prompt is a list of segments, each either literal token ids or the answer of an earlier
request of the stream (a chat history), so a workload is fixed before anything is sent
and the runner assembles each prompt from the answers it got::

    multi-turn, turn 2 of user t0u1:
      [system(t0)] [user 0] [answer of #3] [user 1] [answer of #9] [user 2]   depends_on=#9

Every tenant serves in its own cache namespace (``tenant_namespace``). Generators here:
``random_workload``, ``shared_prefix_workload``, ``multi_turn_workload``; trace replay is
in ``traces``. All draw token ids uniformly from ``[0, vocab_size)`` with
``numpy.random.default_rng(seed)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pd_cache.app.bench.lengths import LengthDist, as_length
from pd_cache.core.fields import check_int_at_least, check_positive_int, one_of

TURN_ORDERS = ("round-robin", "random")


class Namespace(NamedTuple):
    cache_salt: str
    extra_key: str | None


def tenant_namespace(tenant: int) -> Namespace:
    """Tenant ``t``'s namespace: salt ``tenant-t``; odd tenants also serve through a
    LoRA-like adapter, ``extra_key = adapter-t``."""
    return Namespace(f"tenant-{tenant}", f"adapter-{tenant}" if tenant % 2 else None)


@dataclass(frozen=True)
class Segment:
    """Literal ``tokens``, or (``answer_of`` set) the answer of request ``answer_of``."""

    tokens: tuple[int, ...] = ()
    answer_of: int | None = None

    def __post_init__(self) -> None:
        if self.answer_of is not None and (self.tokens or isinstance(self.answer_of, bool)
                                           or not isinstance(self.answer_of, int)
                                           or self.answer_of < 0):
            raise ValueError(f"answer_of: expected a request index >= 0 and no tokens, got "
                             f"{self.answer_of!r} with {len(self.tokens)} tokens")


def answer(index: int) -> Segment:
    """The segment that stands for request ``index``'s answer."""
    return Segment(answer_of=index)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a stream. ``index`` is its position (arrival order); ``session`` is
    its conversation (multi-turn), group (shared prefix) or itself; ``depends_on`` is the
    request whose answer the prompt embeds (send only after it finished); ``offset_s`` is a
    trace's own arrival offset, already divided by the time scale (``None``: not a trace)."""

    index: int
    tenant: int
    session: str
    turn: int
    segments: tuple[Segment, ...]
    max_tokens: int
    cache_salt: str | None = None
    extra_key: str | None = None
    depends_on: int | None = None
    offset_s: float | None = None

    def __post_init__(self) -> None:
        for seg in self.segments:
            if seg.answer_of is not None and seg.answer_of >= self.index:
                raise ValueError(f"segments: request {self.index} embeds the answer of "
                                 f"request {seg.answer_of}, which does not come before it")
        if self.depends_on is not None and not 0 <= self.depends_on < self.index:
            raise ValueError(f"depends_on: expected an earlier request index, got "
                             f"{self.depends_on!r} for request {self.index}")
        check_positive_int("max_tokens", self.max_tokens)

    def prompt_ids(self, answers: Mapping[int, Sequence[int]]) -> list[int]:
        """The prompt: the segments concatenated, answers taken from ``answers`` (by request
        index). ``ValueError`` if a referenced answer is missing."""
        ids: list[int] = []
        for seg in self.segments:
            if seg.answer_of is None:
                ids.extend(seg.tokens)
                continue
            try:
                ids.extend(answers[seg.answer_of])
            except KeyError:
                raise ValueError(f"answers: request {self.index} embeds the answer of "
                                 f"request {seg.answer_of}, which is missing") from None
        return ids


@dataclass(frozen=True)
class Workload:
    """``requests`` in stream order (``requests[i].index == i``) over ``tenants`` tenants;
    ``detail`` says how it was made."""

    name: str
    requests: list[BenchRequest]
    tenants: int
    detail: str = ""

    def __post_init__(self) -> None:
        for i, req in enumerate(self.requests):
            if req.index != i:
                raise ValueError(f"requests[{i}]: index is {req.index}, expected {i}")

    def describe(self) -> str:
        head = f"{self.name}: {len(self.requests)} requests, {self.tenants} tenants"
        return f"{head}; {self.detail}" if self.detail else head


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.integers(0, vocab_size, n).tolist())


def _request(index: int, tenant: int, session: str, segments: list[Segment], max_tokens: int,
             *, turn: int = 0, depends_on: int | None = None) -> BenchRequest:
    ns = tenant_namespace(tenant)
    return BenchRequest(index, tenant, session, turn, tuple(segments), max_tokens,
                        ns.cache_salt, ns.extra_key, depends_on)


def _check_common(tenants: int, vocab_size: int) -> None:
    check_positive_int("tenants", tenants)
    check_int_at_least("vocab_size", vocab_size, 2)


def random_workload(num_requests: int, *, input_len: LengthDist | int,
                    output_len: LengthDist | int, tenants: int = 1, vocab_size: int = 4096,
                    seed: int = 0) -> Workload:
    """Independent random prompts; request ``i`` belongs to tenant ``i % tenants``."""
    check_int_at_least("num_requests", num_requests, 0)
    _check_common(tenants, vocab_size)
    inputs, outputs = as_length("input_len", input_len), as_length("output_len", output_len)
    rng = np.random.default_rng(seed)
    lengths, max_tokens = inputs.sample(rng, num_requests), outputs.sample(rng, num_requests)
    requests = [_request(i, i % tenants, f"r{i}", [Segment(_tokens(rng, n, vocab_size))], m)
                for i, (n, m) in enumerate(zip(lengths, max_tokens))]
    return Workload("random", requests, tenants, f"input {inputs}, output {outputs}")


def shared_prefix_workload(groups: int, prompts_per_group: int, *, system_len: int,
                           question_len: LengthDist | int, output_len: LengthDist | int,
                           tenants: int = 1, vocab_size: int = 4096,
                           seed: int = 0) -> Workload:
    """Groups of prompts sharing one system prompt: prompt = system(group) + own question.

    Group ``g`` belongs to tenant ``g % tenants`` (session ``g{g}``). The stream is all
    ``groups * prompts_per_group`` prompts shuffled with the seed, so groups interleave and
    a system prompt's reuse distance varies.
    """
    check_positive_int("groups", groups)
    check_positive_int("prompts_per_group", prompts_per_group)
    check_positive_int("system_len", system_len)
    _check_common(tenants, vocab_size)
    questions, outputs = as_length("question_len", question_len), as_length("output_len",
                                                                            output_len)
    rng = np.random.default_rng(seed)
    systems = [Segment(_tokens(rng, system_len, vocab_size)) for _ in range(groups)]
    total = groups * prompts_per_group
    lengths, max_tokens = questions.sample(rng, total), outputs.sample(rng, total)
    order = rng.permutation(total).tolist()   # order[i]: which prompt is sent i-th
    requests = []
    for i, k in enumerate(order):
        g = k // prompts_per_group
        question = Segment(_tokens(rng, lengths[k], vocab_size))
        requests.append(_request(i, g % tenants, f"g{g}", [systems[g], question], max_tokens[k]))
    return Workload("shared-prefix", requests, tenants,
                    f"{groups} groups x {prompts_per_group} prompts, system {system_len}, "
                    f"question {questions}, output {outputs}")


def multi_turn_workload(tenants: int, users_per_tenant: int, rounds: int, *,
                        system_tokens: int, user_tokens: int, output_tokens: int,
                        vocab_size: int = 4096, seed: int = 0,
                        turn_order: str = "round-robin", preamble_tokens: int = 0) -> Workload:
    """Chats: each tenant has one system prompt shared by its users; turn ``r`` of a user is

        [preamble] [system] [user 0] [answer of turn 0] ... [user r-1] [answer of turn r-1]
        [user r]

    with ``depends_on`` = the user's turn ``r-1``. ``preamble_tokens``: a platform preamble
    every prompt of every tenant starts with (none by default), drawn from a generator of
    its own so the rest of the stream is the same with or without it: identical tokens in
    every namespace, whose pages must never be shared across them. Users (sessions
    ``t{t}u{u}``) are ordered tenant-interleaved: t0u0, t1u0, ..., t0u1, t1u1, ...

    ``turn_order``: ``"round-robin"`` sends every user's turn 0, then every turn 1, ...: a
    user's next turn comes exactly ``N - 1`` requests after its previous one (``N`` =
    tenants * users_per_tenant), a tenant's system prompt every ``tenants`` requests.
    ``"random"`` is a seeded uniform interleaving that keeps each user's turns in order:
    the distance between a user's turns varies widely (often short, sometimes much longer
    than ``N``).
    """
    check_positive_int("users_per_tenant", users_per_tenant)
    check_positive_int("rounds", rounds)
    check_int_at_least("system_tokens", system_tokens, 0)
    check_int_at_least("preamble_tokens", preamble_tokens, 0)
    check_positive_int("user_tokens", user_tokens)
    check_positive_int("output_tokens", output_tokens)
    _check_common(tenants, vocab_size)
    one_of("turn_order", turn_order, TURN_ORDERS)
    rng = np.random.default_rng(seed)
    users = [(t, u) for u in range(users_per_tenant) for t in range(tenants)]
    systems = [Segment(_tokens(rng, system_tokens, vocab_size)) for _ in range(tenants)]
    head = [Segment(_tokens(np.random.default_rng([seed, 1]), preamble_tokens, vocab_size))] \
        if preamble_tokens else []
    texts = [[Segment(_tokens(rng, user_tokens, vocab_size)) for _ in range(rounds)]
             for _ in users]
    if turn_order == "round-robin":
        order = [c for _ in range(rounds) for c in range(len(users))]
    else:
        order = rng.permutation(np.repeat(np.arange(len(users)), rounds)).tolist()
    requests: list[BenchRequest] = []
    sent: list[list[int]] = [[] for _ in users]   # request indices of each user's turns
    for i, c in enumerate(order):
        (t, u), turn = users[c], len(sent[c])
        history = [seg for r in range(turn) for seg in (texts[c][r], answer(sent[c][r]))]
        segments = head + ([systems[t]] if system_tokens else []) + history + [texts[c][turn]]
        depends_on = sent[c][-1] if sent[c] else None
        requests.append(_request(i, t, f"t{t}u{u}", segments, output_tokens, turn=turn,
                                 depends_on=depends_on))
        sent[c].append(i)
    preamble = f"preamble {preamble_tokens}, " if preamble_tokens else ""
    return Workload("multi-turn", requests, tenants,
                    f"{users_per_tenant} users/tenant x {rounds} rounds ({turn_order}), "
                    f"{preamble}system {system_tokens}, user {user_tokens}, "
                    f"output {output_tokens}")
