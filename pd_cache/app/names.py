"""``pd-cache names``: name a multi-tenant conversation workload's pages and show reuse.

The workload is ``pd-cache bench``'s multi-turn chat (``bench.workloads``) with answers left
empty: no model runs here. Every tenant's prompts start with the same platform preamble, so
the token sequences overlap across tenants; the page names must not. The report shows, per
tenant, how many of its pages were already named by an earlier request of the same
namespace (reusable) and how many names it shares with any other namespace (must be 0).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from pd_cache.app.bench.workloads import BenchRequest, multi_turn_workload
from pd_cache.core.hashing import page_hashes, to_hex

PREAMBLE_TOKENS = 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--clients", type=int, default=2, help="clients per tenant")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    workload = multi_turn_workload(args.tenants, args.clients, args.rounds, system_tokens=256,
                                   user_tokens=64, output_tokens=1, seed=args.seed,
                                   preamble_tokens=PREAMBLE_TOKENS)
    # Answers are left empty: this demonstration names prompts, it runs no model.
    answers: dict[int, list[int]] = {r.index: [] for r in workload.requests}
    seen: dict[tuple, set[bytes]] = defaultdict(set)
    owner: dict[bytes, tuple] = {}
    rows, start = [], time.perf_counter()
    for req in workload.requests:
        rows.append(_name_turn(req, req.prompt_ids(answers), args.page_size, seen, owner))
    _print_report(rows, owner, args.page_size, time.perf_counter() - start)
    return 0


def _name_turn(req: BenchRequest, tokens: list[int], page_size: int,
               seen: dict[tuple, set[bytes]], owner: dict[bytes, tuple]) -> dict:
    ns = (req.extra_key, req.cache_salt)
    names = page_hashes(tokens, page_size, extra_key=ns[0], cache_salt=ns[1])
    reused = sum(name in seen[ns] for name in names)
    foreign = sum(owner.get(name, ns) != ns for name in names)
    seen[ns].update(names)
    for name in names:
        owner.setdefault(name, ns)
    return {"conv": req.session, "round": req.turn, "ns": ns, "pages": len(names), "reused": reused,
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
          f"(every tenant's prompt starts with the same {PREAMBLE_TOKENS}-token preamble)")
