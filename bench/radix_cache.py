"""UHRC micro-benchmark: insert, match, lock+unlock and evict latency on a shared-prefix workload.

2000 sequences: one of 20 shared 512-token system prompts (or, with probability 1/3, an earlier
sequence) plus a random suffix of 1..256 tokens; then 2000 queries (1/3 an existing sequence,
1/3 an existing sequence plus 10..100 new tokens, 1/3 a fresh 50..300-token sequence); lock and
unlock on the matched nodes; then evict 1024 tokens at a time until the tree is empty. Keys are
built before timing (an engine builds a request's key once). Prints a table and writes JSON.

``--reuse on`` attaches the position-independent donor index as the engine does: every insert
also records its key for the index (timed with the insert), and the batched fingerprinting of
what was recorded is timed on its own (``register``, per sequence). ``--reuse both`` runs off and
on alternately, three times each, and compares the median insert p50s.

    python bench/radix_cache.py --page-size 1 --json /tmp/radix_ps1.json
    python bench/radix_cache.py --page-size 16 --reuse both
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from common import cpu_name, write_json  # noqa: E402

from hyloop.cache import EvictParams, InsertParams, MatchPrefixParams, RadixKey, UnifiedRadixCache
from hyloop.cache.position_independent.chunker import Chunker
from hyloop.cache.position_independent.index import DonorIndex
from hyloop.pools import PageAllocator

VOCAB = 32000


def make_workload(rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [[rng.randrange(VOCAB) for _ in range(512)] for _ in range(20)]
    seqs: list[list[int]] = []
    for _ in range(2000):
        base = rng.choice(seqs) if seqs and rng.random() < 1 / 3 else rng.choice(prompts)
        seqs.append(base + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 256))])
    queries: list[list[int]] = []
    for _ in range(2000):
        kind = rng.randrange(3)
        if kind == 0:
            queries.append(rng.choice(seqs))
        elif kind == 1:
            extra = [rng.randrange(VOCAB) for _ in range(rng.randint(10, 100))]
            queries.append(rng.choice(seqs) + extra)
        else:
            queries.append([rng.randrange(VOCAB) for _ in range(rng.randint(50, 300))])
    return seqs, queries


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e6


def summarize(samples_us: list[float]) -> dict[str, float]:
    ordered = sorted(samples_us)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    total_s = sum(ordered) / 1e6
    return {
        "p50_us": round(statistics.median(ordered), 2),
        "p99_us": round(p99, 2),
        "ops_per_s": round(len(ordered) / total_s, 1) if total_s else float("inf"),
    }


def run(page_size: int, reuse: bool = False) -> dict[str, Any]:
    rng = random.Random(0)
    seqs, queries = make_workload(rng)
    total_tokens = sum(len(s) for s in seqs)
    # Every insert allocates its whole sequence before the tree frees duplicates.
    num_pages = total_tokens // page_size + len(seqs) + 2
    alloc = PageAllocator(num_pages, page_size)
    cache = UnifiedRadixCache(kv_allocator=alloc, page_size=page_size, components=("full",))
    results: dict[str, list[float]] = {"insert": [], "match": [], "lock_unlock": [], "evict": []}
    index = None
    if reuse:
        index = DonorIndex(Chunker())
        cache.delete_listeners.append(index.on_node_deleted)
        results["register"] = []

    def insert(p: InsertParams) -> Any:
        r = cache.insert(p)
        if index is not None:
            index.note(p.key, r.aligned_len, r.last_node, r.prefix_len)
        return r

    for i, s in enumerate(seqs):
        value = alloc.alloc(len(s))
        assert value is not None, "allocator sized too small"
        params = InsertParams(key=RadixKey(s), value=value[: len(s)])
        r, us = timed(lambda p=params: insert(p))
        results["insert"].append(us)
        if index is not None and (i + 1) % 64 == 0:  # batched, as before a plan
            _, us = timed(index.flush)
            results["register"].extend([us / 64] * 64)
        # The unaligned tail (and the padding of the last page) stays with the caller.
        if r.aligned_len < len(value):
            alloc.free(value[r.aligned_len :])

    match_params = [MatchPrefixParams(key=RadixKey(q)) for q in queries]
    for p in match_params:  # warm pass: splits happen here
        cache.match_prefix(p)
    nodes = []
    for p in match_params:
        m, us = timed(lambda p=p: cache.match_prefix(p))
        results["match"].append(us)
        nodes.append(m.last_node)

    for node in nodes:

        def lock_unlock(node: Any = node) -> None:
            receipt = cache.inc_lock_ref(node)
            cache.dec_lock_ref(receipt.to_dec_params())

        _, us = timed(lock_unlock)
        results["lock_unlock"].append(us)

    evict_params = EvictParams(num_tokens=1024)
    while cache.total_size() > 0:
        e, us = timed(lambda: cache.evict(evict_params))
        results["evict"].append(us)
        if e.num_tokens_evicted == 0:
            break

    ledger_ok = True
    try:
        if index is not None:
            index.flush()
            index.check()
            ledger_ok = len(index) == 0  # the tree is empty: so is the index
        cache.check_invariants()
        alloc.check_invariants()
        ledger_ok = (
            ledger_ok and alloc.available_size() == alloc.capacity and cache.total_size() == 0
        )
    except AssertionError as err:
        print(f"ledger check failed: {err}")
        ledger_ok = False
    return {
        "page_size": page_size,
        "reuse": reuse,
        "results": {k: summarize(v) for k, v in results.items()},
        "ledger_ok": ledger_ok,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--reuse", choices=["off", "on", "both"], default="off")
    ap.add_argument("--json", type=str, default=None, help="write the results here")
    args = ap.parse_args()
    if args.reuse != "both":
        out = run(args.page_size, args.reuse == "on")
        print_table(out)
        write_json(out, args.json)
        return
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(3):  # alternate, so both see the same load on the machine
        for reuse in (False, True):
            runs[reuse].append(run(args.page_size, reuse))
    p50 = {
        k: statistics.median(r["results"]["insert"]["p50_us"] for r in v) for k, v in runs.items()
    }
    for reuse in (False, True):
        print_table(runs[reuse][-1])
    ratio = p50[True] / p50[False]
    print(
        f"insert p50, median of 3: reuse off {p50[False]:.2f} us, on {p50[True]:.2f} us "
        f"({ratio:.2f}x)"
    )
    write_json(
        {
            "page_size": args.page_size,
            "insert_p50_us": {"off": p50[False], "on": p50[True]},
            "ratio": ratio,
            "runs": {"off": runs[False], "on": runs[True]},
        },
        args.json,
    )


def print_table(out: dict[str, Any]) -> None:
    reuse = "on" if out["reuse"] else "off"
    print(f"UHRC bench, page_size={out['page_size']}, reuse {reuse}, CPU: {cpu_name()}")
    print(f"{'op':<12} {'p50 (us)':>10} {'p99 (us)':>10} {'ops/s':>12}")
    for name, r in out["results"].items():
        print(f"{name:<12} {r['p50_us']:>10.2f} {r['p99_us']:>10.2f} {r['ops_per_s']:>12.1f}")
    print(f"ledger check: {'ok' if out['ledger_ok'] else 'FAILED'}")


if __name__ == "__main__":
    main()
