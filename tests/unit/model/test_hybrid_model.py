"""The hybrid presets: config, layout fingerprint, and a model resumed from KV plus state."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pd_cache.core.config import CacheConfig, ModelConfig, PDCacheConfig
from pd_cache.core.request import Req
from pd_cache.model.model import Model, check_state, reference_generate

HYBRID = ModelConfig.preset("tiny-hybrid")


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(HYBRID)


def _tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, HYBRID.vocab_size, (n,), generator=g).tolist()


def test_hybrid_presets_have_attention_and_recurrent_layers() -> None:
    for name in ("tiny-hybrid", "small-hybrid"):
        cfg = ModelConfig.preset(name)
        assert cfg.attention_layers == cfg.recurrent_layers == 2
        layout = PDCacheConfig(model=cfg).layout
        assert layout.num_layers == 2 and layout.has_state
        assert layout.state_shape == (2, cfg.hidden_size)
    assert not PDCacheConfig().layout.has_state


@pytest.mark.parametrize("bad", ["rr", "rar", "aaax", 3])
def test_a_bad_layer_pattern_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="model.layer_pattern"):
        ModelConfig(layer_pattern=bad)  # type: ignore[arg-type]


def test_plain_fingerprints_are_unchanged_and_hybrid_fields_enter_the_fingerprint() -> None:
    # NOTE: the value a tiny layout had before hybrid models existed: plain L3 pages on disk
    # stay readable.
    assert PDCacheConfig().layout.fingerprint == "f9fbc2e377038859924fbd3d73859c25"
    base = PDCacheConfig(model=HYBRID).layout
    assert base.fingerprint != PDCacheConfig().layout.fingerprint
    for change in ({"state_layers": 1}, {"state_dim": 32}):
        assert dataclasses.replace(base, **change).fingerprint != base.fingerprint
    other = PDCacheConfig(model=dataclasses.replace(HYBRID, layer_pattern="arar")).layout
    assert other.fingerprint != base.fingerprint and other.page_shape == base.page_shape
    # where checkpoints go does not change a page's bytes
    sparse = PDCacheConfig(model=HYBRID, cache=CacheConfig(state_every_pages=7)).layout
    assert sparse.fingerprint == PDCacheConfig(model=HYBRID).layout.fingerprint
    with pytest.raises(ValueError, match="layout.state_dim"):
        dataclasses.replace(base, state_dim=0)
    with pytest.raises(ValueError, match="cache.state_every_pages"):
        CacheConfig(state_every_pages=0)


def test_a_prefix_resumed_from_its_kv_and_state_equals_one_forward(model: Model) -> None:
    ids = _tokens(37, seed=1)
    full = model(ids, all_logits=True, state_at=[8, 16, 37])
    head = model(ids[:16], all_logits=True, state_at=[8, 16])
    tail = model(ids[16:], head.kv, all_logits=True, state=head.state)
    assert torch.equal(head.state, full.states[1]) and torch.equal(full.states[2], full.state)
    assert torch.equal(head.states[0], full.states[0])
    torch.testing.assert_close(tail.logits, full.logits[16:], atol=1e-5, rtol=0)
    assert torch.equal(tail.state, full.state)
    # without the state the same KV gives other logits: the recurrent layers matter
    blind = model(ids[16:], head.kv, all_logits=True)
    assert not torch.allclose(blind.logits, full.logits[16:], atol=1e-3)


def test_decode_steps_advance_the_state_as_a_forward_does(model: Model) -> None:
    ids = _tokens(20, seed=2)
    r = Req(rid="r", input_ids=ids, max_new_tokens=6)
    want = reference_generate(model, r).output_ids
    out = model(ids)
    buf = torch.zeros(2, 2, 30, 2, 16)
    buf[:, :, :20] = out.kv
    state, token, got = out.state.clone(), int(out.logits[-1].argmax()), []
    for pos in range(20, 26):
        got.append(token)
        token = int(model.decode_step([token], [buf], [pos], [state])[0].argmax())
    assert got == want
    torch.testing.assert_close(state, model(ids + want).state, atol=1e-5, rtol=0)


def test_bad_states_are_refused_with_the_problem_named(model: Model) -> None:
    with pytest.raises(ValueError, match=r"state: expected shape \[2, 64\], got \[1, 64\]"):
        model(_tokens(3), state=torch.zeros(1, 64))
    with pytest.raises(ValueError, match="state: expected dtype torch.float32"):
        model(_tokens(3), state=torch.zeros(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"state_at\[0\]"):
        model(_tokens(3), state_at=[4])
    with pytest.raises(ValueError, match="states: a hybrid model"):
        model.decode_step([1], [torch.zeros(2, 2, 4, 2, 16)], [0])
    with pytest.raises(ValueError, match="expected a torch.Tensor"):
        check_state([0.0], HYBRID)
