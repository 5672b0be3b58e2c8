"""Mooncake-format traces: replay one (``trace_workload``) or write a synthetic one
(``make_trace``).

One JSON object a line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is the arrival in ms; each hash id names one ``source_block``-token block of
the prompt (512 in Mooncake's traces; the last block may be partial), and equal ids are
equal blocks, so two prompts starting with the same ids share that prefix.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from pd_cache.app.bench.workloads import BenchRequest, Segment, Workload, tenant_namespace
from pd_cache.core.fields import check_int_at_least, check_positive_int

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def trace_workload(path: str | Path, *, block_tokens: int, source_block: int = 512,
                   max_output_tokens: int, time_scale: float = 1.0, vocab_size: int = 4096,
                   seed: int = 0, tenants: int = 1, limit: int | None = None) -> Workload:
    """The requests of a Mooncake trace, in arrival order, with synthetic tokens.

    Hash id ``h`` becomes ``block_tokens`` tokens drawn with ``default_rng([seed, 0, h])``,
    the same in every request that names it. A prompt is the blocks of its ids concatenated
    and cut to ``L = max(1, input_length * block_tokens / source_block)`` tokens (rounded
    half up), or, if ``L`` is past its blocks, padded with tokens no other request has
    (``default_rng([seed, 1, line])``, ``line`` its 1-based line number).
    ``max_tokens = max(1, min(output_length, max_output_tokens))``;
    ``offset_s = (timestamp - earliest timestamp) / 1000 / time_scale``. Requests are
    sorted by timestamp (stable); ``limit`` keeps the file's first ``limit`` non-blank lines.

    A trace has no tenants: with ``tenants > 1`` a request belongs to tenant
    ``hash_ids[0] % tenants`` (``line % tenants`` without hash ids), so prompts that share a
    prefix share a tenant and its namespace.

    Raises ``ValueError`` naming the file, line number and field of a bad line.
    """
    check_positive_int("block_tokens", block_tokens)
    check_positive_int("source_block", source_block)
    check_positive_int("max_output_tokens", max_output_tokens)
    check_positive_int("tenants", tenants)
    check_int_at_least("vocab_size", vocab_size, 2)
    if isinstance(time_scale, bool) or not isinstance(time_scale, (int, float)) \
            or not 0 < time_scale < math.inf:
        raise ValueError(f"time_scale: expected a finite number > 0, got {time_scale!r}")
    if limit is not None:
        check_int_at_least("limit", limit, 0)
    rows = sorted(_read(Path(path), limit), key=lambda row: row[1]["timestamp"])
    blocks: dict[int, tuple[int, ...]] = {}

    def block(h: int) -> tuple[int, ...]:
        if h not in blocks:
            blocks[h] = tuple(np.random.default_rng([seed, 0, h]).integers(
                0, vocab_size, block_tokens).tolist())
        return blocks[h]

    first = rows[0][1]["timestamp"] if rows else 0
    requests = []
    for i, (line, row) in enumerate(rows):
        ids = row["hash_ids"]
        length = max(1, (2 * row["input_length"] * block_tokens + source_block)
                     // (2 * source_block))
        segments = _cut([Segment(block(h)) for h in ids], length)
        short = length - sum(len(s.tokens) for s in segments)
        if short > 0:
            pad = np.random.default_rng([seed, 1, line]).integers(0, vocab_size, short)
            segments.append(Segment(tuple(pad.tolist())))
        tenant = (ids[0] if ids else line) % tenants
        ns = tenant_namespace(tenant)
        requests.append(BenchRequest(
            i, tenant, f"r{i}", 0, tuple(segments),
            max(1, min(row["output_length"], max_output_tokens)), ns.cache_salt, ns.extra_key,
            offset_s=(row["timestamp"] - first) / 1000 / time_scale))
    return Workload("trace", requests, tenants,
                    f"{Path(path).name}, {len(blocks)} distinct blocks of {block_tokens} "
                    f"tokens (source {source_block}), time scale {time_scale:g}")


def _cut(segments: list[Segment], length: int) -> list[Segment]:
    """The leading segments holding the first ``length`` tokens, the last one cut."""
    kept, total = [], 0
    for seg in segments:
        if total + len(seg.tokens) >= length:
            kept.append(Segment(seg.tokens[:length - total]))
            return kept
        kept.append(seg)
        total += len(seg.tokens)
    return kept


def _read(path: Path, limit: int | None) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` of each non-blank line, checked; the first ``limit`` only."""
    rows: list[tuple[int, dict[str, Any]]] = []
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if text.strip():
                rows.append((number, _parse_line(path, number, text)))
    return rows


def _parse_line(path: Path, number: int, text: str) -> dict[str, Any]:
    where = f"{path}:{number}"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not a JSON object: {exc.msg}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for field in _FIELDS:
        if field not in row:
            raise ValueError(f"{where}: {field}: missing")
    for field in _FIELDS[:3]:
        if not _is_int(row[field], 0):
            raise ValueError(f"{where}: {field}: expected an int >= 0, got {row[field]!r}")
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(_is_int(h, 0) for h in ids):
        raise ValueError(f"{where}: hash_ids: expected a list of ints >= 0, got {ids!r}")
    return row


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def make_trace(path: str | Path, *, num_requests: int, seed: int = 0, rate: float = 2.0,
               system_prompts: int = 4, new_chat: float = 0.6, source_block: int = 512,
               max_output: int = 1024) -> int:
    """Write a synthetic Mooncake-format trace of ``num_requests`` lines; returns that count.

    Arrivals are a Poisson process at ``rate`` requests/s (ms timestamps from 0). With
    probability ``new_chat`` (and always at first) a request starts a chat: one of
    ``system_prompts`` shared block chains of 1-8 blocks (popularity ~ 1/rank; none with
    probability 0.2) followed by 1-6 new blocks. Otherwise it is the next turn of an earlier
    chat, picked uniformly: that chat's previous prompt's full blocks (the partial last one
    changes as the chat grows) followed by 1-3 new blocks (answer and user text). The last
    block of every prompt is partial; ``output_length`` is lognormal, median 200.
    """
    check_positive_int("num_requests", num_requests)
    check_positive_int("system_prompts", system_prompts)
    check_positive_int("source_block", source_block)
    check_positive_int("max_output", max_output)
    if not 0 < rate < math.inf:
        raise ValueError(f"rate: expected a finite number > 0, got {rate!r}")
    if not 0 <= new_chat <= 1:
        raise ValueError(f"new_chat: expected a probability in [0, 1], got {new_chat!r}")
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    systems = [fresh(int(rng.integers(1, 9))) for _ in range(system_prompts)]
    popularity = 1.0 / np.arange(1, system_prompts + 1)
    chats: list[list[int]] = []   # each chat's full blocks so far
    times = np.cumsum(np.concatenate([[0.0], rng.exponential(1000.0 / rate, num_requests - 1)]))
    with Path(path).open("w", encoding="utf-8") as f:
        for ms in times:
            if not chats or rng.random() < new_chat:
                k = int(rng.choice(system_prompts, p=popularity / popularity.sum()))
                head = systems[k] if rng.random() >= 0.2 else []
                ids, c = head + fresh(int(rng.integers(1, 7))), len(chats)
                chats.append([])
            else:
                c = int(rng.integers(len(chats)))
                ids = chats[c] + fresh(int(rng.integers(1, 4)))
            length = (len(ids) - 1) * source_block + int(rng.integers(1, source_block))
            chats[c] = ids[:-1]
            output = int(min(max_output, max(1, round(rng.lognormal(math.log(200), 0.8)))))
            f.write(json.dumps({"timestamp": int(ms), "input_length": length,
                                "output_length": output, "hash_ids": ids}) + "\n")
    return num_requests
