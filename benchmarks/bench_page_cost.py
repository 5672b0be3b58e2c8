"""CPU per page of what a worker does to each page it writes to or reads from sealed L3.

A write builds the page's record (``make_record``: the name checked against its tokens)
and seals it into a slot (``Sealer.seal``); a read opens a record into its pool slot
(``Sealer.open``). Each is timed here on one thread, per page, for two page shapes: the
``small`` model's (32 KiB, the pages ``bench_pd.py`` writes) and an 8B-class model's
(one layer group of 2 MiB). Side by side in the same run, interleaved:

- ``copy``: a plain copy of the page's bytes into a warm buffer, the floor of any write;
- ``stream_seal`` / ``stream_open``: the cipher as the sealer called it before
  ``encrypt_into`` (cryptography's streaming ``Cipher``: a new context per payload, the
  tag copied after), the payload alone, the baseline of the change;
- ``seal_call`` / ``open_call``: the cipher as it is called now, the payload alone.

Medians of ``--repeats`` rounds of ``--pages`` calls, CPU time of this thread. Writes
benchmarks/results/page_cost.json (per shape: microseconds per page of each, and
``seal_vs_stream`` / ``open_vs_stream``, the cipher calls now against the baseline).

    python benchmarks/bench_page_cost.py [--pages N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache.core.hashing import namespace_seed, page_hashes
from pd_cache.core.sealing import Keyring
from pd_cache.storage.cipher import open_into, seal_into
from pd_cache.storage.record import TAG_BYTES, as_bytes, encode_header, make_record
from pd_cache.storage.seal import Sealer, sealed_nbytes

SEED = 1234
RESULTS = Path(__file__).parent / "results" / "page_cost.json"
PAGE_SIZE = 16
# [2, layers, page_size, kv heads, head dim] float32
SHAPES = {"small_32KiB": (2, 4, PAGE_SIZE, 2, 32), "8b_class_2MiB": (2, 32, PAGE_SIZE, 8, 128)}


def stream_seal(key: bytes, nonce: bytes, data: np.ndarray, aad: bytes, out: np.ndarray) -> None:
    """The baseline: AES-256-GCM through the streaming interface, tag copied after."""
    enc = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(aad)
    enc.update_into(data, out[:-TAG_BYTES])
    enc.finalize()
    out[-TAG_BYTES:] = np.frombuffer(enc.tag, np.uint8)


def stream_open(key: bytes, nonce: bytes, data: np.ndarray, aad: bytes, out: np.ndarray) -> None:
    dec = Cipher(algorithms.AES(key), modes.GCM(nonce, data[-TAG_BYTES:].tobytes())).decryptor()
    dec.authenticate_additional_data(aad)
    dec.update_into(data[:-TAG_BYTES], out)
    dec.finalize()


def per_page_us(fns: dict[str, Callable[[], object]], pages: int, repeats: int) -> dict:
    """Median CPU microseconds per call of each of ``fns``, rounds interleaved."""
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()   # warm
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.thread_time()
            for _ in range(pages):
                fn()
            runs[name].append((time.thread_time() - start) / pages * 1e6)
    return {name: statistics.median(xs) for name, xs in runs.items()}


def shape_costs(shape: tuple[int, ...], pages: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(SEED)
    page = torch.randn(shape, generator=gen)
    tokens = torch.randint(0, 4096, (PAGE_SIZE,), generator=gen).tolist()
    prior = namespace_seed(None, None)
    name = page_hashes(tokens, PAGE_SIZE, prior=prior)[0]
    sealer, tenant = Sealer(Keyring(os.urandom(32))), "acme"
    record = make_record(name, prior, tokens, {"kv": page}, fingerprint="bench", sums=False)
    slot = torch.empty(sealed_nbytes(record), dtype=torch.uint8)
    sealed = sealer.seal(record, tenant, slot)
    into = torch.empty_like(page)
    key = sealer.keyring.key(tenant, sealer.keyring.current(tenant))
    nonce, aad = sealed.header.seal.nonces[0], encode_header(sealed.header)
    data, ct, plain = as_bytes(page), sealed.payloads[0].numpy(), as_bytes(into)
    copy_to = torch.empty_like(page)
    got = per_page_us({
        "copy": lambda: copy_to.copy_(page),
        "make_record": lambda: make_record(name, prior, tokens, {"kv": page},
                                           fingerprint="bench", sums=False),
        "seal": lambda: sealer.seal(record, tenant, slot),
        "open": lambda: sealer.open(sealed, tenant, (into,)),
        "stream_seal": lambda: stream_seal(key, nonce, data, aad, slot.numpy()),
        "seal_call": lambda: seal_into("aes-256-gcm", key, nonce, data, aad, slot),
        "stream_open": lambda: stream_open(key, nonce, ct, aad, plain),
        "open_call": lambda: open_into("aes-256-gcm", key, nonce, ct, aad, plain),
    }, pages, repeats)
    assert sealer.open(sealed, tenant, (into,)).record is not None
    assert torch.equal(into, page)   # what was sealed opens to the page, bit for bit
    return {"page_bytes": page.numel() * page.element_size(), "us_per_page": got,
            "seal_vs_stream": got["seal_call"] / got["stream_seal"],
            "open_vs_stream": got["open_call"] / got["stream_open"],
            "write_us_per_page": got["make_record"] + got["seal"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=2000, help="calls per round (small "
                        "pages; the 2 MiB shape makes a 64th of them)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out: dict[str, object] = {"seed": SEED, "pages": args.pages, "repeats": args.repeats,
                              "shapes": {}}
    for label, shape in SHAPES.items():
        n = args.pages if label.startswith("small") else max(10, args.pages // 64)
        costs = shape_costs(shape, n, args.repeats)
        out["shapes"][label] = costs   # type: ignore[index]
        us = costs["us_per_page"]
        print(f"{label}: record {us['make_record']:.1f} us, seal {us['seal']:.1f} us, "
              f"open {us['open']:.1f} us, copy {us['copy']:.1f} us per page; cipher call "
              f"{costs['seal_vs_stream']:.2f}x the streaming one to seal "
              f"({us['seal_call']:.1f} vs {us['stream_seal']:.1f} us), "
              f"{costs['open_vs_stream']:.2f}x to open "
              f"({us['open_call']:.1f} vs {us['stream_open']:.1f} us)", flush=True)
    write_result(RESULTS, out)


if __name__ == "__main__":
    main()
