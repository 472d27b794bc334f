"""Offline batches through Ray Data: prefix affinity vs Ray's default split vs one process.

8 tenants x 16 requests; a tenant's requests share a 512-token prefix and add their own 16-64
token tail (8 new tokens each, greedy). Two replicas on a local Ray (one CPU and one torch
thread each), with prefix-affinity sharding and with Ray's default split, against one local
process, for tenants arriving grouped and interleaved. The model is a tiny random dense Llama
(hidden 256, 8 layers, vocab 4096) built in a temp dir: the figures are about work placement,
not model speed. Prefill tokens computed and cache hits are what the engines report per request
(prompt tokens minus ``num_cached_tokens``); the ideal computes each tenant's prefix once plus
every tail. Wall time includes starting the engines (Ray actors included). Prints a table that
names the CPU; writes JSON.

    python bench/ray_batch.py [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# hyloop first: it sets OpenMP's passive waits, which libgomp reads once, when torch loads.
importlib.import_module("hyloop")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import SMALL_DENSE, cpu_name, test_helpers, write_json  # noqa: E402

from hyloop import LLM, SamplingParams  # noqa: E402

TENANTS, PER_TENANT, PREFIX, REPLICAS = 8, 16, 512, 2
MODEL: dict[str, Any] = dict(
    SMALL_DENSE, architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=10000.0
)
ENGINE = [
    "kv_pool.page_size=16",
    "kv_pool.num_pages=2048",
    "model.max_context=1024",
    "scheduler.max_running_requests=64",
]
RAY = ["ray.batch_size=16", "ray.prefix_tokens=128", "ray.max_imbalance=1.25"]


def workload(interleaved: bool, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    heads = [rng.integers(3, MODEL["vocab_size"], PREFIX).tolist() for _ in range(TENANTS)]
    order = [(t, i) for i in range(PER_TENANT) for t in range(TENANTS)]
    if not interleaved:
        order.sort()
    return [
        {
            "tenant": t,
            "prompt_token_ids": heads[t] + rng.integers(3, 4096, rng.integers(16, 65)).tolist(),
            "max_tokens": 8,
            "ignore_eos": True,
            "temperature": 0.0,  # greedy (a row's default temperature is vLLM's, 1.0)
        }
        for t, _ in order
    ]


def ideal_prefill(rows: list[dict[str, Any]]) -> int:
    return TENANTS * PREFIX + sum(len(r["prompt_token_ids"]) - PREFIX for r in rows)


def summarize(prompt: list[int], cached: list[int], wall: float) -> dict[str, Any]:
    computed = sum(prompt) - sum(cached)
    return {
        "prefill_tokens_computed": computed,
        "cached_tokens": sum(cached),
        "cache_hit_rate": sum(cached) / sum(prompt),
        "wall_s": wall,
    }


def run_local(ckpt: Path, rows: list[dict[str, Any]]) -> tuple[dict[str, Any], list[list[int]]]:
    t0 = time.perf_counter()
    with LLM(model=ckpt, overrides=["graphs.backend=eager", *ENGINE]) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([r["prompt_token_ids"] for r in rows], params, use_tqdm=False)
        stats = llm.stats()
    result = summarize(
        [len(o.prompt_token_ids) for o in outs],
        [o.num_cached_tokens for o in outs],
        time.perf_counter() - t0,
    )
    result["engine_stats_prefill_tokens_computed"] = stats["prefill_tokens_computed"]
    return result, [o.outputs[0].token_ids for o in outs]


def run_ray(
    ckpt: Path, rows: list[dict[str, Any]], affinity: bool
) -> tuple[dict[str, Any], list[list[int]]]:
    import ray.data

    from hyloop.recipes.ray_batch import generate_dataset

    overrides = ["graphs.backend=eager", *ENGINE, *RAY, f"ray.prefix_affinity={affinity}"]
    t0 = time.perf_counter()
    ds = ray.data.from_items(rows)
    out = generate_dataset(ds, {"model": {"path": str(ckpt)}}, overrides, REPLICAS).take_all()
    wall = time.perf_counter() - t0
    result = summarize(
        [int(r["num_prompt_tokens"]) for r in out], [int(r["num_cached_tokens"]) for r in out], wall
    )
    return result, [list(map(int, r["token_ids"])) for r in out]


def replica_rows(rows: list[dict[str, Any]]) -> list[int]:
    """Rows per replica under prefix affinity (the plan the recipe makes from the same keys)."""
    from hyloop.recipes.prefix_shards import key_block, plan_shards, prefix_key

    block = key_block(128, 16)
    keys = np.array([prefix_key(r["prompt_token_ids"], block, 16) for r in rows])
    return list(plan_shards(keys, REPLICAS, 1.25).sizes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    import ray

    ray.init(
        num_cpus=REPLICAS,
        include_dashboard=False,
        object_store_memory=512 * 2**20,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
        log_to_driver=False,
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    results: dict[str, Any] = {
        "cpu": cpu_name(),
        "tenants": TENANTS,
        "requests_per_tenant": PER_TENANT,
        "prefix_tokens": PREFIX,
        "replicas": REPLICAS,
        "model": "tiny random Llama (hidden 256, 8 layers, vocab 4096)",
        "arrivals": {},
    }
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        conftest = test_helpers()
        ckpt = conftest.build_hf_checkpoint(Path(tmp) / "llama", MODEL)
        for arrival in ("grouped", "interleaved"):
            rows = workload(interleaved=arrival == "interleaved")
            ideal = ideal_prefill(rows)
            local, want = run_local(ckpt, rows)
            affinity, got_a = run_ray(ckpt, rows, affinity=True)
            default, got_d = run_ray(ckpt, rows, affinity=False)
            modes = {"prefix affinity": affinity, "ray default split": default, "local": local}
            for r in modes.values():
                r["vs_ideal"] = r["prefill_tokens_computed"] / ideal
            results["arrivals"][arrival] = {
                "ideal_prefill_tokens": ideal,
                "replica_rows_prefix_affinity": replica_rows(rows),
                "same_tokens_as_local": {
                    "prefix affinity": got_a == want,
                    "default": got_d == want,
                },
                **modes,
            }
            for name, r in modes.items():
                lines.append(
                    f"{arrival:11} {name:17} {r['prefill_tokens_computed']:>9} "
                    f"{r['vs_ideal']:>8.3f} {r['cache_hit_rate']:>8.1%} {r['wall_s']:>8.2f}"
                )
    print(f"CPU: {results['cpu']}; torch {torch.__version__}; {results['model']}")
    print(
        f"{TENANTS} tenants x {PER_TENANT} requests, {PREFIX}-token tenant prefix, "
        f"{REPLICAS} replicas"
    )
    print(f"{'arrival':11} {'mode':17} {'prefill':>9} {'/ideal':>8} {'hit':>8} {'wall s':>8}")
    print("\n".join(lines))
    for arrival, r in results["arrivals"].items():
        print(
            f"{arrival}: ideal {r['ideal_prefill_tokens']} tokens; rows per replica (affinity) "
            f"{r['replica_rows_prefix_affinity']}; same tokens as local {r['same_tokens_as_local']}"
        )
    write_json(results, args.json)
    ray.shutdown()


if __name__ == "__main__":
    main()
