"""Where a cluster keeps its L3 key state (``core.sealing.KeyState``) for its workers.

A worker actor that restarts reruns its constructor with the keyring it was first given,
whose state is the cluster's at start. So the cluster writes every new state under the
keyring's ``name`` in Ray's GCS key-value store before it pushes it to the workers, and a
worker reads it as it (re)starts::

    rotate / retire / purge:  save(name, state) -> every worker's set_keys(state)
    a worker (re)starting:    keyring.state = load(name)  (if the cluster saved one)

so a restarted worker reads the records of still-valid key versions and refuses retired
ones and a purged tenant's, as its peers do. The state holds no key (versions and purge
epochs only): the secret never leaves the keyring.
"""

from __future__ import annotations

import msgspec

from pd_cache.core.sealing import Keyring, KeyState

NAMESPACE = "pd-cache-keys"


def save(name: str, state: KeyState) -> None:
    # NOTE: Ray's internal KV (the GCS table Serve keeps its state in): it outlives every
    # actor of the cluster, and a detached actor of its own would cost a process.
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(name, msgspec.msgpack.encode(state), namespace=NAMESPACE)


def load(name: str) -> KeyState | None:
    """The state saved under ``name``; ``None`` if none was (or Ray is not running)."""
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return None
    raw = internal_kv._internal_kv_get(name, namespace=NAMESPACE)
    return None if raw is None else msgspec.msgpack.decode(raw, type=KeyState)


def drop(name: str) -> None:
    from ray.experimental import internal_kv

    if internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_del(name, namespace=NAMESPACE)


def refreshed(keyring: Keyring) -> Keyring:
    """``keyring`` with the state its cluster saved last, if it has a name and one was."""
    state = load(keyring.name) if keyring.name else None
    if state is not None:
        keyring.state = state
    return keyring
