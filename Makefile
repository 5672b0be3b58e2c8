# The two commands of the README: `make run` and `make test`. Every install step lives
# here, so a fresh clone needs nothing else.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# NOTE: torch==2.13.0 first: it is a CPU build on local disk; the project's own range
# (torch>=2.4) is then already satisfied and nothing large is downloaded.
TORCH  := torch==2.13.0

.PHONY: run test lint bench bench-peer clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install --quiet $(TORCH)

# NOTE: `make run` writes plots, so its install has the plots extra (matplotlib);
# `pip install pd-cache` stays without it and `pd-cache bench` then skips the plots.
$(VENV)/.installed: pyproject.toml setup.py pd_cache/core/_chain.c pd_cache/model/_attend.c | $(PY)
	$(PIP) install --quiet -e '.[plots]'
	touch $@

$(VENV)/.installed-test: pyproject.toml setup.py pd_cache/core/_chain.c pd_cache/model/_attend.c | $(PY)
	$(PIP) install --quiet -e '.[test,hf]'
	touch $@ $(VENV)/.installed

# NOTE: no RAY_AUTH_MODE here: each Ray cluster that pd-cache or the tests start makes a
# token of its own and admits only its own processes (pd_cache/app/session.py).
# `make run`: 4 tenants x 4 users x 3 turns of chat, arriving at 8 req/s (Poisson), turns
# interleaved at random, through 2 prefill + 2 decode + 2 L3 shards. Each worker's L1/L2
# holds about a third of the working set, so a returning conversation's pages come from
# every tier: L1, L2 after demotion, and L3 after eviction or on the other worker.
RUN_ARGS ?= --model small --tenants 4 --users 4 --rounds 3 --system-len 512 \
            --user-tokens 64 --output-len 16 --turn-order random --request-rate 8 \
            --device-pages 48 --host-pages 96 --output-dir bench-results/run
run: $(VENV)/.installed
	$(VENV)/bin/pd-cache bench $(RUN_ARGS) $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check pd_cache tests benchmarks

# NOTE: the test extras include hf, which benchmarks/bench_hf.py needs.
bench: $(VENV)/.installed-test
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

# `make bench-peer`: pd-cache beside `transformers serve` on the same checkpoints and
# workloads (benchmarks/peers/run.py; <= 45 minutes). Each peer goes into a venv of its own
# under the temp directory, never into $(VENV); PEER_ARGS=--quick for a few minutes,
# PEER_ARGS='--peer vllm' for vLLM's CPU build (a CPU with AVX-512), PEER_ARGS='--peer-url
# URL' for a server already running (SGLang, a llama.cpp server).
bench-peer: $(VENV)/.installed-test
	$(PY) benchmarks/peers/run.py $(PEER_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
