"""Quantized panel GEMMs at a decode step's row counts, with the weights in memory and in cache.

SmolLM2-135M's Linears as ``model.weights=auto`` packs the shipped Q4_1 file: per layer an int4
qkv (960 x 576), o (576 x 576), fused gate/up (3072 x 576) and down (576 x 1536), random codes
with fp16 scales and minimums; and the Q8_0 head as int8 (49152 x 576). For each row count,
``hyloop::panel_linear`` on float32 rows over:

- **cold**: all 30 layers' int4 weights in turn (66 MB, past the caches: a decode step's case),
  and the head, one of three copies in turn;
- **hot**: the first layer's weights 30 times (2.2 MB, in cache), and a sixteenth of the head's
  rows 16 times: the tiles' arithmetic alone.

Each figure is the least of ``--reps`` rounds, the row counts interleaved within a round (the
machine's speed moves over minutes), on the threads torch runs (2 here).

    python bench/panel_gemm.py [--rows 1,2,3,4,5,8,9,16,40] [--reps 15] [--json F]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # run from a checkout

importlib.import_module("hyloop")  # before torch: OpenMP's passive waits

import torch  # noqa: E402
from common import machine_record, parse_batches, write_json  # noqa: E402

from hyloop.models.cpu import cpu_ops  # noqa: E402
from hyloop.models.cpu.panels import I4, Panels  # noqa: E402
from hyloop.models.quant.formats import Int8Rows  # noqa: E402

LAYERS = 30
SHAPES = [(960, 576, 0), (576, 576, 0), (3072, 576, 1536), (576, 1536, 0)]  # n, k, split
HEAD = (49152, 576)


def int4_panels(n: int, k: int, split: int, g: torch.Generator) -> Panels:
    """Random int4 codes with fp16-exact scales and minimums, as the shipped file's layers."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    mins = (-torch.rand(n, k // 32, generator=g) * 0.05).half().float()
    data = torch.ops.hyloop.pack_panels_i4(codes, scale, mins, split, True)
    return Panels(data, I4, n, k, split, True)


def int8_panels(n: int, k: int, g: torch.Generator) -> Panels:
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    return Panels.int8(Int8Rows(codes, torch.rand(n, k // 32, generator=g)))


def timed(weights: list[Panels], rows: int) -> float:
    """Seconds for ``weights`` one after another on ``rows`` random rows."""
    xs = {w.k: torch.randn(rows, w.k) for w in weights}
    t = time.perf_counter()
    for w in weights:
        w.linear(xs[w.k])
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,5,8,9,16,40")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    counts = parse_batches(parser, args.rows)
    if not cpu_ops.ensure_loaded():
        sys.exit("panel_gemm: hyloop's CPU kernels are not available on this machine")
    g = torch.Generator().manual_seed(0)
    layers = [int4_panels(n, k, s, g) for _ in range(LAYERS) for n, k, s in SHAPES]
    heads = [int8_panels(*HEAD, g) for _ in range(3)]
    head_part = int8_panels(HEAD[0] // 16, HEAD[1], g)
    cases = {
        "int4 cold": lambda m: timed(layers, m),
        "int4 hot": lambda m: timed(layers[: len(SHAPES)] * LAYERS, m),
        "int8 head cold": lambda m: min(timed([h], m) for h in heads),
        "int8 head hot": lambda m: timed([head_part] * 16, m),
    }
    best = {(c, m): float("inf") for c in cases for m in counts}
    for _ in range(args.reps):
        for m in counts:
            for c, run in cases.items():
                best[c, m] = min(best[c, m], run(m))
    machine = machine_record()
    mb = sum(w.nbytes for w in layers) / 1e6
    print(f"CPU: {machine['cpu_model']}, {machine['cpus']} cpus, {torch.get_num_threads()} threads")
    print(
        f"int4: {LAYERS} layers, {mb:.0f} MB; int8 head {HEAD[0]} x {HEAD[1]}; "
        f"ms, least of {args.reps}"
    )
    print("| rows | int4 cold | int4 hot | int4 hot per row | head cold | head hot |")
    print("|---:|---:|---:|---:|---:|---:|")
    table = []
    for m in counts:
        ms = {c: 1e3 * best[c, m] for c in cases}
        table.append({"rows": m, **{c.replace(" ", "_") + "_ms": v for c, v in ms.items()}})
        print(
            f"| {m} | {ms['int4 cold']:.2f} | {ms['int4 hot']:.2f} | {ms['int4 hot'] / m:.2f} | "
            f"{ms['int8 head cold']:.2f} | {ms['int8 head hot']:.2f} |"
        )
    write_json({"bench": "panel_gemm", "args": vars(args), "rows": table}, args.json)


if __name__ == "__main__":
    main()
