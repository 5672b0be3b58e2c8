"""Namespaced page-hash chains (spec v1, ``docs/page-names.md``).

Every KV page that leaves a process is named here, and only here::

    seed(ek, salt) = H(b"pd-cache/ns/v1\\0" || opt(ek) || opt(salt))
    h_0 = seed,  h_i = H(h_{i-1} || u32le(tokens of page i))

Tokens are converted to one little-endian ``uint32`` buffer once; the per-page loop
only slices that buffer, so there is no Python-level work per token.
"""

from __future__ import annotations

import array
import hashlib
import struct
from collections.abc import Sequence
from typing import Any, Callable, NoReturn

import numpy as np
import xxhash

SPEC_VERSION = 1
NAMESPACE_TAG = b"pd-cache/ns/v1\x00"
MAX_TOKEN = 2**32
DIGEST_SIZES = {"xxh3_128": 16, "sha256": 32}
_U32_CODE = next(code for code in "IL" if array.array(code).itemsize == 4)
_U32_LE = np.dtype("<u4")


def _sha256_digest(data: Any) -> bytes:
    return hashlib.sha256(data).digest()


_DIGESTS: dict[str, Callable[[Any], bytes]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": _sha256_digest,
}


def digest_fn(algo: str) -> Callable[[Any], bytes]:
    """The digest function ``H`` of ``algo``; a ``ValueError`` for an unknown name."""
    try:
        return _DIGESTS[algo]
    except KeyError:
        raise ValueError(f"algo: unknown hash algorithm {algo!r}; expected one of "
                         f"{sorted(_DIGESTS)}") from None


def _opt(value: str | None, field: str) -> bytes:
    if value is None:
        return b"\x00"
    if not isinstance(value, str):
        raise ValueError(f"{field}: expected str or None, got {type(value).__name__} {value!r}")
    raw = value.encode("utf-8")
    return b"\x01" + struct.pack("<I", len(raw)) + raw


def namespace_seed(extra_key: str | None, cache_salt: str | None,
                   algo: str = "xxh3_128") -> bytes:
    """``h_0`` of every chain in the namespace ``(extra_key, cache_salt)``."""
    h = digest_fn(algo)
    return h(NAMESPACE_TAG + _opt(extra_key, "extra_key") + _opt(cache_salt, "cache_salt"))


def token_buffer(tokens: Any) -> np.ndarray:
    """Tokens as one contiguous little-endian ``uint32`` array, validated.

    Accepts a sequence of ints, a numpy integer array or a 1-D integer torch tensor.
    A value outside ``[0, 2**32)`` or of a non-integer type raises ``ValueError``
    naming its position.
    """
    if isinstance(tokens, np.ndarray):
        return _from_array(tokens)
    if type(tokens).__module__.startswith("torch"):
        return _from_array(tokens.detach().cpu().numpy())
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise ValueError(f"tokens: expected a sequence of ints, got {type(tokens).__name__}")
    try:
        # NOTE: array("I") is the cheapest list -> uint32 conversion and rejects negative,
        # too large and non-integer values itself; only bool (an int subclass) slips by,
        # and a bool can only have become a 0 or a 1, so only those positions are looked at.
        arr = np.frombuffer(array.array(_U32_CODE, tokens), dtype=np.uint32)
    except (TypeError, OverflowError):
        _raise_bad_token(tokens)
    if any(type(tokens[i]) is bool for i in np.flatnonzero(arr <= 1).tolist()):
        _raise_bad_token(tokens)
    return arr.astype("<u4", copy=False)


def _raise_bad_token(tokens: Sequence[Any]) -> NoReturn:
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"tokens[{i}]: expected an int, got {type(t).__name__} {t!r}")
        if not 0 <= int(t) < MAX_TOKEN:
            raise ValueError(f"tokens[{i}]: {t} is outside [0, 2**32)")
    raise ValueError("tokens: could not be read as integers")


def _from_array(arr: np.ndarray) -> np.ndarray:
    if arr.dtype == _U32_LE and arr.ndim == 1 and arr.flags.c_contiguous:
        return arr   # already a token buffer (a record's page, hashed again to check it)
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D array, got shape {tuple(arr.shape)}")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens: expected an integer dtype, got {arr.dtype}")
    fits = np.issubdtype(arr.dtype, np.unsignedinteger) and arr.dtype.itemsize <= 4
    if arr.size and not fits:
        wide = arr if arr.dtype == np.uint64 else arr.astype(np.int64, copy=False)
        bad = np.flatnonzero((wide < 0) | (wide >= MAX_TOKEN))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"tokens[{i}]: {int(arr[i])} is outside [0, 2**32)")
    return np.ascontiguousarray(arr, dtype="<u4")


def page_hashes(tokens: Any, page_size: int, *, extra_key: str | None = None,
                cache_salt: str | None = None, prior: bytes | None = None,
                algo: str = "xxh3_128") -> list[bytes]:
    """Names of the full pages of ``tokens``; a trailing partial page has none yet.

    ``prior`` continues a chain: hashing ``tokens[k*page_size:]`` with ``prior = h_k``
    gives ``h_{k+1}, ...``. Without it the chain starts at the namespace seed.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected an int >= 1, got {page_size!r}")
    h = digest_fn(algo)
    if prior is None:
        prior = namespace_seed(extra_key, cache_salt, algo)
    elif not isinstance(prior, bytes) or len(prior) != DIGEST_SIZES[algo]:
        raise ValueError(f"prior: expected {DIGEST_SIZES[algo]} bytes of {algo}, got {prior!r}")
    buf = token_buffer(tokens)
    return _chain(h, prior, memoryview(buf).cast("B"), page_size * 4, len(buf) // page_size)


def _chain(h: Callable[[Any], bytes], prior: bytes, raw: memoryview, page_bytes: int,
           num_pages: int) -> list[bytes]:
    if h is xxhash.xxh3_128_digest and _native_chain is not None:
        return _native_chain(prior, raw[:num_pages * page_bytes], page_bytes)
    return _python_chain(h, prior, raw, page_bytes, num_pages)


def _python_chain(h: Callable[[Any], bytes], prior: bytes, raw: memoryview, page_bytes: int,
                  num_pages: int) -> list[bytes]:
    names = []
    for start in range(0, num_pages * page_bytes, page_bytes):
        prior = h(prior + raw[start:start + page_bytes])
        names.append(prior)
    return names


def _load_native_chain() -> Callable[[bytes, Any, int], list[bytes]] | None:
    """The C loop of ``pd_cache/core/_chain.c``, bound to the xxhash package's own XXH3_128bits.

    Used only if it reproduces the Python chain on a probe; otherwise (no compiler at
    install time, an xxhash build without that symbol) the Python loop serves.
    """
    try:
        import ctypes

        from xxhash import _xxhash  # type: ignore[attr-defined]

        from pd_cache.core import _chain  # type: ignore[attr-defined]

        fn = ctypes.CDLL(_xxhash.__file__).XXH3_128bits
        _chain.bind(ctypes.cast(fn, ctypes.c_void_p).value)
        probe = np.arange(1000, 1077, dtype="<u4").tobytes()
        prior = xxhash.xxh3_128_digest(b"probe")
        want = _python_chain(xxhash.xxh3_128_digest, prior, memoryview(probe), 28, 11)
        return _chain.chain_xxh3_128 if _chain.chain_xxh3_128(prior, probe, 28) == want else None
    except (ImportError, OSError, AttributeError, ValueError):
        return None


_native_chain = _load_native_chain()


def to_hex(name: bytes) -> str:
    """The text form of a page name: lowercase hex."""
    return name.hex()


def from_hex(text: str, algo: str | None = None) -> bytes:
    """Parse a page name's text form; checks its length against ``algo`` when given."""
    try:
        raw = bytes.fromhex(text)
    except (TypeError, ValueError):
        raise ValueError(f"page name: not a hex string: {text!r}") from None
    sizes = [DIGEST_SIZES[algo]] if algo in DIGEST_SIZES else list(DIGEST_SIZES.values())
    if len(raw) not in sizes:
        raise ValueError(f"page name: {len(raw)} bytes, expected one of {sizes}: {text!r}")
    return raw
