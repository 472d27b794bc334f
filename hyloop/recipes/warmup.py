"""``hyloop warmup``: compile (or capture) the artifacts a config will use, before a job needs them.

Every (batch, ``kv_len``) bucket that contexts of up to ``--kv-len`` tokens use is captured with
the config's backend (``auto``: compile on CPU, cuda_graph on CUDA), filling inductor's on-disk
cache under ``$HYLOOP_CACHE_DIR``. Replays and eager steps are timed, and one artifact is captured
again with Dynamo reset, as a new process would find it; all of it goes into this machine's step
history, so ``graphs.backend=auto`` later plans from measurements rather than defaults.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from tqdm import tqdm

from hyloop.api.llm import LLM
from hyloop.framework.config import load_config
from hyloop.graphs.capture import ArtifactKey, resolve_backend


def warmup(
    model: str | None, config: Any, kv_len: int, progress: bool = True
) -> list[dict[str, Any]]:
    """Capture and time every key up to ``kv_len``; rows of the table ``hyloop warmup`` prints."""
    backend = resolve_backend(config.graphs.backend, torch.device(config.device))
    if backend == "eager":
        raise ValueError("graphs.backend=eager: nothing to warm up (auto, compile or cuda_graph)")
    rows: list[dict[str, Any]] = []
    with LLM(model=model, config=config, overrides=[f"graphs.backend={backend}"]) as llm:
        graphs = llm.graphs
        top = graphs.runner.kv_bucket(kv_len) or graphs.kv_len_buckets[-1]  # contexts up to kv_len
        keys = [
            ArtifactKey(b, kv) for kv in graphs.kv_len_buckets if kv <= top for b in graphs.buckets
        ]
        bar = tqdm(keys, desc=f"warmup ({backend})", unit="artifact", disable=not progress)
        for key in bar:
            bar.set_postfix_str(f"batch {key.batch} kv_len {key.kv_len}")
            replays, eager = graphs.time(key)
            rows.append(
                {
                    "batch": key.batch,
                    "kv_len": key.kv_len,
                    "capture_s": round(graphs.runner.capture_times[key], 2),
                    "captured_ms": round(1e3 * statistics.median(replays), 3),
                    "eager_ms": round(1e3 * statistics.median(eager), 3),
                }
            )
        # What a later process pays for an artifact now in inductor's cache.
        rows[0]["warm_capture_s"] = round(graphs.recapture(keys[0]), 2)
        graphs.job_done()  # keeps the figures in this machine's step history
    return rows


def run_warmup(args: argparse.Namespace) -> int:
    cfg = load_config(args.config or None, args.overrides)
    if args.kv_len < 1:
        raise ValueError(f"--kv-len {args.kv_len}: expected >= 1")
    model = args.model or cfg.model.path
    if model is None:
        from hyloop.recipes.offline import default_checkpoint

        model = str(default_checkpoint())
    t0 = time.perf_counter()
    rows = warmup(model, cfg, args.kv_len, progress=not args.no_progress)
    print(f"{'batch':>5} {'kv_len':>6} {'capture s':>9} {'eager ms':>9} {'captured ms':>11}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['kv_len']:>6} {r['capture_s']:>9.1f} {r['eager_ms']:>9.2f} "
            f"{r['captured_ms']:>11.2f}"
        )
    warm = rows[0].get("warm_capture_s")
    print(
        f"warmed {len(rows)} artifacts in {time.perf_counter() - t0:.1f} s; a later capture of "
        f"one found the on-disk cache warm: {warm:.1f} s"
    )
    return 0
