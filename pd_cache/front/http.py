"""HTTP plumbing of the ingress: errors in OpenAI's shape, bounded JSON bodies.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with its status: 400
(a bad field: ``param`` names it, as the client sent it), 401, 403, 404, 405, 413, 415,
429 (with ``Retry-After``), 503. A body is read as it streams in and cut off at the limit
(a chunked body without ``Content-Length`` included), and it must be ``application/json``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
         415: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}
RID = re.compile(r"[A-Za-z0-9._:/-]{1,64}")


class HTTPError(Exception):
    """A refused request: status, message, the field it concerns and a short code."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


_AT_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_IN_BACKTICKS = re.compile(r"field `(?P<name>[^`]+)`")
_LEADING_FIELD = re.compile(r"^(?P<field>[A-Za-z_][\w.]*(?:\[\d+\][\w.]*)*):")


async def read_body(request: Any, limit: int) -> bytes:
    """The body, refused (415) unless JSON, and cut off (413) once past ``limit`` bytes
    whether or not the client declared a length."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise HTTPError(415, f"content-type {kind or 'none'!r}: send application/json",
                        "content-type", "unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"body of {declared} bytes exceeds {limit}", "body", "too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"body exceeds {limit} bytes", "body", "too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(body: bytes, kind: type[T]) -> T:
    """``body`` as ``kind``; ``HTTPError`` 400 naming the field for malformed JSON, a wrong
    type, a missing or an unknown field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise HTTPError(400, str(exc), msgspec_field(str(exc)), "invalid_value") from None
    except msgspec.DecodeError as exc:
        raise HTTPError(400, f"malformed JSON: {exc}", "body", "invalid_json") from None


def msgspec_field(message: str) -> str:
    at = _AT_PATH.search(message)
    if at and at.group("path"):
        return at.group("path")
    named = _IN_BACKTICKS.search(message) or _LEADING_FIELD.match(message)
    return named.group(named.lastgroup or 1) if named else "body"


def value_error(exc: ValueError, names: Mapping[str, str] | None = None) -> HTTPError:
    """A pd-cache ``ValueError`` (``input_ids[3]: ...``) as a 400 naming its field; ``names``
    rewrites pd-cache's field names (patterns) into the ones the client's body used."""
    message = str(exc)
    for ours, theirs in (names or {}).items():
        message = re.sub(rf"(?<![\w.]){ours}", theirs, message)
    match = _LEADING_FIELD.match(message)
    return HTTPError(400, message, match.group("field") if match else "body", "invalid_value")


def check_rid(rid: str | None) -> None:
    if rid is not None and not RID.fullmatch(rid):
        raise HTTPError(400, "rid: expected 1-64 characters of [A-Za-z0-9._:/-]", "rid",
                        "invalid_value")
