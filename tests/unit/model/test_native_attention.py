"""Decode's attention step in C (pd_cache/model/native.py) against torch's
``scaled_dot_product_attention``, an implementation it shares no code with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pd_cache.core.config import ModelConfig
from pd_cache.core.request import Req
from pd_cache.model import native
from pd_cache.model.model import Model, reference_generate

AVX2 = {"avx2", "fma"} <= set(
    next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text()
          .splitlines() if line.startswith("flags")), []))
needs_kernel = pytest.mark.skipif(not AVX2, reason="this CPU has no AVX2 and FMA")


@pytest.fixture
def torch_only(monkeypatch):
    """Torch's kernel everywhere for the test (the environment switch, read anew)."""
    monkeypatch.setenv(native.ENV, "0")
    native.kernel.cache_clear()
    yield
    monkeypatch.delenv(native.ENV)
    native.kernel.cache_clear()


def buffers(lens, kv_heads, dim, *, layers=2, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, layers, n + 5, kv_heads, dim, generator=g) * scale for n in lens]


def torch_answer(q, bufs, layer, lens, group):
    return torch.cat([native.attend_torch(q[i], buf[:, layer, :n], group)
                      for i, (buf, n) in enumerate(zip(bufs, lens, strict=True))]
                     ).reshape(len(lens), -1)


@needs_kernel
def test_the_kernel_is_built_and_serves_on_this_machine():
    assert native.kernel() is not None   # built at install, and it passed its probe


@needs_kernel
@pytest.mark.parametrize("kv_heads,group,dim", [(2, 4, 32), (1, 1, 8), (4, 2, 16),
                                                (2, 8, 64), (1, 4, 128), (3, 3, 24)])
def test_agrees_with_torch_over_lengths_around_each_block(kv_heads, group, dim):
    lens = [1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 129, 1000]
    bufs = buffers(lens, kv_heads, dim)
    q = torch.randn(len(lens), kv_heads * group, dim, generator=torch.Generator().manual_seed(1))
    got = native.attend_native(q, bufs, 1, [n - 1 for n in lens])
    want = torch_answer(q, bufs, 1, lens, group)
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_large_scores_stay_finite_and_peaked_like_torch():
    """Scores in the hundreds: softmax's maximum is taken off before any exp, and the
    keys whose weight underflows to 0 do so in both."""
    lens = [300, 4096]
    bufs = buffers(lens, 2, 32, scale=6.0)
    q = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2)) * 6.0
    got = native.attend_native(q, bufs, 0, [n - 1 for n in lens])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch_answer(q, bufs, 0, lens, 4), rtol=1e-4, atol=1e-4)


@needs_kernel
def test_torch_serves_what_the_kernel_does_not():
    lens = [10]
    q = torch.randn(1, 8, 32)
    half = [b.half() for b in buffers(lens, 2, 32)]
    assert native.attend_native(q, half, 0, [9]) is None               # another KV dtype
    wide = buffers(lens, 2, 32)[0].transpose(3, 4).contiguous().transpose(3, 4)
    assert native.attend_native(q, [wide], 0, [9]) is None             # rows not contiguous
    assert native.attend_native(torch.randn(1, 8, 12), buffers(lens, 2, 12), 0, [9]) is None
    with pytest.raises(ValueError, match="position 15 is outside a buffer of 15 tokens"):
        native.attend_native(q, buffers(lens, 2, 32), 0, [15])
    with pytest.raises(ValueError, match=r"queries \(1, 8, 16\) for 1 buffers of head size 32"):
        native.attend_native(torch.randn(1, 8, 16), buffers(lens, 2, 32), 0, [9])
    with pytest.raises(ValueError, match=r"queries \(1, 8, 32\) for 2 buffers"):
        native.attend_native(q, buffers([10, 10], 2, 32), 0, [9, 9])


def test_the_environment_switch_keeps_torch(torch_only):
    assert native.kernel() is None
    assert native.attend_native(torch.randn(1, 8, 32), buffers([4], 2, 32), 0, [3]) is None


@needs_kernel
@pytest.mark.parametrize("preset", ["tiny", "small"])   # head dims 16 and 32
def test_a_decode_draws_the_same_tokens_with_either_kernel_and_as_the_reference(preset,
                                                                                monkeypatch):
    """Model.decode_step through the C kernel, through torch's, and no cache at all
    (``reference_generate`` reruns the whole sequence each token) agree token for token."""
    model = Model(ModelConfig.preset(preset))
    req = Req(rid="r", input_ids=list(range(3, 40)), max_new_tokens=12)
    real, calls = native.kernel(), []

    def counted(*args):
        calls.append(args[4])   # the lengths
        return real(*args)

    def decode() -> list[int]:
        out = model.forward(req.input_ids)
        n = len(req.input_ids)
        buf = out.kv.new_zeros((2, out.kv.shape[1], n + req.max_new_tokens) + out.kv.shape[3:])
        buf[:, :, :n] = out.kv
        tokens = [int(out.logits[-1].argmax())]
        for step in range(req.max_new_tokens - 1):
            logits = model.decode_step([tokens[-1]], [buf], [n + step])
            tokens.append(int(logits[0].argmax()))
        return tokens

    monkeypatch.setattr(native, "kernel", lambda: counted)
    fast = decode()
    layers = model.cfg.num_layers
    assert calls == [[n] for n in range(38, 49) for _ in range(layers)]   # every step, in C
    monkeypatch.setattr(native, "kernel", lambda: None)
    slow = decode()
    assert fast == slow == reference_generate(model, req).output_ids
