"""Tiny random Hugging Face checkpoints for the tests, and ``transformers``' own greedy
decoding over them: the independent reference every cached path is compared to.

Each checkpoint is built once per session with ``transformers``' model classes and a BPE
tokenizer trained by ``tokenizers`` (``pd_cache.app.tiny_checkpoint``): a Llama (untied,
``rope_theta`` 50000), a Qwen2 (q/k/v biases, tied embeddings) and a second Llama of the
first one's shape with other weights.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from pd_cache.app.tiny_checkpoint import make_tiny_checkpoint

CHECKPOINTS = {
    "llama": dict(arch="llama", seed=0, rope_theta=50000.0),
    "qwen2": dict(arch="qwen2", seed=1, tie_word_embeddings=True),
    "llama-b": dict(arch="llama", seed=2, rope_theta=50000.0),
}
# Logits of our float32 forward and transformers' differ by ~1e-5 here; where the top two
# reference logits are closer than this, the two argmaxes may legitimately differ.
TOL = 1e-3


def build_all(root: str) -> dict[str, str]:
    return {name: make_tiny_checkpoint(f"{root}/{name}", **spec)
            for name, spec in CHECKPOINTS.items()}


class Reference(NamedTuple):
    tokens: list[int]
    logits: list[torch.Tensor]


@functools.cache
def hf_model(path: str) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    """Logits ``[T, V]`` of transformers' forward over the whole sequence, no cache."""
    return hf_model(path)(torch.tensor([ids]), use_cache=False).logits[0]


def hf_generate(path: str, ids: list[int], n: int) -> Reference:
    """Greedy decoding, every step a forward over the whole sequence with no cache."""
    seq, out, logits = list(ids), [], []
    for _ in range(n):
        row = hf_logits(path, seq)[-1]
        out.append(int(row.argmax()))
        logits.append(row)
        seq.append(out[-1])
    return Reference(out, logits)


def assert_matches(tokens: list[int], ref: Reference) -> None:
    """``tokens`` equal the reference's token by token; a difference is allowed only where
    the reference's top two logits are within ``TOL`` (and then the rest cannot compare).
    ``PD_CACHE_TEST_STRICT=1`` allows none."""
    assert len(tokens) == len(ref.tokens)
    for i, (ours, want) in enumerate(zip(tokens, ref.tokens)):
        if ours != want:
            assert not os.environ.get("PD_CACHE_TEST_STRICT"), (i, tokens, ref.tokens)
            top = ref.logits[i].topk(2).values
            assert float(top[0] - top[1]) < TOL, (i, tokens, ref.tokens)
            assert abs(float(ref.logits[i][ours] - ref.logits[i][want])) < TOL
            return
