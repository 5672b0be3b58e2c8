"""The reference model: determinism, prefix-KV equivalence, page conversions, bad input,
and the digest of its weights that the layout fingerprint carries."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from pd_cache.core.config import CacheConfig, KVLayout, ModelConfig, PDCacheConfig, StorageConfig
from pd_cache.core.request import Req, SamplingParams
from pd_cache.kv.pages import check_pages, kv_to_pages, page_view, pages_to_kv
from pd_cache.model import digest
from pd_cache.model.digest import seeded_weights_digest, weights_digest, with_weights_digest
from pd_cache.model.layers import attend_prefix, prefix_mask
from pd_cache.model.model import Model, reference_generate, sample
from pd_cache.storage import make_backend
from pd_cache.storage.tier import StorageTier
from pd_cache.worker.engine import LocalEngine
from pd_cache.worker.outputs import Result

CFG = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(CFG)


def _tokens(n: int, seed: int = 0, vocab: int = CFG.vocab_size) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _layout(cfg: ModelConfig = CFG, page_size: int = 4) -> KVLayout:
    return dataclasses.replace(PDCacheConfig(model=cfg).layout, page_size=page_size)


def test_same_seed_builds_identical_weights_and_other_seed_differs() -> None:
    a, b = Model(CFG).state_dict(), Model(CFG).state_dict()
    c = Model(dataclasses.replace(CFG, seed=1)).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed"], c["embed"])


def test_forward_shapes_and_kv_dtype(model: Model) -> None:
    out = model(_tokens(10), all_logits=True)
    assert out.logits.shape == (10, CFG.vocab_size)
    assert out.kv.shape == (2, CFG.num_layers, 10, CFG.num_kv_heads, CFG.head_dim)
    assert out.kv.dtype == torch.float32
    assert model(_tokens(10)).logits.shape == (1, CFG.vocab_size)


@pytest.mark.parametrize("kv_dtype,atol", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_prefix_kv_gives_the_same_logits_as_one_forward(kv_dtype: str, atol: float) -> None:
    m = Model(dataclasses.replace(CFG, kv_dtype=kv_dtype))
    ids = _tokens(37, seed=3)
    full = m(ids, all_logits=True)
    head = m(ids[:20], all_logits=True)
    tail = m(ids[20:], head.kv, all_logits=True)
    assert head.kv.dtype == m.kv_dtype
    torch.testing.assert_close(tail.logits, full.logits[20:], atol=atol, rtol=0)
    torch.testing.assert_close(torch.cat([head.kv, tail.kv], dim=2).float(), full.kv.float(),
                               atol=atol, rtol=0)


def test_attention_is_causal(model: Model) -> None:
    ids = _tokens(24, seed=4)
    short = model(ids[:12], all_logits=True).logits
    longer = model(ids[:12] + _tokens(12, seed=5), all_logits=True).logits[:12]
    torch.testing.assert_close(short, longer, atol=1e-5, rtol=0)


@pytest.mark.parametrize("t,start", [(1, 0), (1, 9), (7, 0), (5, 11)])
def test_prefix_attention_is_the_softmax_formula(t: int, start: int) -> None:
    # Against the formula in float64: query i (position start + i) attends keys 0..start + i,
    # each group of 4 query heads over one KV head; whichever mask prefix_mask picks.
    g = torch.Generator().manual_seed(t * 100 + start)
    heads, kv_heads, dim = 8, 2, 16
    q = torch.randn(t, heads, dim, generator=g)
    k, v = torch.randn(2, t, kv_heads, dim, generator=g)
    past = torch.randn(2, start, kv_heads, dim, generator=g)
    out, new = attend_prefix(q, k, v, past, torch.float32, prefix_mask(t, start))
    keys = torch.cat([past[0], k]).double().repeat_interleave(heads // kv_heads, dim=1)
    values = torch.cat([past[1], v]).double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,khd->htk", q.double(), keys) / dim ** 0.5
    seen = torch.arange(start + t)[None, :] <= torch.arange(start, start + t)[:, None]
    want = torch.einsum("htk,khd->thd", scores.masked_fill(~seen, float("-inf")).softmax(-1),
                        values).reshape(t, heads * dim)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    assert torch.equal(new, torch.stack([k, v]))


def test_positions_matter(model: Model) -> None:
    # The same token after a different-length prefix must not give the same KV (RoPE works).
    ids = _tokens(8, seed=6)
    a = model(ids[:1]).kv
    b = model(ids[1:2] + ids[:1]).kv[:, :, 1:]
    assert not torch.allclose(a[0], b[0])


def test_pages_round_trip_with_partial_last_page() -> None:
    layout = _layout(page_size=4)
    kv = torch.randn(2, CFG.num_layers, 10, CFG.num_kv_heads, CFG.head_dim)
    pages = kv_to_pages(kv, 4)
    assert tuple(pages.shape) == (3, *layout.page_shape)
    # token t is row t % 4 of page t // 4; the padding past token 10 is zero
    assert torch.equal(pages[2, :, :, 1], kv[:, :, 9])
    assert torch.count_nonzero(pages[2, :, :, 2:]) == 0
    assert torch.equal(pages_to_kv(pages, 10, layout), kv)
    assert pages_to_kv(pages[:0], 0, layout).shape[2] == 0


def test_page_view_is_the_full_pages_without_a_copy() -> None:
    kv = torch.randn(2, CFG.num_layers, 10, CFG.num_kv_heads, CFG.head_dim)
    view = page_view(kv, 4)
    assert tuple(view.shape) == (2, *_layout(page_size=4).page_shape)   # token 8, 9: left out
    assert torch.equal(view, kv_to_pages(kv[:, :, :8], 4))
    # token t is row t % 4 of page t // 4, in kv's own memory
    kv[:, :, 6] = 7.0
    assert torch.equal(view[1, :, :, 2], torch.full_like(view[1, :, :, 2], 7.0))


def test_pages_to_kv_fills_a_longer_buffer_in_place() -> None:
    layout = _layout(page_size=4)
    kv = torch.randn(2, CFG.num_layers, 10, CFG.num_kv_heads, CFG.head_dim)
    pages = kv_to_pages(kv, 4)
    buf = torch.full((2, CFG.num_layers, 13, CFG.num_kv_heads, CFG.head_dim), 7.0)
    got = pages_to_kv(pages, 10, layout, out=buf)
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:, :, :10], kv)
    assert torch.all(buf[:, :, 10:] == 7.0)     # past the prompt: untouched
    for bad, why in ((buf[:, :, :9], "expected a contiguous torch.float32 tensor"),
                     (buf.half(), "got torch.float16"),
                     (buf.transpose(3, 4), r"\[2, 2, >= 10, 2, 16\], got torch.float32 "
                                               r"\[2, 2, 13, 16, 2\]")):
        with pytest.raises(ValueError, match=why):
            pages_to_kv(pages, 10, layout, out=bad)


def test_bfloat16_pages_take_half_the_bytes() -> None:
    f32 = _layout(CFG)
    bf16 = _layout(dataclasses.replace(CFG, kv_dtype="bfloat16"))
    kv = Model(dataclasses.replace(CFG, kv_dtype="bfloat16"))(_tokens(8)).kv
    pages = kv_to_pages(kv, 4)
    check_pages(pages, bf16)
    assert pages.nbytes * 2 == kv_to_pages(kv.float(), 4).nbytes
    with pytest.raises(ValueError, match="expected dtype torch.float32, got torch.bfloat16"):
        check_pages(pages, f32)


def test_bad_pages_are_refused_with_the_problem_named() -> None:
    layout = _layout(page_size=4)
    good = torch.zeros(3, *layout.page_shape)
    with pytest.raises(ValueError, match=r"pages: expected shape \[n, 2, 2, 4, 2, 16\], got "
                                         r"\[3, 2, 2, 8, 2, 16\]"):
        check_pages(torch.zeros(3, 2, 2, 8, 2, 16), layout)
    with pytest.raises(ValueError, match="expected dtype torch.float32, got torch.float16"):
        pages_to_kv(good.half(), 10, layout)
    with pytest.raises(ValueError, match="expected 2 pages, got 3"):
        pages_to_kv(good, 8, layout)
    with pytest.raises(ValueError, match="expected a torch.Tensor, got list"):
        check_pages([[0.0]], layout)


def test_model_refuses_bad_past_kv_and_tokens(model: Model) -> None:
    past = model(_tokens(5)).kv
    with pytest.raises(ValueError, match=r"past_kv: expected shape \[2, 2, T, 2, 16\]"):
        model(_tokens(2), past[:, :1])
    with pytest.raises(ValueError, match="past_kv: expected dtype torch.float32"):
        model(_tokens(2), past.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"token_ids\[1\]: token id 512 is outside the "
                                         r"vocabulary \[0, 512\)"):
        model([3, CFG.vocab_size, 4])
    with pytest.raises(ValueError, match=r"token_ids\[0\]: token id -1"):
        model([-1])
    with pytest.raises(ValueError, match="exceed the model context 1024"):
        model(_tokens(20), model(_tokens(1010)).kv)


def test_reference_generate_is_deterministic_and_checks_the_request(model: Model) -> None:
    req = Req(rid="a", input_ids=_tokens(30, seed=7), max_new_tokens=6)
    first = reference_generate(model, req)
    again = reference_generate(Model(CFG), Req(rid="b", input_ids=req.input_ids,
                                               max_new_tokens=6))
    assert len(first.output_ids) == 6 and len(first.logits) == 6
    assert first.output_ids == again.output_ids
    assert first.output_ids[0] == int(first.logits[0].argmax())
    assert reference_generate(model, Req(rid="z", input_ids=[1], max_new_tokens=0)) == ([], [])
    too_long = Req(rid="c", input_ids=_tokens(1020), max_new_tokens=8)
    with pytest.raises(ValueError, match="exceeds the model context 1024"):
        reference_generate(model, too_long)
    with pytest.raises(ValueError, match=r"input_ids\[2\]: token id 600 is outside"):
        reference_generate(model, Req(rid="d", input_ids=[1, 2, 600], max_new_tokens=1))


def test_seeded_sampling_depends_only_on_seed_and_step() -> None:
    logits = torch.randn(CFG.vocab_size, generator=torch.Generator().manual_seed(0))
    hot = SamplingParams(temperature=5.0, seed=11)
    draws = [sample(logits, hot, step) for step in range(20)]
    assert draws == [sample(logits, hot, step) for step in range(20)]
    assert len(set(draws)) > 1      # a flat distribution: steps draw different tokens
    assert sample(logits, SamplingParams(), 3) == int(logits.argmax())


# -- the weights digest in the layout fingerprint ---------------------------------------------

def test_weights_digest_is_stable_and_changes_with_any_one_weight() -> None:
    a, b = Model(CFG), Model(CFG)
    assert weights_digest(a) == weights_digest(b) == seeded_weights_digest(CFG)
    assert len(weights_digest(a)) == 32
    b.blocks[1].w_down.data[3, 5] += 1e-3
    assert weights_digest(b) != weights_digest(a)
    assert weights_digest(Model(dataclasses.replace(CFG, seed=1))) != weights_digest(a)


def test_seeded_weights_are_digested_once_per_model_config(monkeypatch) -> None:
    built: list[ModelConfig] = []

    class Counting(Model):
        def __init__(self, cfg: ModelConfig) -> None:
            built.append(cfg)
            super().__init__(cfg)

    monkeypatch.setattr(digest, "Model", Counting)
    cfg = dataclasses.replace(CFG, seed=4321)
    first = seeded_weights_digest(cfg)
    assert seeded_weights_digest(dataclasses.replace(cfg, weights_digest=first)) == first
    assert seeded_weights_digest(cfg) == first and len(built) == 1


def test_two_checkpoints_of_equal_shapes_get_different_layouts() -> None:
    a, b = Model(CFG), Model(CFG)
    b.embed.data[0, 0] += 1.0
    layouts = [PDCacheConfig(model=dataclasses.replace(CFG, weights_digest=weights_digest(m)))
               .layout for m in (a, b)]
    assert layouts[0].fingerprint != layouts[1].fingerprint
    assert layouts[0].page_shape == layouts[1].page_shape


def test_a_worker_and_a_storage_tier_of_one_config_agree() -> None:
    cfg = with_weights_digest(PDCacheConfig())
    assert with_weights_digest(cfg) == cfg
    engine = LocalEngine(cfg)
    tier = StorageTier(cfg, export_stats=False)
    assert engine.layout == tier.backend.layout == cfg.layout
    assert engine.layout.weights_digest == weights_digest(engine.model)
    engine.close()


def test_weights_other_than_the_pinned_ones_are_refused() -> None:
    cfg = PDCacheConfig(model=dataclasses.replace(CFG, weights_digest="ab" * 16))
    with pytest.raises(ValueError, match="model.weights_digest"):
        LocalEngine(cfg)
    with pytest.raises(ValueError, match="model.weights_digest"):
        with_weights_digest(cfg)


DIGEST_SCRIPT = """
from pd_cache.core.config import PDCacheConfig
from pd_cache.model.digest import with_weights_digest
print(with_weights_digest(PDCacheConfig()).layout.fingerprint)
"""


def test_equal_configs_give_equal_weights_digests_in_another_process() -> None:
    out = subprocess.run([sys.executable, "-c", DIGEST_SCRIPT], check=True,
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "random"})
    assert out.stdout.strip() == with_weights_digest(PDCacheConfig()).layout.fingerprint


@pytest.mark.parametrize("pin", [False, True])
def test_a_disk_l3_filled_by_one_model_serves_nothing_to_another(tmp_path, pin: bool) -> None:
    cache = CacheConfig(page_size=4, device_pages=32, host_pages=32)
    disk = StorageConfig(backend="disk", disk_path=str(tmp_path))
    first = PDCacheConfig(cache=cache, storage=disk)
    other = PDCacheConfig.from_env({"PD_CACHE_MODEL_HIDDEN_SIZE": "128"}, cache=cache,
                                   storage=disk)
    if pin:
        first, other = with_weights_digest(first), with_weights_digest(other)
    ids = _tokens(22, seed=9)
    served = [_serve_once(cfg, ids) for cfg in (first, other, first)]
    assert [s.cached_tokens["storage"] for s in served] == [0, 0, 20]
    for cfg, result in zip((first, other, first), served):
        want = reference_generate(Model(cfg.model), Req(rid="ref", input_ids=ids,
                                                         max_new_tokens=5))
        assert result.output_ids == want.output_ids


def _serve_once(cfg: PDCacheConfig, ids: list[int]) -> Result:
    """One request on a fresh engine over a fresh backend (as after a restart)."""
    engine = LocalEngine(cfg, storage=make_backend(cfg.storage, cfg.layout))
    result = engine.generate(Req(rid="r", input_ids=ids, max_new_tokens=5))
    assert engine.flush(10)
    engine.close()
    return result
