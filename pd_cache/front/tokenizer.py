"""Text for the built-in models: a byte-level tokenizer and a small chat template.

Ids ``0..255`` are the bytes of the UTF-8 text, so any text round-trips exactly; a few
special ids follow (they need a vocabulary of at least 256 + ``len(SPECIALS)``). A chat is
rendered as::

    <|system|>You are terse.<|end|><|user|>Hi<|end|><|assistant|>

and the model continues after ``<|assistant|>``. A random model also emits ids outside the
byte range: they render as U+FFFD; streamed text holds back an incomplete UTF-8 sequence
until its last byte arrives (``StreamDecoder``).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping, Sequence

SPECIALS = ("<|end|>", "<|system|>", "<|user|>", "<|assistant|>")
ROLES = ("system", "user", "assistant")
REPLACEMENT = "\ufffd"


class ByteTokenizer:
    """UTF-8 bytes as ids, then ``SPECIALS`` at ``256, 257, ...``."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 256 + len(SPECIALS):
            raise ValueError(f"vocab_size: the byte tokenizer needs at least "
                             f"{256 + len(SPECIALS)} ids, the model has {vocab_size}")
        self.vocab_size = vocab_size
        self.special = {text: 256 + i for i, text in enumerate(SPECIALS)}
        # NOTE: the presets' weights are random: no id ends an answer unless a client asks.
        self.eos_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"prompt: expected a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        decoder = StreamDecoder()
        return "".join(decoder.feed(t) for t in ids) + decoder.flush()

    def chat(self, messages: Sequence[Mapping[str, object]]) -> list[int]:
        """The template above; ``ValueError`` naming the message that is not a
        ``{"role": system|user|assistant, "content": str}``."""
        if not messages:
            raise ValueError("messages: expected at least one message")
        ids: list[int] = []
        for i, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if role not in ROLES:
                raise ValueError(f"messages[{i}].role: expected one of {list(ROLES)}, "
                                 f"got {role!r}")
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content: expected a str, got "
                                 f"{type(content).__name__}")
            ids += [self.special[f"<|{role}|>"], *content.encode("utf-8"),
                    self.special["<|end|>"]]
        return ids + [self.special["<|assistant|>"]]

    def stream(self) -> StreamDecoder:
        """A decoder for one streamed answer (``feed`` each token, then ``flush``)."""
        return StreamDecoder()


class StreamDecoder:
    """Token ids to text, one at a time: bytes are held until they complete a character;
    an id past the byte range (a special or a random one) is U+FFFD, specials excepted."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        if 0 <= token < 256:
            return self._utf8.decode(bytes([token]))
        held = self._utf8.decode(b"", final=True)   # a cut sequence renders as U+FFFD
        self._utf8.reset()
        return held + ("" if 256 <= token < 256 + len(SPECIALS) else REPLACEMENT)

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
