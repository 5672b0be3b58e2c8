"""The AEADs that seal L3 payloads, writing into buffers the caller gives.

Both go through ``cryptography``'s one-shot ``encrypt_into`` / ``decrypt_into`` (47 and
later) on an AEAD object kept per key: one call per payload writes ciphertext and tag (or
the plaintext) where it is told, and releases the GIL while it runs. For a 32 KiB page
that is ~7 us here, where a streaming ``Cipher`` (a new context per payload, the tag
copied after) took ~15 us to seal and ~20 us to open. Sealing or opening into memory
touched before (a reused buffer, a host-pool slot) runs about twice as fast as into fresh
memory, whose first touch costs more than the cipher.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from pd_cache.storage.record import TAG_BYTES

AEADS: dict[str, Any] = {"aes-256-gcm": AESGCM, "chacha20-poly1305": ChaCha20Poly1305}
AEAD = "aes-256-gcm"


def seal_into(aead: str, key: bytes, nonce: bytes, data: np.ndarray, aad: bytes,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``data`` sealed: ciphertext then tag, ``uint8[len(data) + TAG_BYTES]``, written into
    ``out`` (that many contiguous bytes) when given, else new memory."""
    if out is None:
        out = torch.empty(len(data) + TAG_BYTES, dtype=torch.uint8)
    _aead(aead, key).encrypt_into(nonce, data, aad, out.numpy())
    return out


def open_into(aead: str, key: bytes, nonce: bytes, data: np.ndarray, aad: bytes,
              out: np.ndarray | None = None) -> np.ndarray:
    """The plaintext of ``data`` (ciphertext + tag), written into ``out`` (contiguous
    ``uint8`` of the plaintext's length) when given, else new memory; ``InvalidTag`` if it
    does not verify (``out`` then holds bytes that must not be used), or is not ``out``'s
    length plus the tag (it cannot be the payload the reader expects)."""
    if len(data) < TAG_BYTES or (out is not None and len(out) != len(data) - TAG_BYTES):
        raise InvalidTag
    if out is None:
        out = torch.empty(len(data) - TAG_BYTES, dtype=torch.uint8).numpy()
    _aead(aead, key).decrypt_into(nonce, data, aad, out)
    return out


@functools.lru_cache(maxsize=256)
def _aead(aead: str, key: bytes) -> Any:
    return AEADS[aead](key)
