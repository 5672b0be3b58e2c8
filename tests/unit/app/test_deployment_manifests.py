"""The deployment files: Serve config, KubeRay manifests, PodMonitor, Grafana dashboard.

Core Kubernetes objects (the pod templates inside the Ray CRDs) are validated against the
Kubernetes OpenAPI schemas shipped by ``kubernetes-validate`` (offline, strict: unknown
fields fail). The Ray and Prometheus Operator CRDs have no schema there, so their structure
is checked field by field below.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pd_cache.core.config import MODEL_PRESETS, PREFETCH_POLICIES, StorageConfig
from pd_cache.metrics import RAY_PREFIX, exported_series

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "k8s"
SERVE_CONFIG = ROOT / "deployments" / "serve_config.yaml"
DASHBOARD = K8S / "grafana" / "pd-cache-dashboard.json"
K8S_VERSION = "1.33"


def load(name: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    assert len(docs) == 1, name
    return docs[0]


def cluster_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    yield "raycluster", load("raycluster.yaml")["spec"]
    yield "rayservice", load("rayservice.yaml")["spec"]["rayClusterConfig"]


def groups(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield spec["headGroupSpec"]
    yield from spec["workerGroupSpecs"]


def walk(node: Any) -> Iterator[Any]:
    yield node
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for child in children:
        yield from walk(child)


# -- Serve config and RayService ----------------------------------------------------------
def test_serve_config_names_the_app_and_valid_args():
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    (app,) = config["applications"]
    assert (app["name"], app["route_prefix"], app["import_path"]) == (
        "pd-cache", "/", "pd_cache.front.serve:app")
    args = app["args"]
    assert args["model"] in MODEL_PRESETS
    for key in ("num_prefill", "num_decode", "num_storage", "page_size"):
        assert isinstance(args[key], int) and args[key] >= 1, key
    assert args["prefetch_policy"] in PREFETCH_POLICIES
    # The storage args must make a valid StorageConfig (it raises ValueError otherwise).
    StorageConfig(backend=args["storage_backend"], num_shards=args["num_storage"],
                  capacity_bytes=args["storage_capacity_bytes"],
                  prefetch_policy=args["prefetch_policy"])
    # Left to the environment on purpose: KubeRay needs the proxy on the pod address.
    assert "host" not in config.get("http_options", {})


def test_serve_config_passes_ray_serve_schema():
    pytest.importorskip("starlette", reason="ray[serve] not installed")
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(yaml.safe_load(SERVE_CONFIG.read_text()))
    assert schema.applications[0].import_path == "pd_cache.front.serve:app"


_REPLICAS = re.compile(r"^(\s*ingress_replicas:) \d+$", re.MULTILINE)


def test_rayservice_embeds_the_serve_config_verbatim_but_for_the_replica_count():
    service = load("rayservice.yaml")
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    embedded, local = service["spec"]["serveConfigV2"], SERVE_CONFIG.read_text()
    assert isinstance(embedded, str)
    # One replica locally; two on Kubernetes, so that one may die while the other serves.
    replicas = [yaml.safe_load(text)["applications"][0]["args"]["ingress_replicas"]
                for text in (local, embedded)]
    assert replicas == [1, 2]
    assert _REPLICAS.sub(r"\1 N", embedded) == _REPLICAS.sub(r"\1 N", local)


def test_raycluster_and_podmonitor_kinds():
    cluster = load("raycluster.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    monitor = load("podmonitor.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")


# -- Ray clusters: auth, resources, ports ----------------------------------------------------
@pytest.mark.parametrize("name, spec", list(cluster_specs()))
def test_token_authentication_stays_on(name, spec):
    assert spec["authOptions"]["mode"] == "token", name
    assert spec["authOptions"]["secretName"]
    assert spec["rayVersion"] >= "2.52"  # the first Ray with token authentication
    for node in walk(spec):
        if isinstance(node, dict) and node.get("name") == "RAY_AUTH_MODE":
            assert node.get("value") != "disabled", name


@pytest.mark.parametrize("name, spec", list(cluster_specs()))
def test_pod_templates_are_valid_core_objects(name, spec):
    for group in groups(spec):
        template = group["template"]
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": f"{name}-check"},
                                      "template": template}, K8S_VERSION, strict=True)
        for container in template["spec"]["containers"]:
            requests = container["resources"]["requests"]
            assert {"cpu", "memory"} <= set(requests), container["name"]


def test_core_schema_check_catches_a_bad_field():
    template = load("raycluster.yaml")["spec"]["headGroupSpec"]["template"]
    template["spec"]["containers"][0]["resource"] = template["spec"]["containers"][0].pop(
        "resources")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": "x"}, "template": template},
                                     K8S_VERSION, strict=True)


@pytest.mark.parametrize("name, spec", list(cluster_specs()))
def test_podmonitor_selects_every_ray_pod_on_its_metrics_port(name, spec):
    monitor = load("podmonitor.yaml")["spec"]
    (endpoint,) = monitor["podMetricsEndpoints"]
    wanted = dict(monitor["selector"]["matchLabels"])
    # KubeRay adds ray.io/is-ray-node="yes" to every Ray pod; the rest must be in templates.
    assert wanted.pop("ray.io/is-ray-node") == "yes"
    for group in groups(spec):
        labels = group["template"]["metadata"]["labels"]
        assert wanted.items() <= labels.items(), name
        (container,) = group["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports[endpoint["port"]] == int(group["rayStartParams"]["metrics-export-port"])


def test_rayservice_pods_expose_the_serve_port():
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    port = config["http_options"]["port"]
    for group in groups(load("rayservice.yaml")["spec"]["rayClusterConfig"]):
        (container,) = group["template"]["spec"]["containers"]
        assert {"name": "serve", "containerPort": port} in container["ports"]


# -- Grafana dashboard --------------------------------------------------------------------
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                 "and", "or", "unless", "offset", "inf", "nan"}


def promql_metrics(expr: str) -> set[str]:
    """Metric names used by a PromQL expression: identifiers that are neither functions,
    keywords, label names (in ``{...}`` or in ``by/on/...(...)``), strings, numbers nor
    durations."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b\d[\w.]*", " ", expr)  # numbers and durations (0.99, 5m, 1e3)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word, rest = match.group(0), expr[match.end():].lstrip()
        if word.lower() not in _PROMQL_WORDS and not rest.startswith("("):
            names.add(word)
    return names


def test_promql_parser_finds_metric_names_only():
    expr = ('histogram_quantile(0.99, sum by (le, tier) (rate(ray_a_bucket{tier="x", '
            'le!="1"}[$__rate_interval]))) / on() group_left() sum(ray_b_total offset 5m) '
            'and ray_c')
    assert promql_metrics(expr) == {"ray_a_bucket", "ray_b_total", "ray_c"}


def dashboard_exprs() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in board["panels"]
            for target in panel["targets"]]


def test_dashboard_queries_only_exported_metrics():
    exported = exported_series(RAY_PREFIX)
    used = set()
    for title, expr in dashboard_exprs():
        names = promql_metrics(expr)
        assert names, (title, expr)
        assert names <= exported, (title, names - exported)
        used |= names
    # Every topic the issue asks for has a panel.
    topics = ["cached_tokens", "storage_misses", "prefetch_bytes", "backup_bytes",
              "handoff_seconds", "pool_used_pages", "pool_capacity_pages", "ttft_seconds",
              "inter_token_seconds", "offload_pages", "tenant_tokens", "tenant_cached_tokens",
              "tenant_rate_limited", "tenant_l3_bytes"]
    for topic in topics:
        assert any(topic in name for name in used), topic


def test_dashboard_structure():
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["title"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource"}
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_every_pod_mounts_the_api_key_secret_and_points_pd_cache_at_it():
    service = yaml.safe_load((K8S / "rayservice.yaml").read_text())
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + \
        [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert secrets == {"api-keys": "pd-cache-api-keys"}
        (container,) = pod["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["PD_CACHE_API_KEYS_FILE"].startswith(mounts["api-keys"] + "/")
        assert env["PD_CACHE_SECRET_FILE"].startswith(mounts["api-keys"] + "/")
