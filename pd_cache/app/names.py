"""``pd-cache names``: name a multi-tenant conversation workload's pages and show reuse.

(``pd-cache run``, the cluster job, lives in ``pd_cache.app.run``.)

Every tenant's prompts start with the same platform preamble, so the token sequences
overlap across tenants; the page names must not. The report shows, per tenant, how many
of its pages were already named by an earlier request of the same namespace (reusable)
and how many names it shares with any other namespace (must be 0).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from pd_cache.app.workload import Conversation, WorkloadConfig, make_conversations
from pd_cache.core.hashing import page_hashes, to_hex


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--clients", type=int, default=2, help="clients per tenant")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    cfg = WorkloadConfig(tenants=args.tenants, clients_per_tenant=args.clients,
                         system_tokens=256, rounds=args.rounds, user_tokens=64,
                         output_tokens=0, seed=args.seed)
    preamble = np.random.default_rng(args.seed + 1).integers(0, cfg.vocab_size, 128).tolist()
    seen: dict[tuple, set[bytes]] = defaultdict(set)
    owner: dict[bytes, tuple] = {}
    rows, start = [], time.perf_counter()
    for conv in make_conversations(cfg):
        for r in range(cfg.rounds):
            rows.append(_name_turn(conv, r, preamble, args.page_size, seen, owner))
    _print_report(rows, owner, args.page_size, time.perf_counter() - start)
    return 0


def _name_turn(conv: Conversation, r: int, preamble: list[int], page_size: int,
               seen: dict[tuple, set[bytes]], owner: dict[bytes, tuple]) -> dict:
    # Answers are left empty here: this demonstration names prompts, it runs no model.
    tokens = preamble + conv.prompt(r, [[] for _ in range(r)])
    ns = (conv.extra_key, conv.cache_salt)
    names = page_hashes(tokens, page_size, extra_key=ns[0], cache_salt=ns[1])
    reused = sum(name in seen[ns] for name in names)
    foreign = sum(owner.get(name, ns) != ns for name in names)
    seen[ns].update(names)
    for name in names:
        owner.setdefault(name, ns)
    return {"conv": conv.name, "round": r, "ns": ns, "pages": len(names), "reused": reused,
            "foreign": foreign, "first": to_hex(names[0])[:12]}


def _print_report(rows: list[dict], owner: dict[bytes, tuple], page_size: int,
                  seconds: float) -> None:
    print(f"{'request':<10} {'namespace (extra_key, cache_salt)':<36} {'pages':>5} "
          f"{'reusable':>8} {'foreign':>7}  first page name")
    for row in rows:
        ns = f"({row['ns'][0]}, {row['ns'][1]})"
        print(f"{row['conv']}/r{row['round']:<5} {ns:<36} {row['pages']:>5} {row['reused']:>8} "
              f"{row['foreign']:>7}  {row['first']}...")
    total = sum(r["pages"] for r in rows)
    reused = sum(r["reused"] for r in rows)
    print(f"\n{len(rows)} requests, {total} pages of {page_size} tokens named in "
          f"{seconds * 1e3:.1f} ms; {len(owner)} distinct names")
    print(f"reusable within a namespace: {reused} pages ({reused / total:.0%})")
    print(f"cross-namespace shared names: {sum(r['foreign'] for r in rows)} "
          "(every tenant's prompt starts with the same 128-token preamble)")
