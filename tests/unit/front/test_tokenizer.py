"""The byte-level tokenizer and chat template of the built-in models."""

from __future__ import annotations

import pytest

from pd_cache.front.tokenizer import SPECIALS, ByteTokenizer, StreamDecoder

TEXT = "naïve café ✓ 🙂 end"


def test_text_round_trips_through_utf8_bytes() -> None:
    t = ByteTokenizer(512)
    ids = t.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and t.decode(ids) == TEXT


def test_a_stream_holds_back_an_incomplete_character() -> None:
    d = StreamDecoder()
    pieces = [d.feed(b) for b in "🙂".encode()]
    assert pieces == ["", "", "", "🙂"]
    cut = [d.feed(b) for b in "✓".encode()[:2]] + [d.feed(400)]   # cut by a non-byte id
    assert "".join(cut) == "\ufffd\ufffd"
    assert d.feed(256) == "" and d.flush() == ""                  # a special renders as ""


def test_the_chat_template_and_its_checks() -> None:
    t = ByteTokenizer(300)
    end, system, user, assistant = (256 + i for i in range(len(SPECIALS)))
    ids = t.chat([{"role": "system", "content": "S"}, {"role": "user", "content": "hé"}])
    assert ids == [system, 83, end, user, 104, 195, 169, end, assistant]
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        t.chat([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[1\].content"):
        t.chat([{"role": "user", "content": "x"}, {"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="at least one"):
        t.chat([])
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(256)
