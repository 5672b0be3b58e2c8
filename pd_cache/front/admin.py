"""The ingress's L3 key routes (admin keys only; ``pd_cache.cluster.keys``)::

    POST /admin/keys/rotate              a new key version for new writes
    POST /admin/keys/retire              every older version unreadable, its records deleted
    POST /admin/tenants/{tenant}/purge   the tenant's cache forgotten in every tier

Record deletion runs on in the background: the answer says what was done at once.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import unquote

from pd_cache.front.http import HTTPError

PURGE_PREFIX, PURGE_SUFFIX = "/admin/tenants/", "/purge"


def purged_tenant(path: str) -> str | None:
    """The tenant of a purge route, ``None`` for any other path."""
    if not (path.startswith(PURGE_PREFIX) and path.endswith(PURGE_SUFFIX)):
        return None
    tenant = unquote(path[len(PURGE_PREFIX):-len(PURGE_SUFFIX)])
    if not tenant or "/" in tenant:
        raise HTTPError(404, f"no route {path!r}: expected /admin/tenants/<tenant>/purge",
                        None, "not_found")
    return tenant


async def keys_call(cluster: Any, action: str, tenant: str | None = None) -> dict[str, Any]:
    """Run ``action`` (rotate | retire | purge) on ``cluster``; the JSON answer."""
    if action == "rotate":
        state = await asyncio.to_thread(cluster.rotate_keys)
        return {"key_version": state.version, "oldest_readable": state.oldest}
    if action == "retire":
        done = await asyncio.to_thread(cluster.retire_keys)
        return {"key_version": cluster.keys.version, "oldest_readable": cluster.keys.oldest,
                "records": "deleting in the background", "shards": len(done.pending)}
    done = await asyncio.to_thread(cluster.purge_tenant, tenant)
    return {"tenant": tenant, "dropped_pages": done.pages,
            "records": "deleting in the background", "shards": len(done.pending)}
