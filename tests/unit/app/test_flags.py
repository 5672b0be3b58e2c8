"""One source for the cluster's knobs: flags and Serve args come from ``ClusterConfig``."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pd_cache import ClusterConfig, StorageConfig
from pd_cache.app.flags import add_config_arguments, config_from_args
from pd_cache.core.config import STORAGE_BACKENDS
from pd_cache.storage import BACKENDS, backend_class, register_backend


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_config_arguments(p, ClusterConfig)
    return p


def test_every_field_is_a_flag_with_its_default_and_help() -> None:
    p = parser()
    flags = {a.dest: a for a in p._actions if a.dest != "help"}
    fields = dataclasses.fields(ClusterConfig)
    assert set(flags) == {f.name for f in fields}
    for f in fields:
        assert flags[f.name].default == f.default, f.name
        assert flags[f.name].help.startswith(f.metadata["help"]), f.name
    assert config_from_args(ClusterConfig, p.parse_args([])) == ClusterConfig()


def test_flags_parse_into_the_config() -> None:
    args = parser().parse_args(["--num-prefill", "3", "--no-cache", "--storage-backend", "disk",
                                "--disk-path", "/tmp/l3", "--actor-cpus", "0.5",
                                "--model", "tiny", "--decode-pack"])
    cfg = config_from_args(ClusterConfig, args)
    assert (cfg.num_prefill, cfg.cache, cfg.storage_backend, cfg.disk_path, cfg.actor_cpus,
            cfg.model, cfg.decode_pack) == (3, False, "disk", "/tmp/l3", 0.5, "tiny", True)
    off = config_from_args(ClusterConfig, parser().parse_args(["--no-decode-cache"]))
    assert not off.decode_cache and not off.pd_config.cache.decode_cache
    assert ClusterConfig().pd_config.cache.decode_cache   # on by default
    assert not cfg.pd_config.cache.decode_cache   # --no-cache turns every tier off


@pytest.mark.parametrize("argv, flag", [(["--num-prefill", "two"], "--num-prefill"),
                                        (["--model", "huge"], "--model"),
                                        (["--storage-backend", "tape"], "--storage-backend")])
def test_a_bad_flag_value_names_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(argparse.ArgumentError, match=flag):
        parser().parse_args(argv)


def test_a_value_the_config_refuses_names_the_field() -> None:
    args = parser().parse_args(["--num-prefill", "0"])
    with pytest.raises(ValueError, match="num_prefill"):
        config_from_args(ClusterConfig, args)


def test_backend_names_validate_against_the_one_registry() -> None:
    assert BACKENDS is STORAGE_BACKENDS
    with pytest.raises(ValueError, match="storage.backend: expected one of"):
        StorageConfig(backend="tape")
    register_backend("tape", "pd_cache.storage.memory:MemoryBackend")
    try:
        assert StorageConfig(backend="tape").backend == "tape"
        assert backend_class("tape").__name__ == "MemoryBackend"
    finally:
        del BACKENDS["tape"]
    with pytest.raises(ValueError, match="unknown backend"):
        backend_class("tape")


def test_serve_args_are_the_config_fields_plus_the_ingress_knobs() -> None:
    pytest.importorskip("ray.serve")
    from pd_cache.front.app_args import AppArgs, IngressConfig

    every = {f.name: getattr(ClusterConfig(model="tiny"), f.name)
             for f in dataclasses.fields(ClusterConfig)}
    parsed = AppArgs.parse({**every, "request_timeout_s": 7.0})
    assert parsed.cluster == ClusterConfig(model="tiny")
    assert parsed.ingress == IngressConfig(request_timeout_s=7.0)
    with pytest.raises(ValueError, match="args.replicas: unknown key"):
        AppArgs.parse({"replicas": 3})
    with pytest.raises(ValueError, match="args.num_decode"):
        AppArgs.parse({"num_decode": "two"})
    with pytest.raises(ValueError, match="num_decode"):
        AppArgs.parse({"num_decode": 0})
    with pytest.raises(ValueError, match="request_timeout_s"):
        AppArgs.parse({"request_timeout_s": 0})
