"""LocalEngine end to end: output with the cache equals output without it, in every tier."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pd_cache.core.config import CacheConfig, ModelConfig, PDCacheConfig
from pd_cache.core.hashing import page_hashes
from pd_cache.core.request import Req, SamplingParams
from pd_cache.core.vocab import Event, Tier
from pd_cache.kv import CacheKey, SlotError, kv_to_pages
from pd_cache.model.model import Generation, Model, reference_generate
from pd_cache.storage import make_backend
from pd_cache.worker.engine import LocalEngine

PS = 4
TINY = ModelConfig.preset("tiny")
VOCAB = TINY.vocab_size
GREEDY = SamplingParams()
NAMESPACES = [(None, None), (None, "tenant-a"), ("lora-1", None), ("lora-1", "tenant-a")]


def config(device: int = 12, host: int = 40, policy: str = "write_through",
           kv_dtype: str = "float32") -> PDCacheConfig:
    return PDCacheConfig(model=dataclasses.replace(TINY, kv_dtype=kv_dtype),
                         cache=CacheConfig(page_size=PS, device_pages=device, host_pages=host,
                                           write_policy=policy))


def corpus(seed: int, n: int = 24) -> list[tuple[list[int], tuple[str | None, str | None]]]:
    """Prompts sharing a system prefix and documents, spread over four namespaces."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(18)]
    docs = [[rng.randrange(VOCAB) for _ in range(22)] for _ in range(3)]
    out = []
    for _ in range(n):
        doc = rng.choice(docs)[:rng.randrange(0, 23)]
        tail = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))]
        out.append((system + doc + tail, rng.choice(NAMESPACES)))
    return out


class Reference:
    """No-cache results, computed once per prompt with a model of the same config."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._memo: dict[tuple, Generation] = {}

    def __call__(self, prompt: list[int], max_new: int = 5,
                 sampling: SamplingParams = GREEDY) -> Generation:
        k = (tuple(prompt), max_new, sampling)
        if k not in self._memo:
            req = Req(rid="ref", input_ids=prompt, max_new_tokens=max_new, sampling=sampling)
            self._memo[k] = reference_generate(self.model, req)
        return self._memo[k]


def req(i: int, prompt: list[int], ns: tuple[str | None, str | None] = (None, None),
        max_new: int = 5, **kw: object) -> Req:
    return Req(rid=f"r{i}", input_ids=prompt, extra_key=ns[0], cache_salt=ns[1],
               max_new_tokens=max_new, **kw)


def assert_quiescent(engine: LocalEngine) -> None:
    """Between requests: no lock held, every slot owned by the cache, tree consistent."""
    assert engine.locks_held() == 0
    usage = engine.pool_usage()
    assert set(usage["device"]) <= {"radix"} and set(usage["host"]) <= {"radix"}
    engine.cache.check_invariants()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_cached_output_equals_no_cache_output_across_tiers(policy: str) -> None:
    engine = LocalEngine(config(device=12, host=40, policy=policy))
    reference = Reference(Model(engine.config.model))
    hits = {"device": 0, "host": 0}
    prompts = corpus(seed=1)
    for rnd in range(3):
        for i, (prompt, ns) in enumerate(prompts):
            result = engine.generate(req(i, prompt, ns))
            ref = reference(prompt)
            assert result.output_ids == ref.output_ids, (rnd, i, result.cached_tokens)
            torch.testing.assert_close(result.first_logits, ref.logits[0], atol=1e-4, rtol=0)
            for tier in hits:
                hits[tier] += result.cached_tokens[tier]
            assert_quiescent(engine)
        # NOTE: push everything to host so the next round also loads back from L2
        engine.cache.evict(Tier.DEVICE, engine.device_pool.capacity)
    assert hits["device"] > 0 and hits["host"] > 0
    assert engine.stats.get(Event.EVICTED, "device") > 0
    engine.close()


def test_bfloat16_kv_matches_its_own_no_cache_reference() -> None:
    engine = LocalEngine(config(device=16, host=32, kv_dtype="bfloat16"))
    assert engine.device_pool.data.dtype == torch.bfloat16
    reference = Reference(Model(engine.config.model))
    cached = 0
    for _ in range(2):
        for i, (prompt, ns) in enumerate(corpus(seed=2, n=10)):
            result = engine.generate(req(i, prompt, ns))
            # K/V are rounded to bfloat16 in the reference too, so the match stays tight
            assert result.output_ids == reference(prompt).output_ids
            torch.testing.assert_close(result.first_logits, reference(prompt).logits[0],
                                       atol=1e-4, rtol=0)
            cached += sum(result.cached_tokens.values())
        engine.cache.evict(Tier.DEVICE, 16)
    assert cached > 0
    engine.close()


def test_a_namespace_never_reuses_another_namespaces_pages() -> None:
    engine = LocalEngine(config(device=64))
    prompt = corpus(seed=3, n=1)[0][0][:21]
    first = engine.generate(req(0, prompt, ("lora-1", "tenant-a")))
    assert sum(first.cached_tokens.values()) == 0
    for i, ns in enumerate([(None, None), ("lora-1", None), (None, "tenant-a"),
                            ("lora-2", "tenant-a"), ("lora-1", "tenant-b")]):
        other = engine.generate(req(i + 1, prompt, ns))
        assert other.cached_tokens == {"device": 0, "host": 0, "storage": 0}, ns
        assert other.output_ids == first.output_ids      # same model, same tokens
    again = engine.generate(req(9, prompt, ("lora-1", "tenant-a")))
    assert again.cached_tokens["device"] == (len(prompt) - 1) // PS * PS == 20
    assert again.output_ids == first.output_ids
    engine.close()


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    engine = LocalEngine(config(device=64))
    prompt = list(range(16))                                   # exactly four pages
    engine.generate(req(0, prompt))
    again = engine.generate(req(1, prompt))
    assert again.cached_tokens["device"] == 12
    assert again.output_ids == Reference(engine.model)(prompt).output_ids
    engine.close()


def test_prefill_and_decode_can_run_in_different_engines() -> None:
    cfg = config(device=64)
    prefill_side, decode_side = LocalEngine(cfg), LocalEngine(cfg)
    prompt, ns = corpus(seed=4, n=1)[0]
    prefill_side.generate(req(0, prompt, ns))                  # warm: the next prefill hits
    r = req(1, prompt, ns, max_new=7)
    out = prefill_side.prefill(r)
    assert out.cached_tokens["device"] > 0 and out.num_prompt_tokens == len(prompt)
    assert out.kv_pages.shape == (-(-len(prompt) // PS), *cfg.layout.page_shape)
    assert out.page_names == tuple(page_hashes(prompt, PS, extra_key=ns[0],
                                               cache_salt=ns[1]))
    full_kv = kv_to_pages(prefill_side.model(prompt).kv, PS)
    torch.testing.assert_close(out.kv_pages, full_kv, atol=1e-5, rtol=0)
    tokens = decode_side.decode(r, out.kv_pages, out.num_prompt_tokens, out.first_token)
    assert tokens == r.output_ids == Reference(prefill_side.model)(prompt, 7).output_ids
    assert decode_side.pool_usage() == {"device": {}, "host": {}}
    prefill_side.close()
    decode_side.close()


def test_l3_pages_another_engine_stored_are_prefetched_and_counted() -> None:
    cfg = config(device=64)
    store = make_backend(cfg.storage, cfg.layout)          # a real in-process L3
    prompt, ns = corpus(seed=5, n=1)[0][0], ("lora-1", "tenant-a")
    donor = LocalEngine(cfg, storage=store)
    donated = donor.prefill(req(0, prompt, ns))            # written through to L3
    assert donor.flush(10)
    donor.close()
    engine = LocalEngine(cfg, storage=store)               # empty device and host
    r = req(1, prompt, ns)
    out = engine.prefill(r)
    usable = (len(prompt) - 1) // PS
    assert out.cached_tokens == {"device": 0, "host": 0, "storage": usable * PS}
    assert engine.stats.get(Event.HIT, Tier.STORAGE) == usable
    # the KV of those pages is the donor's, verified and copied through host slots
    assert torch.equal(out.kv_pages[:usable], donated.kv_pages[:usable])
    tokens = engine.decode(r, out.kv_pages, out.num_prompt_tokens, out.first_token)
    ref = Reference(engine.model)(prompt)
    assert tokens == ref.output_ids
    torch.testing.assert_close(out.logits, ref.logits[0], atol=1e-4, rtol=0)
    # pages fetched from L3 are now cached locally
    again = engine.generate(req(2, prompt, ns))
    assert again.cached_tokens == {"device": usable * PS, "host": 0, "storage": 0}
    assert engine.flush(10)
    assert_quiescent(engine)
    engine.close()


def test_cache_disabled_gives_the_same_output() -> None:
    engine = LocalEngine(config(device=0, host=0))
    reference = Reference(engine.model)
    for _ in range(2):
        for i, (prompt, ns) in enumerate(corpus(seed=6, n=6)):
            result = engine.generate(req(i, prompt, ns))
            assert result.output_ids == reference(prompt).output_ids
            assert result.cached_tokens == {"device": 0, "host": 0, "storage": 0}
    assert engine.pool_usage() == {"device": {}, "host": {}}
    engine.close()


def test_seeded_sampling_with_the_cache_matches_the_reference() -> None:
    engine = LocalEngine(config(device=64))
    hot = SamplingParams(temperature=0.9, seed=42)
    prompt = corpus(seed=7, n=1)[0][0]
    outs = [engine.generate(req(i, prompt, sampling=hot, max_new=8)) for i in range(2)]
    assert outs[1].cached_tokens["device"] > 0
    assert outs[0].output_ids == outs[1].output_ids == Reference(engine.model)(
        prompt, 8, hot).output_ids
    engine.close()


@pytest.mark.parametrize("max_new", [0, 1])
def test_zero_and_one_new_tokens(max_new: int) -> None:
    engine = LocalEngine(config())
    prompt = list(range(10))
    result = engine.generate(req(0, prompt, max_new=max_new))
    assert result.output_ids == Reference(engine.model)(prompt, max_new).output_ids
    assert len(result.output_ids) == max_new
    engine.close()


def test_bad_requests_are_refused_before_touching_the_cache() -> None:
    engine = LocalEngine(config())
    before = engine.pool_usage()
    too_long = req(0, [i % VOCAB for i in range(1020)], max_new=8)
    with pytest.raises(ValueError, match="input_ids: prompt of 1020 tokens \\+ max_new_tokens=8 "
                                         "exceeds the model context 1024"):
        engine.generate(too_long)
    with pytest.raises(ValueError, match=r"input_ids\[2\]: token id 512 is outside the "
                                         r"vocabulary \[0, 512\)"):
        engine.generate(req(1, [1, 2, VOCAB, 3]))
    assert engine.pool_usage() == before and engine.locks_held() == 0
    engine.close()


def test_decode_refuses_bad_kv_pages() -> None:
    engine = LocalEngine(config())
    r = req(0, list(range(10)))
    out = engine.prefill(r)
    shape = list(out.kv_pages.shape)
    with pytest.raises(ValueError, match=r"pages: expected shape \[n, 2, 2, 4, 2, 16\], got "
                                         r"\[3, 2, 2, 8, 2, 8\]"):
        engine.decode(r, out.kv_pages.reshape(3, 2, 2, 8, 2, 8), 10, out.first_token)
    with pytest.raises(ValueError, match="pages: expected dtype torch.float32, got "
                                         "torch.bfloat16"):
        engine.decode(r, out.kv_pages.bfloat16(), 10, out.first_token)
    with pytest.raises(ValueError, match="pages: expected 3 pages, got 2"):
        engine.decode(r, out.kv_pages[:2], 10, out.first_token)
    with pytest.raises(ValueError, match="num_prompt_tokens: 9 != prompt length 10"):
        engine.decode(r, out.kv_pages, 9, out.first_token)
    with pytest.raises(ValueError, match=r"first_token: expected a token id in \[0, 512\)"):
        engine.decode(r, out.kv_pages, 10, VOCAB)
    assert shape == [3, 2, 2, 4, 2, 16]
    assert engine.decode(r, out.kv_pages, 10, out.first_token) == \
        Reference(engine.model)(list(range(10))).output_ids
    engine.close()


def test_a_failing_compute_releases_its_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LocalEngine(config(device=64))
    prompt = list(range(30))
    engine.generate(req(0, prompt))

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("compute failed")

    monkeypatch.setattr(engine, "model", boom)
    with pytest.raises(RuntimeError, match="compute failed"):
        engine.prefill(req(1, prompt))
    assert_quiescent(engine)
    engine.close()


def test_close_reports_a_leaked_lock() -> None:
    engine = LocalEngine(config())
    engine.generate(req(0, list(range(12))))
    node = engine.cache.match_prefix(CacheKey.build(list(range(12)), page_size=PS)).node
    engine.cache.lock(node)
    with pytest.raises(SlotError, match="1 cache locks still held at close"):
        engine.close()
    engine.cache.unlock(node)
    engine.close()


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_batched_decode_steps_equal_reference_request_by_request(kv_dtype: str) -> None:
    """Requests of different lengths, answer sizes and samplers decode in shared forwards,
    joining and leaving the batch at different steps; each equals its no-cache output."""
    engine = LocalEngine(config(device=64, host=0, kv_dtype=kv_dtype))
    ref = Reference(engine.model)
    rng = random.Random(7)
    reqs = [req(i, [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))],
                max_new=rng.randrange(0, 9),
                sampling=SamplingParams(temperature=0.9 * (i % 2), seed=i)) for i in range(7)]
    outs = [engine.prefill(r) for r in reqs]
    seqs, pending = [], list(zip(reqs, outs))
    while pending or any(not s.done for s in seqs):
        if pending:   # one more joins before every step
            r, o = pending.pop()
            seqs.append(engine.start_decode(r, o.kv_pages, o.num_prompt_tokens, o.first_token))
        engine.decode_step(seqs)
    for s in seqs:
        got = engine.finish_decode(s)
        want = ref(s.req.input_ids, s.req.max_new_tokens, s.req.sampling).output_ids
        assert got == want == s.req.output_ids, s.req.rid
    stats = engine.stats.snapshot()
    assert stats["decode/token"] == sum(max(r.max_new_tokens - 1, 0) for r in reqs)
    assert stats["decode/step"] < stats["decode/token"]   # some steps ran several requests
    assert_quiescent(engine)
    engine.close()


def test_decode_step_rejects_mismatched_batches() -> None:
    engine = LocalEngine(config())
    cfg = engine.config.model
    buf = torch.zeros(2, cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim)
    with pytest.raises(ValueError, match="differ in number"):
        engine.model.decode_step([1, 2], [buf], [0])
    with pytest.raises(ValueError, match=r"positions\[0\]: 4"):
        engine.model.decode_step([1], [buf], [4])
    with pytest.raises(ValueError, match=r"bufs\[0\]"):
        engine.model.decode_step([1], [buf.to(torch.bfloat16)], [0])
    with pytest.raises(ValueError, match="token_ids"):
        engine.model.decode_step([VOCAB], [buf], [0])
    engine.close()


def test_a_stop_token_ends_the_answer_on_every_path_as_without_a_cache() -> None:
    """Stop ids taken from the no-cache answer itself: its 1st (drawn by prefill) and 3rd
    tokens; cold, radix hit and split prefill/decode all stop right after that token, as
    ``reference_generate`` does, and free what they held."""
    engine = LocalEngine(config(device=16, host=32))
    reference = Reference(Model(engine.config.model))
    prompt = corpus(seed=5, n=1)[0][0]
    free = reference(prompt, max_new=8).output_ids
    for stop_at in (0, 2):
        stop = free[stop_at]
        assert stop not in free[:stop_at]        # it first appears there
        sampling = SamplingParams(stop_token_ids=(stop,))
        want = reference(prompt, 8, sampling).output_ids
        assert want == free[:stop_at + 1]
        cold = engine.generate(req(10 + stop_at, prompt, max_new=8, sampling=sampling))
        hit = engine.generate(req(20 + stop_at, prompt, max_new=8, sampling=sampling))
        assert hit.cached_tokens["device"] > 0
        other = LocalEngine(engine.config)
        r = req(30 + stop_at, prompt, max_new=8, sampling=sampling)
        out = engine.prefill(r)
        split = other.decode(r, out.kv_pages, out.num_prompt_tokens, out.first_token)
        assert cold.output_ids == hit.output_ids == split == want
        assert_quiescent(engine)
        assert other.locks_held() == 0
        other.close()
    engine.close()


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, seed=3),
                                      SamplingParams(stop_token_ids=(7,))],
                         ids=["greedy", "sampled", "stop"])
def test_an_answer_resumed_after_k_tokens_goes_on_as_the_whole_answer(
        sampling: SamplingParams) -> None:
    """``Req.resumed_after(sent)``: prompt + sent, the rest of the budget, draws from step
    ``len(sent)`` on; the engine (a cached path) gives what the unbroken answer gives."""
    engine = LocalEngine(config())
    prompt = corpus(seed=8, n=1)[0][0]
    whole = reference_generate(engine.model, req(0, prompt, max_new=12, sampling=sampling))
    for k in (1, 5):
        rest = req(0, prompt, max_new=12, sampling=sampling).resumed_after(
            whole.output_ids[:k])
        assert rest.max_new_tokens == 12 - k and rest.sampling.first_step == k
        assert rest.input_ids == prompt + whole.output_ids[:k]
        assert engine.generate(rest).output_ids == whole.output_ids[k:]
    engine.close()
