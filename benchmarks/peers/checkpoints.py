"""The two checkpoints of the peer benchmark, built with ``pd-cache make-checkpoint``.

Both use the byte-level tokenizer without merges (``--vocab-size 259``): one printable
character is one token, so the text prompts that ``pd-cache bench --text-prompts`` sends
are the same token count at every server. ``never_draw`` then zeroes the output rows of
every id that is not a printable ASCII byte (the end-of-sequence id among them): a zero
logit is never the greedy pick among ~95 random ones, so no server stops early or answers
with characters the text mode cannot read back. Equal work, whatever a server's flags.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import NamedTuple

VOCAB = 259


class Shape(NamedTuple):
    """``make-checkpoint`` flags of one checkpoint."""

    max_context: int
    hidden_size: int
    layers: int
    intermediate_size: int
    heads: int


# NOTE: compute: a 2,048-token prefill took 1.3-1.4 s on one thread of this 2-core machine
# (loaded by other work), 0.5 s is the floor the benchmark asks for.
SHAPES = {"tiny": Shape(4096, 64, 2, 128, 4), "compute": Shape(8192, 256, 4, 768, 4)}


def build(name: str, root: str) -> str:
    """``root/name`` (built once; an existing one is reused as it is)."""
    path = os.path.join(root, name)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    shape = SHAPES[name]
    subprocess.run([sys.executable, "-m", "pd_cache.app.cli", "make-checkpoint", path,
                    "--vocab-size", str(VOCAB), "--max-context", str(shape.max_context),
                    "--hidden-size", str(shape.hidden_size), "--layers", str(shape.layers),
                    "--intermediate-size", str(shape.intermediate_size),
                    "--heads", str(shape.heads)], check=True)
    never_draw(path)
    return path


def printable_ids(path: str) -> list[int]:
    """The ids the checkpoint's tokenizer decodes to one printable ASCII character."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    out = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i], skip_special_tokens=False)
        if len(text) == 1 and 32 <= ord(text) < 127:
            out.append(i)
    return out


def never_draw(path: str) -> None:
    """Zero the output row of every id outside ``printable_ids`` (EOS and specials too)."""
    import torch
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    head = weights["lm_head.weight"]
    keep = torch.zeros(head.shape[0], dtype=torch.bool)
    keep[printable_ids(path)] = True
    head[~keep] = 0.0
    save_file(weights, file, metadata={"format": "pt"})
