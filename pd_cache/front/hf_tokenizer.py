"""Text for a Hugging Face checkpoint: its own tokenizer and chat template.

``HFTokenizer`` has the small interface the OpenAI front uses for any model (``encode``,
``decode``, ``chat``, ``stream``), as ``ByteTokenizer`` has for the built-in presets;
``tokenizer_for(model)`` picks one by the model's config. The checkpoint's
``tokenizer.json`` and ``tokenizer_config.json`` (with its ``chat_template``) are read with
``transformers`` (the ``hf`` extra), imported only here and only when a checkpoint is
served; nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pd_cache.core.config import ModelConfig
from pd_cache.core.pretrained import TOKENIZER_FILES, eos_token_ids
from pd_cache.front.tokenizer import REPLACEMENT, ROLES, ByteTokenizer


class HFTokenizer:
    """The tokenizer of the checkpoint at ``path``; ``ValueError`` naming a missing file."""

    def __init__(self, path: str) -> None:
        for name in TOKENIZER_FILES:
            if not os.path.isfile(os.path.join(path, name)):
                raise ValueError(f"model: checkpoint {path!r} has no {name}")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError("model: a checkpoint's tokenizer needs the hf extra "
                             "(pip install 'pd-cache[hf]')") from None
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.size = len(self.tok)
        # NOTE: what ends an answer: the checkpoint's generation config, and the tokenizer's
        # own end token (chat templates end a turn with it).
        own = () if self.tok.eos_token_id is None else (int(self.tok.eos_token_id),)
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids(path) + own))

    def encode(self, text: str) -> list[int]:
        """A text prompt, with the special tokens the tokenizer adds (a BOS, say)."""
        if not isinstance(text, str):
            raise ValueError(f"prompt: expected a str, got {type(text).__name__}")
        return list(self.tok.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens left out; ids past the tokenizer's vocabulary (a
        model's padded rows) render as U+FFFD."""
        out, run = [], []
        for t in ids:
            if 0 <= t < self.size:
                run.append(t)
                continue
            out += [self.tok.decode(run, skip_special_tokens=True), REPLACEMENT]
            run = []
        return "".join(out) + self.tok.decode(run, skip_special_tokens=True)

    def chat(self, messages: Sequence[Mapping[str, object]]) -> list[int]:
        """The chat template's rendering of ``messages``, up to the assistant's turn."""
        _check_messages(messages)
        if not getattr(self.tok, "chat_template", None):
            raise ValueError("messages: this checkpoint's tokenizer_config.json has no "
                             "chat_template; send a text prompt to /v1/completions")
        try:
            text = self.tok.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                                add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001  (the template itself may raise)
            raise ValueError(f"messages: the chat template refused them: {exc}") from None
        return list(self.tok.encode(text, add_special_tokens=False))

    def stream(self) -> HFStreamDecoder:
        return HFStreamDecoder(self)


class HFStreamDecoder:
    """Token ids to text one at a time: a token's text is sent once the text so far no
    longer ends in an incomplete character (U+FFFD), so a multi-byte character split over
    tokens arrives whole. The chunks add up to ``decode`` of all the ids."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer, self.ids = tokenizer, []
        self.start = self.sent = 0   # ids[start:sent] decoded and sent; a context window

    def feed(self, token: int) -> str:
        self.ids.append(token)
        done = self.tokenizer.decode(self.ids[self.start:self.sent])
        text = self.tokenizer.decode(self.ids[self.start:])
        if len(text) <= len(done) or text.endswith(REPLACEMENT):
            return ""
        self.start, self.sent = self.sent, len(self.ids)
        return text[len(done):]

    def flush(self) -> str:
        done = self.tokenizer.decode(self.ids[self.start:self.sent])
        text = self.tokenizer.decode(self.ids[self.start:])
        self.start = self.sent = len(self.ids)
        return text[len(done):]


def _check_messages(messages: Sequence[Mapping[str, object]]) -> None:
    if not messages:
        raise ValueError("messages: expected at least one message")
    for i, message in enumerate(messages):
        if message.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role: expected one of {list(ROLES)}, got "
                             f"{message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content: expected a str, got "
                             f"{type(message.get('content')).__name__}")


def tokenizer_for(model: ModelConfig) -> Any:
    """The text interface of ``model``: its checkpoint's tokenizer, else the byte one."""
    return HFTokenizer(model.checkpoint) if model.checkpoint else ByteTokenizer(model.vocab_size)
