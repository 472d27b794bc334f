"""TTS frames: frames/s through ``TTSEngine.generate()``, eager vs captured, time to first chunk.

A scaled-down MOSS-TTS-Local shape (random weights, built in a temp dir): a Qwen3 backbone of
hidden 512 x 8 layers, 12 codebooks x 1024 codes, 1 local layer. Per batch: a warm-up wave on
each backend captures the bucket (``--backend``: compile on CPU, cuda_graph with ``--device
cuda``), then ``--repeats`` timed waves of ``--frames`` frames per request alternate between the
two engines (both alive; each backend keeps its best wave, so one noisy moment on a shared
machine does not decide the ratio), stop ignored, default sampling (audio temperature 1.7, top-k
25, top-p 0.8). frames/s counts every frame of the wave over its wall time (prefill included);
``decode fps`` is the engine's decode counters. The real-time factor is wall time over audio time
for one stream of a 12.5 Hz codec at that batch (below 1: faster than real time). Time to first
chunk: from ``add_request`` to the first chunk of a probe request (``initial_chunk_frames`` 1 and
5), alone and while 16 other requests stream. Streams (``--streams``): 1, 8 and 16 asyncio
consumers of ``stream(request_id)`` at once, the loop's frames/s with and without a codec stage
(``ToneCodec``, 48 kHz, on its own thread), and each request's time to first audio and
real-time factor (median and worst) from its ``TTSMetrics``.

    python bench/tts_frames.py --json PATH [--quick] [--batches 1,8,32] [--frames 48] [--repeats 3]
        [--device cuda --backend cuda_graph] [--dtype bfloat16] [--kv-len-bucket 128]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

# hyloop before torch: it sets OpenMP's passive wait policy as torch loads (``omp_policy``), the
# setting users get; spinning waits would charge the codec thread's core time to the loop.
from hyloop.tts import ToneCodec, TTSEngine, TTSParams  # noqa: E402, I001

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import cpu_name, parse_batches, test_helpers, write_json  # noqa: E402


CODEC_HZ = 12.5
PROMPT_ROWS = 32


def build_checkpoint(root: Path) -> Path:
    helpers = test_helpers()
    cfg = helpers.tiny_moss_local_config(n_vq=12, audio_vocab=1024, local_layers=1)
    lang = dict(
        cfg["language_config"],
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        initializer_range=0.02,
    )
    cfg.update(language_config=lang, hidden_size=512, vocab_size_list=[4096] + [1025] * 12)
    cfg["gpt2_config"] = dict(cfg["gpt2_config"], n_head=8, n_inner=1536)
    tensors = helpers.moss_local_tensors(cfg, seed=0)
    return helpers.write_moss_local_checkpoint(
        root / "moss-local-512x8", cfg, tensors, tokenizer=False
    )


def prompts(batch: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batch):
        rows = rng.integers(0, 1024, (PROMPT_ROWS, 13))
        rows[:, 0] = 250  # the audio slot id: a voice reference
        out.append(rows)
    return out


def warm_up(tts: TTSEngine, batch: int, seed: int) -> None:
    """A short wave of ``batch`` requests: captures the bucket (kept out of the timed waves)."""
    warm = TTSParams(max_frames=4, ignore_stop=True, seed=seed)
    tts.generate(prompts(batch, seed), warm, use_tqdm=False)


def time_wave(tts: TTSEngine, batch: int, frames: int, seed: int) -> dict[str, float]:
    params = TTSParams(max_frames=frames, ignore_stop=True, seed=seed)
    gc.collect()
    s0 = dict(tts.stats())
    t0 = time.perf_counter()
    outs = tts.generate(prompts(batch, seed + 1), params, use_tqdm=False)
    wall = time.perf_counter() - t0
    s1 = tts.stats()
    assert all(len(o.rows) == frames for o in outs)
    decode = (s1["decode_tokens"] - s0["decode_tokens"]) / (s1["decode_time"] - s0["decode_time"])
    fps = batch * frames / wall
    # One stream gets fps / batch frames a second and needs CODEC_HZ for real time.
    return {"fps": fps, "decode_fps": decode, "rtf": CODEC_HZ * batch / fps}


def first_chunk(tts: TTSEngine, initial: int, load: int, seed: int) -> float:
    """Seconds from ``add_request`` to the probe's first chunk, with ``load`` others running."""
    ids = [
        tts.add_request(rows, TTSParams(max_frames=10_000, ignore_stop=True, seed=i))
        for i, rows in enumerate(prompts(load, seed))
    ]
    chunks = tts.stream()
    if load:  # let the load reach steady decoding
        for _ in range(3 * load):
            next(chunks, None)
    params = TTSParams(max_frames=64, ignore_stop=True, seed=seed, initial_chunk_frames=initial)
    t0 = time.perf_counter()
    rid = tts.add_request(prompts(1, seed + 99)[0], params)
    waited = None
    for chunk in chunks:
        if chunk.request_id == rid and waited is None:
            waited = time.perf_counter() - t0
            for other in [*ids, rid]:
                tts.abort(other)
    assert waited is not None
    return waited


def stream_wave(tts: TTSEngine, n: int, frames: int, seed: int) -> dict[str, float]:
    """``n`` concurrent asyncio consumers, one per request (``tts.stream(rid)``): the loop's
    frames/s over the wave, and the requests' time to first audio and real-time factor."""
    params = TTSParams(max_frames=frames, ignore_stop=True, seed=seed, chunk_frames=5)

    async def consume(rid: str) -> Any:
        last = None
        async for chunk in tts.stream(rid):
            last = chunk
        return last

    async def wave() -> list[Any]:
        ids = [tts.add_request(rows, params) for rows in prompts(n, seed)]
        return await asyncio.gather(*(consume(rid) for rid in ids))

    gc.collect()
    t0 = time.perf_counter()
    finals = asyncio.run(wave())
    wall = time.perf_counter() - t0
    ms = [f.metrics for f in finals]
    assert all(m.num_frames == frames for m in ms)
    ttfa = [m.time_to_first_audio_s for m in ms]
    rtf = [m.rtf for m in ms]
    return {
        "fps": n * frames / wall,
        "ttfa_ms": 1e3 * float(np.median(ttfa)),
        "ttfa_max_ms": 1e3 * max(ttfa),
        "rtf": float(np.median(rtf)),
        "rtf_max": max(rtf),
    }


def bench_streams(args: argparse.Namespace, engines: dict[str, TTSEngine]) -> list[dict[str, Any]]:
    """Per-request streams at each concurrency, each backend with and without the codec stage
    (``ToneCodec``, 48 kHz); the best of ``--repeats`` waves (by frames/s) per cell."""
    rows = []
    codec = ToneCodec()
    for n in args.streams:
        for backend, tts in engines.items():
            warm_up(tts, n, seed=n)
            best: dict[str, dict[str, float]] = {}
            for rep in range(args.repeats):
                for name, c in (("none", None), ("tone", codec)):
                    tts.set_codec(c)
                    r = stream_wave(tts, n, args.frames, seed=10 * n + rep)
                    if name not in best or r["fps"] > best[name]["fps"]:
                        best[name] = r
            tts.set_codec(None)
            for name, r in best.items():
                rows.append({"backend": backend, "streams": n, "codec": name, **r})
                print(f"{backend:>8} {n:>3} streams, codec {name}: {r['fps']:8.1f} frames/s, "
                      f"first audio {r['ttfa_ms']:.0f} ms (max {r['ttfa_max_ms']:.0f}), "
                      f"rtf {r['rtf']:.3f}")  # fmt: skip
    return rows


def print_streams(rows: list[dict[str, Any]], where: str) -> None:
    print(f"\nTTS streams on {where} (asyncio consumers, one loop thread, ToneCodec 48 kHz)")
    print(f"{'backend':>8} {'streams':>7} {'fps no codec':>12} {'fps codec':>10} {'cost':>6} "
          f"{'first audio ms':>14} {'max ms':>7} {'rtf':>6} {'rtf max':>7}")  # fmt: skip
    for r in rows:
        if r["codec"] != "tone":
            continue
        plain = next(
            x for x in rows
            if (x["backend"], x["streams"], x["codec"]) == (r["backend"], r["streams"], "none")
        )  # fmt: skip
        cost = 1.0 - r["fps"] / plain["fps"]
        print(f"{r['backend']:>8} {r['streams']:>7} {plain['fps']:>12.1f} {r['fps']:>10.1f} "
              f"{cost:>6.1%} {r['ttfa_ms']:>14.0f} {r['ttfa_max_ms']:>7.0f} {r['rtf']:>6.3f} "
              f"{r['rtf_max']:>7.3f}")  # fmt: skip


def bench(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(os.cpu_count() or 1)
    cpu = cpu_name()
    captured = args.backend
    gpu = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None
    print(f"CPU: {cpu} ({torch.get_num_threads()} threads)" + (f", GPU: {gpu}" if gpu else ""))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        ckpt = build_checkpoint(Path(tmp))
        engines = {}
        for backend in ("eager", captured):
            overrides = [
                f"device={args.device}",
                f"graphs.backend={backend}",
                f"graphs.buckets=[{','.join(map(str, sorted({*args.batches, *args.streams})))}]",
                f"scheduler.max_running_requests={max(*args.batches, *args.streams, 17)}",
                "kv_pool.page_size=16",
                "model.max_context=1024",
                "lookahead.enable=false",
                f"dtype={args.dtype}",
                f"graphs.kv_len_bucket={args.kv_len_bucket}",
                "model.cpu_ops=true",  # hyloop's CPU kernels built now if this machine lacks them
            ]
            engines[backend] = stack.enter_context(TTSEngine(ckpt, overrides=overrides))
        for batch in args.batches:
            for tts in engines.values():
                warm_up(tts, batch, seed=batch)
            best: dict[str, dict[str, float]] = {}
            for rep in range(args.repeats):
                for backend, tts in engines.items():
                    r = time_wave(tts, batch, args.frames, seed=batch + 1 + rep)
                    if backend not in best or r["fps"] > best[backend]["fps"]:
                        best[backend] = r
            for backend in engines:
                rows.append({"backend": backend, "batch": batch, **best[backend]})
                print_row(rows[-1])
        stream_rows = bench_streams(args, engines) if args.streams else []
        if not args.quick:
            for backend, tts in engines.items():
                for load in (0, 16):
                    for initial in (1, 5):
                        s = first_chunk(tts, initial, load, seed=7)
                        rows.append(
                            {"backend": backend, "ttfc_load": load, "initial": initial, "ttfc_s": s}
                        )
                        print(f"{backend:>8} first chunk of {initial} frame(s), load {load}: "
                              f"{s * 1e3:.0f} ms")  # fmt: skip
    ratio = {}
    for b in args.batches:
        e = next(r for r in rows if r.get("batch") == b and r["backend"] == "eager")
        c = next(r for r in rows if r.get("batch") == b and r["backend"] == captured)
        ratio[b] = c["fps"] / e["fps"]
    where = gpu or cpu
    print(f"\nTTS frames on {where}: eager vs {captured} ({args.dtype}, "
          f"kv_len bucket {args.kv_len_bucket})")  # fmt: skip
    print(f"    batch  eager fps {captured + ' fps':>12}  ratio  rtf eager {'rtf ' + captured:>12}")
    for b in args.batches:
        e = next(r for r in rows if r.get("batch") == b and r["backend"] == "eager")
        c = next(r for r in rows if r.get("batch") == b and r["backend"] == captured)
        print(f"{b:>9} {e['fps']:>10.1f} {c['fps']:>12.1f} {ratio[b]:>6.2f} "
              f"{e['rtf']:>10.3f} {c['rtf']:>12.3f}")  # fmt: skip
    if stream_rows:
        print_streams(stream_rows, where)
    return {"cpu": cpu, "gpu": gpu, "device": args.device, "backend": captured,
            "dtype": args.dtype, "kv_len_bucket": args.kv_len_bucket,
            "threads": torch.get_num_threads(), "frames": args.frames, "rows": rows,
            "streams": stream_rows, "captured_over_eager": ratio}  # fmt: skip


def print_row(r: dict[str, Any]) -> None:
    print(f"{r['backend']:>8} batch {r['batch']:>3}: {r['fps']:8.1f} frames/s "
          f"(decode {r['decode_fps']:.1f}), rtf {r['rtf']:.3f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quick", action="store_true", help="no first-chunk timings")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument(
        "--streams", default="1,8,16", help="concurrent per-request streams ('' to skip)"
    )
    p.add_argument("--frames", type=int, default=48, help="frames per request")
    p.add_argument("--repeats", type=int, default=3, help="timed waves per backend and batch")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--backend", help="the captured backend (default: compile, cuda_graph on CUDA)")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16 (weights and compute)")
    p.add_argument("--kv-len-bucket", type=int, default=256, help="graphs.kv_len_bucket")
    args = p.parse_args(argv)
    args.backend = args.backend or ("cuda_graph" if args.device.startswith("cuda") else "compile")
    args.batches = parse_batches(p, args.batches)
    args.streams = parse_batches(p, args.streams) if args.streams else []
    write_json(bench(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
