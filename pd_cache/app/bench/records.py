"""One line of ``requests.jsonl``: what the bench measured about one request.

Times are seconds since the run started (``scheduled_s``: the arrival process asked for it;
``sent_s``: it left; ``first_token_s`` / ``end_s``: the first token and the last arrived),
latencies are milliseconds. ``None`` means "not known": the request failed first, or the
server did not say. Output token ids are never kept here: a run writes one line per request
and the ids would dwarf everything else.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import msgspec


class RequestRecord(msgspec.Struct, kw_only=True):
    """What one request did, as the client saw it and as the server reported it.

    ``cached_tokens`` is the answer's ``usage.prompt_tokens_details.cached_tokens``;
    ``expected_cached_tokens`` is the oracle's ideal for the same request; ``tier_hits``
    splits the cached tokens by tier (``device`` / ``host`` / ``storage``) when the server
    tells; ``attempts`` is 2 when a worker died under the request and it ran again or
    resumed elsewhere (when the server tells). ``error`` is ``"<ErrorType>: message"`` and
    ``error_type`` its first part.
    """

    index: int
    rid: str
    tenant: int
    session: str
    turn: int
    scheduled_s: float
    sent_s: float
    first_token_s: float | None = None
    end_s: float | None = None
    ttft_ms: float | None = None
    itl_ms: list[float] = []
    e2el_ms: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    expected_cached_tokens: int | None = None
    tier_hits: dict[str, int] | None = None
    cross_namespace_tokens: int | None = None
    prefill_worker: int | None = None
    decode_worker: int | None = None
    attempts: int | None = None
    error: str | None = None
    error_type: str | None = None

    @property
    def ok(self) -> bool:
        """Completed without an error."""
        return self.error is None

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first, as vLLM defines it."""
        if self.output_tokens <= 1 or self.e2el_ms is None or self.ttft_ms is None:
            return None
        return (self.e2el_ms - self.ttft_ms) / (self.output_tokens - 1)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(RequestRecord)


def encode_lines(records: Iterable[RequestRecord]) -> bytes:
    """JSON lines, one record a line, each ending in a newline."""
    return b"".join(_encoder.encode(r) + b"\n" for r in records)


def read_lines(path: str | Path) -> list[RequestRecord]:
    """The records of a ``requests.jsonl``; ``ValueError`` names the line that is bad."""
    records = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(_decoder.decode(line))
            except msgspec.DecodeError as e:
                raise ValueError(f"{path}:{number}: not a request record: {e}") from e
    return records
