"""The ingress's L3 key routes (admin keys only; ``pd_cache.cluster.keys``)::

    POST /admin/keys/rotate              a new key version for new writes
    POST /admin/keys/retire              every older version unreadable, its records deleted
    POST /admin/tenants/{tenant}/purge   the tenant's cache forgotten in every tier

and the tenant pin routes (``pd_cache.front.pinning``): ``GET .../pins``, ``POST .../pins/drop``.

Record deletion runs on in the background: the answer says what was done at once.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import unquote

from pd_cache.front.http import HTTPError

TENANT_PREFIX = "/admin/tenants/"
# NOTE: the longest suffix first: ".../pins/drop" is not a tenant named "x/pins".
TENANT_ROUTES = {"/pins/drop": ("POST", "drop_pins"), "/purge": ("POST", "purge"),
                 "/pins": ("GET", "pins")}


def tenant_route(path: str) -> tuple[str, str, str] | None:
    """``(method, action, tenant)`` of a tenant route, ``None`` for any other path."""
    if not path.startswith(TENANT_PREFIX):
        return None
    for suffix, (method, action) in TENANT_ROUTES.items():
        if path.endswith(suffix):
            tenant = unquote(path[len(TENANT_PREFIX):-len(suffix)])
            if tenant and "/" not in tenant:
                return method, action, tenant
    raise HTTPError(404, f"no route {path!r}: expected /admin/tenants/<tenant>/"
                         f"{{{'|'.join(s.lstrip('/') for s in TENANT_ROUTES)}}}", None,
                    "not_found")


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
