"""``hyloop warmup``: compile (or capture) the artifacts a config will use, before a job needs them.

Every (batch bucket, ``kv_len`` bucket) that contexts of up to ``--kv-len`` tokens use is
captured with the config's captured backend (``auto``: compile on CPU, cuda_graph on CUDA),
which fills inductor's on-disk cache under ``$HYLOOP_CACHE_DIR``; each artifact's replay and the
eager step are timed on it, and one artifact is captured a second time with Dynamo reset, as a
new process would find it. All of it goes into this machine's step history, so
``graphs.backend=auto`` later plans from measured step times and warm capture costs rather than
from defaults.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from tqdm import tqdm

from hyloop.framework.config import load_config
from hyloop.framework.llm import LLM
from hyloop.framework.model_runner import resolve_backend
from hyloop.graphs.buckets import ArtifactKey


def warmup(
    model: str | None, config: Any, kv_len: int, progress: bool = True
) -> list[dict[str, Any]]:
    """Capture and time every key up to ``kv_len``; rows of the table ``hyloop warmup`` prints."""
    backend = resolve_backend(config.graphs.backend, torch.device(config.device))
    if backend == "eager":
        raise ValueError("graphs.backend=eager: nothing to warm up (auto, compile or cuda_graph)")
    rows: list[dict[str, Any]] = []
    with LLM(model=model, config=config, overrides=[f"graphs.backend={backend}"]) as llm:
        runner = llm.engine.runner
        graphs, history = runner.graph_runner, runner.history
        assert graphs is not None and history is not None
        top = graphs.kv_bucket(kv_len) or graphs.kv_len_buckets[-1]  # contexts up to kv_len
        kv_buckets = [k for k in graphs.kv_len_buckets if k <= top]
        keys = [ArtifactKey(b, kv) for kv in kv_buckets for b in graphs.buckets]
        if runner.before_capture is not None:
            runner.before_capture(keys)
        bar = tqdm(keys, desc=f"warmup ({backend})", unit="artifact", disable=not progress)
        for key in bar:
            bar.set_postfix_str(f"batch {key.batch} kv_len {key.kv_len}")
            t0 = time.perf_counter()
            replays, eager = graphs.time_key(key)
            capture = graphs.capture_times.get(key, time.perf_counter() - t0)
            history.record_capture(backend, (key.batch, key.kv_len), capture)
            for t in replays:
                history.record_step(backend, key.batch, t)
            for t in eager:
                history.record_step("eager", key.batch, t)
            rows.append(
                {
                    "batch": key.batch,
                    "kv_len": key.kv_len,
                    "capture_s": round(capture, 2),
                    "captured_ms": round(1e3 * statistics.median(replays), 3),
                    "eager_ms": round(1e3 * statistics.median(eager), 3),
                }
            )
        # What a later process pays for an artifact now in inductor's cache.
        again = graphs.recapture(keys[0])
        history.record_capture(backend, (keys[0].batch, keys[0].kv_len), again)
        rows[0]["warm_capture_s"] = round(again, 2)
        history.save()
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
