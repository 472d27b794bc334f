"""Prefix reuse through the UHRC: prefill work and wall time with the cache on and off.

64 requests share a 512-token prefix plus unique suffixes, on a hybrid (Gated DeltaNet +
attention) model and a dense one, tiny but not trivial (hidden 256, 8 layers), built in a temp
dir with random weights. Prints prefill tokens computed, cached tokens and wall time per mode,
and the on/off ratios; writes JSON.

    python bench/prefix_reuse.py [--json PATH] [--requests 64] [--prefix 512]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# hyloop first: it sets OpenMP's passive waits, which libgomp reads once, when torch loads.
importlib.import_module("hyloop")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from common import SMALL_DENSE, write_json  # noqa: E402
from conftest import build_hf_checkpoint  # noqa: E402

from hyloop import LLM, SamplingParams  # noqa: E402

BASE = SMALL_DENSE
MODELS: dict[str, dict[str, Any]] = {
    "dense (llama)": dict(
        BASE, architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=10000.0
    ),
    "hybrid (qwen3.5)": dict(
        BASE,
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        tie_word_embeddings=True,
    ),
}


def workload(n: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, BASE["vocab_size"], (prefix_len,), generator=g).tolist()
    lens = torch.randint(16, 64, (n,), generator=g).tolist()
    return [prefix + torch.randint(3, BASE["vocab_size"], (m,), generator=g).tolist() for m in lens]


def run(ckpt: Path, prompts: list[list[int]], cache: bool) -> dict[str, Any]:
    overrides = [
        f"cache.enable={cache}",
        "kv_pool.page_size=16",
        "recurrent_pool.track_interval=64",
        "scheduler.prefill_chunk=512",
        "scheduler.max_running_requests=64",
        "kv_pool.num_pages=4096",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model=ckpt, overrides=overrides) as llm:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        llm.engine.check_invariants()
        s = llm.stats()
    return {
        "prefill_tokens_computed": s["prefill_tokens_computed"],
        "cached_tokens": s["cached_tokens"],
        "requests_hit": sum(o.num_cached_tokens > 0 for o in outs),
        "wall_s": wall,
        "prefill_s": s["prefill_time"],
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    prompts = workload(args.requests, args.prefix)
    results: dict[str, Any] = {"requests": args.requests, "prefix": args.prefix, "models": {}}
    header = (
        f"{'model':18} {'cache':5} {'prefill computed':>16} {'cached':>8} {'hit reqs':>8} "
        f"{'wall s':>8}"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in MODELS.items():
            ckpt = build_hf_checkpoint(Path(tmp) / name.split()[0], cfg)
            on, off = run(ckpt, prompts, True), run(ckpt, prompts, False)
            same = on.pop("tokens") == off.pop("tokens")
            ratio = on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
            results["models"][name] = {
                "cache_on": on,
                "cache_off": off,
                "computed_ratio": ratio,
                "wall_ratio": on["wall_s"] / off["wall_s"],
                "same_tokens": same,
            }
            for mode, r in (("on", on), ("off", off)):
                rows.append(
                    f"{name:18} {mode:5} {r['prefill_tokens_computed']:>16} "
                    f"{r['cached_tokens']:>8} {r['requests_hit']:>8} {r['wall_s']:>8.2f}"
                )
            rows.append(
                f"{'':18} {'ratio':5} {ratio:>16.3f} {'':>8} {'':>8} "
                f"{on['wall_s'] / off['wall_s']:>8.3f}   same tokens: {same}"
            )
    print(header)
    print("\n".join(rows))
    write_json(results, args.json)


if __name__ == "__main__":
    main()
