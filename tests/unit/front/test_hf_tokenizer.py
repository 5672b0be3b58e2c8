"""A checkpoint's tokenizer behind the text interface the OpenAI front uses, and the rule
that ``pd_cache`` imports and serves its presets without ``transformers``."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys

import pytest

from pd_cache.core.config import ModelConfig
from pd_cache.front.hf_tokenizer import HFTokenizer, tokenizer_for
from pd_cache.front.tokenizer import ByteTokenizer, StreamDecoder

TEXT = "héllo ☃ wörld, the cache keeps pages! 漢字"


def test_text_round_trips_and_streams_in_whole_characters(hf_checkpoints) -> None:
    tok = tokenizer_for(ModelConfig.from_pretrained(hf_checkpoints["llama"]))
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    stream = tok.stream()
    chunks = [stream.feed(t) for t in ids] + [stream.flush()]
    assert "".join(chunks) == TEXT
    assert "\ufffd" not in "".join(chunks)   # no character was sent cut in two
    rng = random.Random(0)
    for _ in range(50):                      # what a random model emits, ids out of range too
        ids = [rng.randrange(tok.size + 2) for _ in range(20)]
        stream = tok.stream()
        assert "".join(stream.feed(t) for t in ids) + stream.flush() == tok.decode(ids)


def test_chat_messages_go_through_the_checkpoints_template(hf_checkpoints) -> None:
    tok = HFTokenizer(hf_checkpoints["qwen2"])
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    ids = tok.chat(messages)
    text = "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
           "<|im_start|>assistant\n"
    assert ids == tok.tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.tok.convert_tokens_to_ids("<|im_start|>")
    with pytest.raises(ValueError, match=r"messages\[1\].role"):
        tok.chat([messages[0], {"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[0\].content"):
        tok.chat([{"role": "user", "content": 3}])


def test_missing_tokenizer_files_are_named(hf_checkpoints, tmp_path) -> None:
    path = shutil.copytree(hf_checkpoints["qwen2"], tmp_path / "ck")
    os.remove(path / "tokenizer_config.json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        HFTokenizer(str(path))


def test_presets_keep_the_byte_tokenizer() -> None:
    tok = tokenizer_for(ModelConfig.preset("tiny"))
    assert isinstance(tok, ByteTokenizer) and isinstance(tok.stream(), StreamDecoder)


NO_HF = """
import sys
for name in ("transformers", "safetensors", "tokenizers"):
    sys.modules[name] = None          # any import of them now raises ImportError
import pd_cache
from pd_cache import ClusterConfig, LocalEngine, Req
from pd_cache.front.hf_tokenizer import tokenizer_for
from pd_cache.model.hf_model import HFModel
cfg = ClusterConfig(model="tiny", page_size=4).pd_config
engine = LocalEngine(cfg)
print(engine.generate(Req(rid="r", input_ids=[1, 2, 3, 4, 5], max_new_tokens=3)).output_ids)
print(tokenizer_for(cfg.model).decode([104, 105]))
checkpoint = ClusterConfig(model=sys.argv[1]).pd_config.model   # config.json: no extra needed
for make in (lambda: HFModel(checkpoint), lambda: tokenizer_for(checkpoint)):
    try:
        make()
    except ValueError as exc:
        print(exc)
"""


def test_pd_cache_imports_and_serves_presets_without_the_hf_extra(hf_checkpoints) -> None:
    out = subprocess.run([sys.executable, "-c", NO_HF, hf_checkpoints["llama"]],
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == "hi"
    assert all("needs the hf extra (pip install 'pd-cache[hf]')" in line for line in lines[2:])
    assert len(lines) == 4


def test_end_of_sequence_ids_come_from_the_generation_config(hf_checkpoints, tmp_path) -> None:
    """The ids that end an answer: the generation config's (an id or a list), else the
    model config's, with the tokenizer's own end token; none for the presets."""
    import json

    path = shutil.copytree(hf_checkpoints["qwen2"], tmp_path / "ck")
    tok = HFTokenizer(str(path))
    own = tok.tok.convert_tokens_to_ids("<|im_end|>")
    assert own in tok.eos_ids
    with open(path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [7, 11]}, f)
    assert HFTokenizer(str(path)).eos_ids == tuple(dict.fromkeys((7, 11, own)))
    os.remove(path / "generation_config.json")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": 5}))
    assert HFTokenizer(str(path)).eos_ids == tuple(dict.fromkeys((5, own)))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        HFTokenizer(str(path))
    assert tokenizer_for(ModelConfig.preset("tiny")).eos_ids == ()
