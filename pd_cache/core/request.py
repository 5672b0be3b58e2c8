"""The request: what a client asks for, validated once, at admission.

``Req`` is a ``msgspec.Struct`` so it crosses actor and HTTP boundaries as a typed wire
value; ``__post_init__`` runs on construction *and* on decode, so a request read off the
wire is checked the same way as one built in Python. ``Req.check_model`` adds the checks
that need the model (vocabulary size, context length). ``compute_prefix_hash`` names a
request's pages in its own namespace: the one way every process names them.

What a process derives from a request (its namespace seed, its admission against the
model) is derived once there and kept with the object, never sent with it: a process that
receives the request derives its own from the fields it received.
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec

from pd_cache.core.hashing import MAX_TOKEN, namespace_seed, page_hashes, token_buffer
from pd_cache.core.pins import check_ttl

MAX_NAMESPACE_BYTES = 256


class DeadlineExceeded(TimeoutError):
    """The request ran past its deadline; its work was dropped (crosses actors as itself)."""


class SamplingParams(msgspec.Struct, frozen=True, gc=False):
    """Greedy by default; ``temperature > 0`` samples with a per-request ``seed``.

    ``stop_token_ids``: generation ends right after drawing one of them (it is the last
    output token), before ``max_new_tokens`` if need be; none by default (a checkpoint's
    end-of-sequence ids are added by the OpenAI front, not here). ``first_step``: the index
    of the first token this request draws in its answer (a stream resumed after ``k``
    tokens draws as the whole answer would from token ``k`` on).
    """

    temperature: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    first_step: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"sampling.temperature: expected a number >= 0, "
                             f"got {self.temperature!r}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (tuple, list)) or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < MAX_TOKEN
                for t in stops):
            raise ValueError(f"sampling.stop_token_ids: expected token ids (ints >= 0), "
                             f"got {stops!r}")
        if isinstance(self.first_step, bool) or not isinstance(self.first_step, int) \
                or self.first_step < 0:
            raise ValueError(f"sampling.first_step: expected an int >= 0, "
                             f"got {self.first_step!r}")
        if isinstance(stops, list):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(stops))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def stops(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` (the output so far) ended on a stop token."""
        return bool(tokens) and tokens[-1] in self.stop_token_ids


def check_namespace(field: str, value: Any) -> None:
    """A namespace part is ``None`` or a non-empty str of at most 256 UTF-8 bytes."""
    if value is None:
        return
    if not isinstance(value, str):
        raise ValueError(f"{field}: expected a non-empty str or None, "
                         f"got {type(value).__name__} {value!r}")
    if not value:
        raise ValueError(f"{field}: expected a non-empty str or None, got ''")
    size = len(value.encode("utf-8"))
    if size > MAX_NAMESPACE_BYTES:
        raise ValueError(f"{field}: {size} UTF-8 bytes, at most {MAX_NAMESPACE_BYTES} "
                         f"allowed: {value[:40]!r}...")


class Req(msgspec.Struct, kw_only=True, dict=True):
    """One generation request. ``output_ids`` fills as it decodes.

    ``deadline`` (``time.time()`` seconds, or ``None``: none) is when its answer stops being
    wanted; every queue and batch drops the request then, and frees what it held.

    NOTE: ``dict=True`` gives each request a private ``__dict__`` beside its fields: what
    this process derived from them (``_derived``). Neither msgspec nor pickle (so neither
    HTTP nor Ray) carries it, and ``msgspec.structs.replace`` starts without it, so no
    process trusts another's derivation: each one that receives a request derives its own.
    """

    rid: str
    input_ids: list[int]
    extra_key: str | None = None
    cache_salt: str | None = None
    max_new_tokens: int = 16
    sampling: SamplingParams = SamplingParams()
    output_ids: list[int] = []
    deadline: float | None = None
    # NOTE: set by the server from the API key ("" in open mode and for direct PDCluster
    # callers); it picks the key that seals the request's L3 pages (core.sealing).
    tenant: str = ""
    # NOTE: > 0: every tier that stores the prompt's full pages pins them this many seconds,
    # renewed by each hit (core.pins); the ingress checks the tenant's limit first.
    pin_ttl_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.rid, str) or not self.rid:
            raise ValueError(f"rid: expected a non-empty str, got {self.rid!r}")
        if isinstance(self.input_ids, (str, bytes)) or not hasattr(self.input_ids, "__len__"):
            raise ValueError(f"input_ids: expected a list of ints, got "
                             f"{type(self.input_ids).__name__}")
        if len(self.input_ids) == 0:
            raise ValueError(f"input_ids: empty prompt (rid={self.rid!r})")
        try:
            buf = token_buffer(self.input_ids)
        except ValueError as exc:
            raise ValueError(f"input_ids{str(exc).removeprefix('tokens')}") from None
        if not isinstance(self.input_ids, list):
            self.input_ids = buf.tolist()
        check_namespace("extra_key", self.extra_key)
        check_namespace("cache_salt", self.cache_salt)
        if self.tenant != "":
            check_namespace("tenant", self.tenant)
        if (isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int)
                or self.max_new_tokens < 0):
            raise ValueError(f"max_new_tokens: expected an int >= 0, got "
                             f"{self.max_new_tokens!r}")
        self.pin_ttl_s = check_ttl("pin_ttl_s", self.pin_ttl_s)
        if self.deadline is not None and (isinstance(self.deadline, bool)
                                          or not isinstance(self.deadline, (int, float))
                                          or not math.isfinite(self.deadline)):
            raise ValueError(f"deadline: expected time.time() seconds or None, got "
                             f"{self.deadline!r}")

    def expired(self, now: float | None = None) -> bool:
        """Whether the request is past its deadline (never, without one)."""
        return self.deadline is not None and (time.time() if now is None else now) \
            >= self.deadline

    def check_deadline(self, where: str) -> None:
        """Raise ``DeadlineExceeded`` if the request is past its deadline."""
        if self.expired():
            raise DeadlineExceeded(f"request {self.rid}: past its deadline at {where}")

    def check_model(self, *, vocab_size: int = MAX_TOKEN,
                    max_context: int | None = None) -> None:
        """Admit the request to the model that will serve it: the checks that need the model.

        Raises ``ValueError`` naming the field and value: a token id ``>= vocab_size`` (in
        the prompt or among the stop tokens), a prompt plus ``max_new_tokens`` longer than
        ``max_context``. Runs once per process and model: a request admitted here before
        is not checked again (its fields do not change after admission).
        """
        admitted = ("admitted", vocab_size, max_context)
        if admitted in self._derived:
            return
        ids = token_buffer(self.input_ids)
        if vocab_size < MAX_TOKEN and int(ids.max()) >= vocab_size:
            i = int((ids >= vocab_size).argmax())
            raise ValueError(f"input_ids[{i}]: token id {int(ids[i])} is outside the "
                             f"vocabulary [0, {vocab_size})")
        for t in self.sampling.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"sampling.stop_token_ids: token id {t} is outside the "
                                 f"vocabulary [0, {vocab_size})")
        total = len(ids) + self.max_new_tokens
        if max_context is not None and total > max_context:
            raise ValueError(f"input_ids: prompt of {len(ids)} tokens + max_new_tokens="
                             f"{self.max_new_tokens} exceeds the model context {max_context}")
        self._derived[admitted] = True

    def answered_by(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` are a whole answer (``max_new_tokens`` of them, or a stop)."""
        return len(tokens) >= self.max_new_tokens or self.sampling.stops(tokens)

    def resumed_after(self, sent: list[int]) -> Req:
        """This request after ``sent``, the start of its answer: the rest of it, drawn as
        the whole answer would be (prompt + ``sent``, ``sampling.first_step`` moved on)."""
        sampling = msgspec.structs.replace(self.sampling,
                                           first_step=self.sampling.first_step + len(sent))
        return Req(rid=self.rid, input_ids=self.input_ids + list(sent),
                   extra_key=self.extra_key, cache_salt=self.cache_salt,
                   max_new_tokens=self.max_new_tokens - len(sent), sampling=sampling,
                   deadline=self.deadline, tenant=self.tenant, pin_ttl_s=self.pin_ttl_s)

    @property
    def namespace(self) -> tuple[str | None, str | None]:
        return (self.extra_key, self.cache_salt)

    def namespace_seed(self, algo: str = "xxh3_128") -> bytes:
        """``h_0`` of this request's page chains (``pd_cache.core.hashing.namespace_seed``),
        derived once per process from its own ``extra_key`` and ``cache_salt``."""
        key = ("seed", algo, self.extra_key, self.cache_salt)
        seed = self._derived.get(key)
        if seed is None:
            seed = self._derived[key] = namespace_seed(self.extra_key, self.cache_salt, algo)
        return seed

    @property
    def _derived(self) -> dict[tuple[Any, ...], Any]:
        """What this process derived from the request (see the class docstring)."""
        return self.__dict__.setdefault("derived", {})

    @property
    def all_ids(self) -> list[int]:
        """Prompt followed by what has been generated so far."""
        return self.input_ids + self.output_ids


def compute_prefix_hash(req: Req, tokens: Any, prior: bytes | None = None, *,
                        page_size: int, algo: str = "xxh3_128") -> list[bytes]:
    """Names of ``tokens``' full pages in ``req``'s own namespace, continuing ``prior``
    (default: the start of the chain, the request's namespace seed).

    The namespace is read from the request, so no caller can pass the wrong one.
    """
    return page_hashes(tokens, page_size, algo=algo,
                       prior=req.namespace_seed(algo) if prior is None else prior)
