"""The ``args`` of the Serve app: ``ClusterConfig``'s fields plus the ingress's own knobs."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.fields import check_positive, check_positive_int, from_mapping

# NOTE: a tiny/small-model prompt of a few thousand ids is ~50 KB of JSON; 1 MiB leaves
# room and still refuses a body that would only waste the replica's memory.
MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class IngressConfig:
    """The HTTP ingress's own knobs; every other ``args`` key is a ``ClusterConfig`` field."""

    request_timeout_s: float = 30.0
    health_timeout_s: float = 5.0
    max_body_bytes: int = MAX_BODY_BYTES
    cluster_name: str | None = "pd-cache"
    api_keys_file: str | None = None
    max_pending: int = 256
    ingress_replicas: int = 1

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "health_timeout_s"):
            check_positive(name, getattr(self, name))
        for name in ("max_body_bytes", "max_pending", "ingress_replicas"):
            check_positive_int(name, getattr(self, name))
        if self.cluster_name is not None and not re.fullmatch(r"[\w.-]{1,64}", self.cluster_name):
            raise ValueError(f"cluster_name: expected 1-64 of [A-Za-z0-9_.-] or null, got "
                             f"{self.cluster_name!r}")
        # NOTE: an unnamed cluster belongs to the replica that starts it: two replicas would
        # start two clusters, each with the whole config's workers.
        if self.ingress_replicas > 1 and self.cluster_name is None:
            raise ValueError(f"ingress_replicas: {self.ingress_replicas} replicas must share "
                             f"one named cluster; set cluster_name (or ingress_replicas: 1)")


class AppArgs(NamedTuple):
    """The ``args`` of a Serve config, read into the two configs they describe."""

    cluster: ClusterConfig
    ingress: IngressConfig

    @classmethod
    def parse(cls, args: Mapping[str, Any] | None) -> AppArgs:
        """``ValueError`` naming the key: unknown, of a wrong type, or of a bad value."""
        args = dict(args or {})
        ingress_keys = {f.name for f in dataclasses.fields(IngressConfig)}
        cluster_keys = {f.name for f in dataclasses.fields(ClusterConfig)}
        unknown = sorted(set(args) - ingress_keys - cluster_keys)
        if unknown:
            raise ValueError(f"args.{unknown[0]}: unknown key; expected one of "
                             f"{sorted(ingress_keys | cluster_keys)}")
        pick = lambda keys: {k: v for k, v in args.items() if k in keys}  # noqa: E731
        return cls(from_mapping(ClusterConfig, pick(cluster_keys), "args."),
                   from_mapping(IngressConfig, pick(ingress_keys), "args."))
