"""``pd-cache make-checkpoint``: a tiny random Hugging Face checkpoint, built offline.

A Llama or Qwen2 of a few layers with ``transformers``' own model classes, random weights
from a fixed seed, saved as safetensors beside a small byte-level BPE tokenizer trained
with ``tokenizers`` and a ChatML chat template: everything ``--model DIR`` needs, so real
checkpoint serving can be tried, tested and benchmarked without downloading anything.
Needs the ``hf`` extra (``pip install -e '.[hf]'``; ``make test`` installs it). The files are
written into a hidden sibling directory first and moved into place at the end: a failure
leaves nothing behind.

The weights are drawn with a large ``initializer_range`` (and random q/k/v biases for
Qwen2, whose initialiser zeroes them): the logits of a random model are then far apart, so
greedy decoding is a sharp test of the cached paths rather than a coin toss between ties.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
from typing import Any

ARCHS = ("llama", "qwen2")
HF_MODULES = ("tokenizers", "transformers", "safetensors")
HF_HINT = ("pip install -e '.[hf]' in the checkout (or pip install 'pd-cache[hf]'); "
           "make test installs it")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "The cache layer keeps the KV of every prompt it has seen, page by page.",
    "Prefill computes the prompt; decode draws one token at a time from its KV.",
    "A tenant never reads the pages of another tenant: names are seeded per namespace.",
    "Storage keeps pages on disk or in memory; any worker can prefetch them again.",
    "Hello! How are you today? I am fine, thank you. What is the weather like?",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, and punctuation: , . ; : ! ? ( ) [ ] { }",
]
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
MAX_VOCAB = 469   # every merge byte-level BPE finds in CORPUS: more ids are never drawn


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write the checkpoint (new, or empty)")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-context", type=int, default=1024,
                        help="tokens of context, prompt and answer (default %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=320,
                        help=f"token ids, {MIN_VOCAB}-{MAX_VOCAB} (default %(default)s)")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=None,
                        help="MLP width (default: twice --hidden-size)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default "
                        "%(default)s); key/value heads: 2, or 1 for an odd count")


def run(args: argparse.Namespace) -> int:
    missing = missing_hf_modules()
    if missing:
        print(f"pd-cache make-checkpoint: needs the hf extra ({', '.join(missing)} missing): "
              f"{HF_HINT}", file=sys.stderr)
        return 1
    path = make_tiny_checkpoint(args.directory, arch=args.arch, seed=args.seed,
                                hidden_size=args.hidden_size, num_layers=args.layers,
                                num_heads=args.heads, num_kv_heads=2 if args.heads % 2 == 0
                                else 1, max_context=args.max_context,
                                vocab_size=args.vocab_size,
                                intermediate_size=args.intermediate_size)
    print(f"wrote a tiny random {args.arch} checkpoint to {path}")
    return 0


def missing_hf_modules() -> list[str]:
    """The modules of the ``hf`` extra this environment cannot import."""
    missing = []
    for name in HF_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def make_tiny_checkpoint(directory: str, *, arch: str = "llama", seed: int = 0,
                         hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                         num_kv_heads: int = 2, max_context: int = 1024,
                         vocab_size: int = 320, intermediate_size: int | None = None,
                         initializer_range: float = 0.3, **config: Any) -> str:
    """Write the checkpoint into ``directory`` (created, or empty); returns its path.
    ``config`` entries go to the ``transformers`` config (``rope_theta``,
    ``tie_word_embeddings``). ``ValueError`` naming the flag for a bad shape; on any failure
    nothing is left behind."""
    check_shape(arch=arch, hidden_size=hidden_size, num_layers=num_layers,
                num_heads=num_heads, num_kv_heads=num_kv_heads, max_context=max_context,
                vocab_size=vocab_size, intermediate_size=intermediate_size)
    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise ValueError(f"directory: {directory} exists and is not an empty directory")
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(directory)}.partial-")
    try:
        _write_checkpoint(stage, arch, seed, max_context=max_context, vocab_size=vocab_size,
                          hidden_size=hidden_size, num_layers=num_layers,
                          num_heads=num_heads, num_kv_heads=num_kv_heads,
                          intermediate_size=2 * hidden_size if intermediate_size is None
                          else intermediate_size,
                          initializer_range=initializer_range, **config)
        if os.path.isdir(directory):
            os.rmdir(directory)   # empty, checked above
        os.rename(stage, directory)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return directory


def check_shape(*, arch: str, hidden_size: int, num_layers: int, num_heads: int,
                num_kv_heads: int, max_context: int, vocab_size: int,
                intermediate_size: int | None) -> None:
    """``ValueError`` naming the flag of the first shape the checkpoint cannot have."""
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {list(ARCHS)}, got {arch!r}")
    mlp = 1 if intermediate_size is None else intermediate_size
    for flag, value in (("--layers", num_layers), ("--heads", num_heads),
                        ("--hidden-size", hidden_size), ("--max-context", max_context),
                        ("--intermediate-size", mlp)):
        if value < 1:
            raise ValueError(f"{flag}: expected a positive count, got {value}")
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"--vocab-size: expected {MIN_VOCAB}-{MAX_VOCAB} (256 byte symbols "
                         f"and {len(SPECIAL_TOKENS)} specials, then what the tokenizer's "
                         f"corpus can merge), got {vocab_size}")
    if hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise ValueError(f"--hidden-size: {hidden_size} must split into --heads {num_heads} "
                         f"heads of an even size (rotary embeddings turn pairs)")
    if num_heads % num_kv_heads:
        raise ValueError(f"--heads: {num_heads} is not a multiple of the {num_kv_heads} "
                         f"key/value heads")


def _write_checkpoint(directory: str, arch: str, seed: int, *, max_context: int,
                      vocab_size: int, **shape: Any) -> None:
    tokenizer = _train_tokenizer(vocab_size)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"--vocab-size: this tokenizers version makes "
                         f"{tokenizer.get_vocab_size()} ids of the corpus, not {vocab_size}")
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    _write_json(os.path.join(directory, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "model_max_length": max_context, "clean_up_tokenization_spaces": False})
    model = _random_model(arch, seed, vocab_size=tokenizer.get_vocab_size(),
                          max_context=max_context, **shape)
    model.save_pretrained(directory)


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _random_model(arch: str, seed: int, *, vocab_size: int, hidden_size: int,
                  num_layers: int, num_heads: int, num_kv_heads: int, max_context: int,
                  intermediate_size: int, initializer_range: float, **config: Any) -> Any:
    import torch
    import transformers

    kind = {"llama": "Llama", "qwen2": "Qwen2"}[arch]
    cfg = getattr(transformers, f"{kind}Config")(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_context,
        initializer_range=initializer_range, bos_token_id=None, eos_token_id=2,
        pad_token_id=0, **config)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{kind}ForCausalLM")(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, initializer_range)
            elif name.endswith("norm.weight"):   # not all ones: norms must be applied
                p.uniform_(0.5, 1.5)
    return model


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
