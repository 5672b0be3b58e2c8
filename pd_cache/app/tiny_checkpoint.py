"""``pd-cache make-checkpoint``: a tiny random Hugging Face checkpoint, built offline.

A Llama or Qwen2 of a few layers with ``transformers``' own model classes, random weights
from a fixed seed, saved as safetensors beside a small byte-level BPE tokenizer trained
with ``tokenizers`` and a ChatML chat template: everything ``--model DIR`` needs, so real
checkpoint serving can be tried, tested and benchmarked without downloading anything.
Needs the ``hf`` extra (``pip install 'pd-cache[hf]'``).

The weights are drawn with a large ``initializer_range`` (and random q/k/v biases for
Qwen2, whose initialiser zeroes them): the logits of a random model are then far apart, so
greedy decoding is a sharp test of the cached paths rather than a coin toss between ties.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

ARCHS = ("llama", "qwen2")
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write the checkpoint")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)


def run(args: argparse.Namespace) -> int:
    path = make_tiny_checkpoint(args.directory, arch=args.arch, seed=args.seed,
                                hidden_size=args.hidden_size, num_layers=args.layers)
    print(f"wrote a tiny random {args.arch} checkpoint to {path}")
    return 0


def make_tiny_checkpoint(directory: str, *, arch: str = "llama", seed: int = 0,
                         hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                         num_kv_heads: int = 2, max_context: int = 1024,
                         vocab_size: int = 320, initializer_range: float = 0.3,
                         **config: Any) -> str:
    """Write the checkpoint into ``directory`` (created); returns its path. ``config``
    entries go to the ``transformers`` config (``rope_theta``, ``tie_word_embeddings``)."""
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {list(ARCHS)}, got {arch!r}")
    os.makedirs(directory, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    _write_json(os.path.join(directory, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "model_max_length": max_context, "clean_up_tokenization_spaces": False})
    model = _random_model(arch, seed, vocab_size=tokenizer.get_vocab_size(),
                          hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                          num_kv_heads=num_kv_heads, max_context=max_context,
                          initializer_range=initializer_range, **config)
    model.save_pretrained(directory)
    return directory


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
                  initializer_range: float, **config: Any) -> Any:
    import torch
    import transformers

    kind = {"llama": "Llama", "qwen2": "Qwen2"}[arch]
    cfg = getattr(transformers, f"{kind}Config")(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=2 * hidden_size, max_position_embeddings=max_context,
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
