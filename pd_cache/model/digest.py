"""The weights digest: which exact weights computed a KV page.

Two checkpoints of equal shapes give pages of equal shapes and different bytes, so the
layout fingerprint carries a digest of the weights themselves (``KVLayout.weights_digest``):
xxh3_128 over every tensor of the state dict, in name order, each framed by its name, dtype
and shape. It is pinned once in the config (``with_weights_digest``, where a cluster
starts); every storage shard then reads it from that config, and every worker checks that
the weights it builds are those (``model_layout``) before it names a page with it.

A Hugging Face checkpoint's digest follows the same rule over the tensors of its files
(``pd_cache.core.pretrained.checkpoint_digest``, read without loading them):
``ModelConfig.from_pretrained`` pins it, and a worker whose files differ refuses to start.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import xxhash
from torch import nn

from pd_cache.core.config import KVLayout, ModelConfig, PDCacheConfig
from pd_cache.core.pretrained import checkpoint_digest
from pd_cache.model.model import Model


def weights_digest(model: nn.Module) -> str:
    """xxh3_128 hex digest of ``model``'s state dict (parameters and persistent buffers)."""
    h = xxhash.xxh3_128()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}\n".encode())
        h.update(_bytes_of(tensor))
    return h.hexdigest()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def seeded_weights_digest(cfg: ModelConfig) -> str:
    """``weights_digest`` of the weights ``cfg`` seeds (or its checkpoint holds); built and
    digested once per config per process (``cfg.weights_digest`` itself is ignored)."""
    if cfg.checkpoint:
        return checkpoint_digest(cfg.checkpoint)   # read from the files, once per process
    return _seeded(dataclasses.replace(cfg, weights_digest=""))


@functools.cache
def _seeded(cfg: ModelConfig) -> str:
    return weights_digest(Model(cfg))


def check_weights(cfg: ModelConfig) -> None:
    """``ValueError`` if ``cfg`` pins weights other than those this process builds from it
    (another checkpoint, or a torch whose generator draws other numbers)."""
    if cfg.weights_digest and cfg.weights_digest != seeded_weights_digest(cfg):
        raise ValueError(f"model.weights_digest: {cfg.weights_digest} is not the digest "
                         f"{seeded_weights_digest(cfg)} of the weights model {cfg.name!r} "
                         f"builds here")


def with_weights_digest(config: PDCacheConfig) -> PDCacheConfig:
    """``config`` with ``model.weights_digest`` pinned to the weights it builds here."""
    check_weights(config.model)
    model = dataclasses.replace(config.model,
                                weights_digest=seeded_weights_digest(config.model))
    return dataclasses.replace(config, model=model)


def model_layout(config: PDCacheConfig) -> KVLayout:
    """The layout of a worker that builds ``config.model``: ``config.layout`` (so it equals a
    storage shard's), once any pinned weights digest is checked against this process's."""
    check_weights(config.model)
    return config.layout


__all__ = ["check_weights", "model_layout", "seeded_weights_digest", "weights_digest",
           "with_weights_digest"]
