"""A local Hugging Face checkpoint: its files, its config and the digest of its weights.

A checkpoint is a directory::

    config.json               architecture and shape (LlamaForCausalLM, Qwen2ForCausalLM)
    *.safetensors             the weights (one file, or shards listed in
                              model.safetensors.index.json)
    tokenizer.json            the tokenizer (``pd_cache.front.hf_tokenizer``)
    tokenizer_config.json     its special tokens and chat template

Nothing is downloaded: a missing file is a ``ValueError`` naming it. ``model_fields`` reads
``config.json`` into ``ModelConfig`` fields and refuses what the model cannot run (another
architecture, scaled RoPE, sliding windows, an activation other than SiLU). The weights
digest follows the rule of the built-in models (``pd_cache.model.digest``): xxh3_128 over
every tensor in name order, each framed by its name, dtype and shape, here read straight
from the safetensors files (no torch), so a storage shard or a driver digests a checkpoint
without loading it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import os
import struct
from typing import Any

import xxhash

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_files(path: str, *, tokenizer: bool = True) -> None:
    """``ValueError`` naming the first file the checkpoint at ``path`` lacks."""
    if not os.path.isdir(path):
        raise ValueError(f"model: checkpoint directory {path!r} does not exist")
    needed = [CONFIG_FILE, *(TOKENIZER_FILES if tokenizer else ())]
    for name in needed:
        if not os.path.isfile(os.path.join(path, name)):
            raise ValueError(f"model: checkpoint {path!r} has no {name}")
    weight_files(path)


def weight_files(path: str) -> list[str]:
    """The checkpoint's safetensors files, in a stable order; ``ValueError`` if none."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        files = [os.path.join(path, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if not shards or missing:
            raise ValueError(f"model: checkpoint {path!r} lacks the weights file "
                             f"{missing[0] if missing else '(none listed)'} of {INDEX_FILE}")
        return files
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model: checkpoint {path!r} has no *.safetensors weights "
                         f"(model.safetensors)")
    return files


def model_fields(path: str) -> dict[str, Any]:
    """``ModelConfig`` fields of the checkpoint at ``path``, weights digest included."""
    check_files(path, tokenizer=False)
    file = os.path.join(path, CONFIG_FILE)
    raw, where = _read_json(file), f"model: {file}"
    arch = _architecture(raw, where)
    get = functools.partial(_get, raw, where)
    heads = get("num_attention_heads")
    if get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported "
                         f"(only 'silu')")
    _refuse_variants(raw, arch, where)
    return {
        "name": os.path.basename(os.path.normpath(path)),
        "checkpoint": os.path.abspath(path),
        "architecture": arch,
        "vocab_size": get("vocab_size"),
        "hidden_size": get("hidden_size"),
        "num_layers": get("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": get("num_key_value_heads", heads),
        "head_dim": get("head_dim", None) or get("hidden_size") // heads,
        "intermediate_size": get("intermediate_size"),
        "max_context": get("max_position_embeddings"),
        "rope_theta": float(_rope(raw, where)),
        "rms_norm_eps": float(get("rms_norm_eps", 1e-6)),
        "attention_bias": arch == "Qwen2ForCausalLM" or bool(get("attention_bias", False)),
        "tie_embeddings": bool(get("tie_word_embeddings", False)),
        "weights_digest": checkpoint_digest(path),
    }


def _architecture(raw: dict[str, Any], where: str) -> str:
    names = raw.get("architectures") or [_MODEL_TYPES.get(raw.get("model_type", ""), "")]
    arch = names[0] if isinstance(names, list) and names else names
    if arch not in ARCHITECTURES:
        shown = arch or f"model_type {raw.get('model_type')!r}"
        raise ValueError(f"{where}: architecture {shown!r} is not supported; supported: "
                         f"{list(ARCHITECTURES)}")
    return arch


def _refuse_variants(raw: dict[str, Any], arch: str, where: str) -> None:
    """Checkpoint options the model does not implement: refused, never silently ignored."""
    if raw.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias=true is not supported")
    if raw.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window=true is not supported")
    kinds = set(raw.get("layer_types") or ()) - {"full_attention"}
    if kinds:
        raise ValueError(f"{where}: layer_types {sorted(kinds)} are not supported "
                         f"(only full_attention)")


def _rope(raw: dict[str, Any], where: str) -> float:
    """``rope_theta`` of default (unscaled) RoPE, in either config format."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"{where}: rope type {kind!r} is not supported (only 'default')")
    return params.get("rope_theta", raw.get("rope_theta", 10000.0))


def _get(raw: dict[str, Any], where: str, key: str, *default: Any) -> Any:
    if key in raw and raw[key] is not None:
        return raw[key]
    if default:
        return default[0]
    raise ValueError(f"{where}: missing {key!r}")


def eos_token_ids(path: str) -> tuple[int, ...]:
    """The checkpoint's end-of-sequence ids: ``eos_token_id`` (an id or a list of them) of
    its ``generation_config.json``, else of its ``config.json``; ``()`` when it names none."""
    for name in ("generation_config.json", CONFIG_FILE):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            raw = _read_json(file).get("eos_token_id")
            if raw is None:
                continue
            ids = raw if isinstance(raw, list) else [raw]
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                       for i in ids):
                raise ValueError(f"model: {file}: eos_token_id: expected token ids, "
                                 f"got {raw!r}")
            return tuple(ids)
    return ()


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model: {path} is not a JSON object")
    return data


# -- the weights digest -----------------------------------------------------------------------

def checkpoint_digest(path: str) -> str:
    """xxh3_128 hex digest of the checkpoint's tensors (name order; name, dtype, shape and
    bytes of each). Computed once per process per set of files (path, size, mtime)."""
    files = weight_files(path)
    stamp = tuple((f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files)
    return _digest(stamp)


@functools.cache
def _digest(stamp: tuple[tuple[str, int, int], ...]) -> str:
    headers = {file: safetensors_header(file) for file, _, _ in stamp}
    entries = sorted((name, file, meta) for file, (tensors, _) in headers.items()
                     for name, meta in tensors.items())
    names = [name for name, _, _ in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"model: a tensor is stored twice in {sorted(headers)}")
    h = xxhash.xxh3_128()
    with contextlib.ExitStack() as stack:
        data = {file: stack.enter_context(memoryview(stack.enter_context(_mapped(file))))
                for file in headers}
        for name, file, meta in entries:
            start, end = (headers[file][1] + off for off in meta["data_offsets"])
            h.update(f"{name}|{meta['dtype']}|{list(meta['shape'])}\n".encode())
            h.update(data[file][start:end])
    return h.hexdigest()


def safetensors_header(file: str) -> tuple[dict[str, dict[str, Any]], int]:
    """The tensors of one safetensors file (``{name: {dtype, shape, data_offsets}}``) and
    where its data starts; ``ValueError`` naming the file if it is not one."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError) as exc:
        raise ValueError(f"model: {file} is not a safetensors file: {exc}") from None
    header.pop("__metadata__", None)
    if not all(isinstance(m, dict) and {"dtype", "shape", "data_offsets"} <= set(m)
               for m in header.values()):
        raise ValueError(f"model: {file} has a malformed safetensors header")
    return header, 8 + size


def _mapped(file: str) -> mmap.mmap:
    with open(file, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
