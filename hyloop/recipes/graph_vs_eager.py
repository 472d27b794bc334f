"""Graph-vs-eager regression: does the captured decode step compute exactly what eager computes?

``hyloop regress`` (config: ``hyloop/configs/recipes/graph_vs_eager.yaml`` unless ``--config``)
runs the captured engine as configured and an eager oracle over the same waves: for every batch
size N (by default one below, on and one above each bucket edge) and sampling mode (greedy, then
each seed), N seeded random prompts are added at once and stepped until done, so the decode batch
really is N. Exit 0 when every token matches and the captured engine replayed its artifacts; 1 on
a mismatch, a silent fallback to eager or a recompile; bad input raises ``ValueError`` (exit 2).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from tqdm.auto import tqdm

from hyloop.api.llm import LLM
from hyloop.framework.config import (
    CONFIG_DIR,
    ConfigError,
    EngineConfig,
    merge_config,
    validate_config,
)
from hyloop.framework.sampling_params import SamplingParams
from hyloop.graphs.capture import pick_bucket, resolve_backend, usable_buckets
from hyloop.recipes.offline import default_checkpoint

Perturb = Callable[[LLM], None]
Outputs = tuple[list[list[int]], list[list[torch.Tensor]]]  # tokens and per-token logits
COUNTERS = ("graph_replays", "eager_fallbacks", "recompiles")


class RegressSettings(BaseModel):
    """The ``regress:`` section of the recipe YAML (stripped before the engine config is read)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    checkpoint: str | None = Field(None, description="model to test; --model wins; null: default")
    batch_sizes: list[int] | None = Field(None, description="waves; null: b-1, b, b+1 per bucket")
    prompt_len: tuple[int, int] = Field((4, 32), description="prompt lengths, inclusive range")
    max_tokens: int = Field(8, ge=2, description="tokens per request (>= 2: one decode step)")
    greedy: bool = Field(True, description="run a greedy wave per batch size")
    seeds: list[int] = Field(default_factory=lambda: [0], description="seeded sampling waves")
    temperature: float = Field(0.8, gt=0.0, description="temperature of the seeded waves")
    prompt_seed: int = Field(0, description="seed of the prompt generator")
    logit_atol: float | None = Field(None, ge=0.0, description="fail above this |logit diff|")

    @model_validator(mode="after")
    def _check(self) -> RegressSettings:
        lo, hi = self.prompt_len
        if not 1 <= lo <= hi:
            raise ValueError(f"prompt_len must be [min, max] with 1 <= min <= max, got {[lo, hi]}")
        if self.batch_sizes is not None and (not self.batch_sizes or min(self.batch_sizes) < 1):
            raise ValueError(f"batch_sizes must be null or ints >= 1, got {self.batch_sizes}")
        if not self.greedy and not self.seeds:
            raise ValueError("nothing to run: greedy is false and seeds is empty")
        return self


def load_recipe(
    files: list[str | Path], overrides: list[str] | None = None
) -> tuple[EngineConfig, RegressSettings]:
    """Merge the YAML files and ``key=value`` overrides; split off and validate ``regress:``."""
    # The engine's own composition, so presets compose the same way for generate and regress.
    data = merge_config(files, overrides)
    section = data.pop("regress", None) or {}
    try:
        settings = RegressSettings.model_validate(section)
    except ValidationError as e:
        msgs = [
            f"regress.{'.'.join(str(p) for p in err['loc']) or '<section>'}: "
            f"got {err.get('input')!r}; {err['msg']}"
            for err in e.errors()
        ]
        raise ConfigError("invalid regress section:\n  " + "\n  ".join(msgs)) from None
    return validate_config(data), settings


def batch_sizes(settings: RegressSettings, buckets: list[int]) -> list[int]:
    """The wave sizes: explicit, or below, on and above every bucket edge."""
    if settings.batch_sizes is not None:
        return sorted(set(settings.batch_sizes))
    return sorted({n for b in buckets for n in (b - 1, b, b + 1) if n >= 1})


def make_prompts(seed: int, n: int, lengths: tuple[int, int], vocab: int | list[int]) -> list[Any]:
    """``n`` random prompts of token ids below ``vocab``, or (channel vocabularies) of rows
    ``[C]``, one id per channel."""
    rng = random.Random(seed)

    def token() -> Any:
        return rng.randrange(vocab) if isinstance(vocab, int) else [rng.randrange(v) for v in vocab]

    return [[token() for _ in range(rng.randint(*lengths))] for _ in range(n)]


def run_wave(
    llm: LLM, tag: str, prompts: list[Any], params: list[SamplingParams]
) -> tuple[list[list[int]], list[list[torch.Tensor]], dict[str, int]]:
    """Add every request at once, step until done; tokens, per-token logits, counter deltas."""
    engine = llm.engine
    before = engine.stats()
    reqs = []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{tag}-{i}", prompt, p)
        req = engine.request(f"{tag}-{i}")  # the object stays valid after it finishes
        assert req is not None
        reqs.append(req)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in (*COUNTERS, "decode_steps", "decode_tokens")}
    tokens = [done[r.request_id] for r in reqs]
    logits = [list(r.logits or [])[: len(t)] for r, t in zip(reqs, tokens, strict=True)]
    return tokens, logits, delta


def compare(ids: list[str], ref: Outputs, got: Outputs) -> dict[str, Any]:
    """Exact tokens per request; logits compared up to and including the first divergence
    (past it the two runs decode different contexts)."""
    exact, max_diff, first = 0, 0.0, None
    for rid, t_ref, t_got, l_ref, l_got in zip(ids, ref[0], got[0], ref[1], got[1], strict=True):
        pos = next((i for i, (a, b) in enumerate(zip(t_ref, t_got, strict=False)) if a != b), None)
        if pos is None and len(t_ref) != len(t_got):
            pos = min(len(t_ref), len(t_got))
        exact += pos is None
        upto = len(t_ref) if pos is None else pos + 1
        for a, b in list(zip(l_ref, l_got, strict=False))[:upto]:
            max_diff = max(max_diff, float((a.float() - b.float()).abs().max()))
        if pos is not None and (first is None or pos < first["position"]):
            ea = t_ref[pos] if pos < len(t_ref) else None
            ca = t_got[pos] if pos < len(t_got) else None
            first = {"request": rid, "position": pos, "eager": ea, "captured": ca}
    return {"requests": len(ids), "exact": exact, "max_logit_diff": max_diff, "first": first}


def _modes(settings: RegressSettings) -> list[tuple[str, float, int | None]]:
    greedy = [("greedy", 0.0, None)] if settings.greedy else []
    return greedy + [(f"seed={s}", settings.temperature, s) for s in settings.seeds]


def _run_all(
    llm: LLM, settings: RegressSettings, sizes: list[int], label: str
) -> list[dict[str, Any]]:
    llm.engine.capture_logits = True
    modes = _modes(settings)
    bar = tqdm(total=len(modes) * len(sizes), desc=f"{label} waves", disable=None, leave=False)
    runs = []
    for m, (mode, temp, seed) in enumerate(modes):
        for n in sizes:
            wave_seed = settings.prompt_seed * 1_000_003 + n * 101 + m
            d = llm.engine.derived  # multi-channel rows: their tokens are row keys
            vocab = list(d.channel_vocab_sizes) if d.row_channels else llm.engine.vocab_size
            prompts = make_prompts(wave_seed, n, settings.prompt_len, vocab)
            # ignore_eos keeps every request alive to max_tokens, so the decode batch stays N.
            fixed = {"temperature": temp, "max_tokens": settings.max_tokens, "ignore_eos": True}
            seeds = [None if seed is None else seed * 100_003 + i for i in range(n)]
            params = [SamplingParams(**fixed, seed=s) for s in seeds]
            tag = f"{mode}-b{n}"
            tokens, logits, delta = run_wave(llm, tag, prompts, params)
            ids = [f"{tag}-{i}" for i in range(n)]
            runs.append({"mode": mode, "ids": ids, "out": (tokens, logits), "delta": delta})
            bar.update(1)
    bar.close()
    return runs


def regress(
    cfg: EngineConfig, settings: RegressSettings, model: str | Path, perturb: Perturb | None = None
) -> dict[str, Any]:
    """Run the eager oracle and the captured engine over the same waves; the report as a dict.
    ``perturb`` is a test hook: it alters the captured ``LLM`` to prove a wrong step is caught."""
    backend = resolve_backend(cfg.graphs.backend, torch.device(cfg.device))
    if backend == "eager":
        raise ValueError(
            "graphs.backend: got 'eager'; the captured run needs auto, compile or cuda_graph"
        )
    with LLM(model=model, config=cfg, overrides=["graphs.backend=eager"]) as oracle:
        max_running = oracle.engine.derived.max_running
        buckets = usable_buckets(cfg.graphs.buckets, max_running)
        sizes = batch_sizes(settings, buckets)
        if sizes[-1] > max_running:
            raise ValueError(
                f"regress.batch_sizes: wave of {sizes[-1]} requests exceeds "
                f"scheduler.max_running_requests={max_running}; the decode batch could not be N"
            )
        if settings.prompt_len[1] + settings.max_tokens > oracle.engine.max_context:
            # A clipped request would finish early and shrink its wave's decode batch.
            raise ValueError(
                f"regress.prompt_len / max_tokens: prompts up to {settings.prompt_len[1]} plus "
                f"{settings.max_tokens} tokens exceed model.max_context={oracle.engine.max_context}"
            )
        ref = _run_all(oracle, settings, sizes, "eager")
    # ``auto`` would capture only what a job pays for: the recipe checks the captured step.
    with LLM(model=model, config=cfg, overrides=[f"graphs.backend={backend}"]) as captured:
        if perturb is not None:
            perturb(captured)
        got = _run_all(captured, settings, sizes, backend)
        graph_report = captured.graphs.report()
    waves = []
    for r, g in zip(ref, got, strict=True):
        n, delta = len(r["ids"]), g["delta"]
        b = pick_bucket(buckets, n)
        wave = {
            "batch": n,
            "mode": r["mode"],
            "bucket": str(b) if b is not None else f">{buckets[-1]}",
            **compare(r["ids"], r["out"], g["out"]),
            **{k: delta[k] for k in COUNTERS},
            "decode_batch": delta["decode_tokens"] / max(1, delta["decode_steps"]),
        }
        waves.append(wave)
    report: dict[str, Any] = {
        "model": str(model),
        "backend": backend,
        "device": cfg.device,
        "dtype": cfg.dtype,
        "page_size": cfg.kv_pool.page_size,
        "buckets": buckets,
        "batch_sizes": sizes,
        "modes": [m for m, _, _ in _modes(settings)],
        "max_tokens": settings.max_tokens,
        "waves": waves,
        "per_bucket": _per_bucket(waves),
        "graph_report": graph_report,
    }
    report["failures"] = _failures(waves, settings)
    report["passed"] = not report["failures"]
    return report


def _per_bucket(waves: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for w in waves:
        row = rows.setdefault(
            w["bucket"],
            {"bucket": w["bucket"], "batch_sizes": [], "requests": 0, "exact": 0,
             "max_logit_diff": 0.0, "first_divergence": None, **dict.fromkeys(COUNTERS, 0)},
        )  # fmt: skip
        if w["batch"] not in row["batch_sizes"]:
            row["batch_sizes"].append(w["batch"])
        for k in ("requests", "exact", *COUNTERS):
            row[k] += w[k]
        row["max_logit_diff"] = max(row["max_logit_diff"], w["max_logit_diff"])
        first, seen = w["first"], row["first_divergence"]
        if first is not None and (seen is None or first["position"] < seen["position"]):
            row["first_divergence"] = first
    for row in rows.values():
        row["exact_match_rate"] = row["exact"] / row["requests"]
    return list(rows.values())


def _failures(waves: list[dict[str, Any]], settings: RegressSettings) -> list[str]:
    out = []
    for w in waves:
        where = f"bucket {w['bucket']}, batch {w['batch']}, {w['mode']}"
        if (f := w["first"]) is not None:
            out.append(
                f"{where}: {w['requests'] - w['exact']}/{w['requests']} requests differ; first "
                f"at {f['request']} position {f['position']} (eager {f['eager']}, "
                f"captured {f['captured']})"
            )
        if settings.logit_atol is not None and w["max_logit_diff"] > settings.logit_atol:
            out.append(
                f"{where}: max |logit diff| {w['max_logit_diff']:.3g} > {settings.logit_atol}"
            )
        if w["decode_batch"] != w["batch"]:
            out.append(f"{where}: decode batch was {w['decode_batch']:.2f}, not {w['batch']}")
    totals = {k: sum(w[k] for w in waves) for k in COUNTERS}
    if totals["eager_fallbacks"]:
        out.append(f"captured engine fell back to eager {totals['eager_fallbacks']} times")
    if not totals["graph_replays"]:
        out.append("captured engine replayed no captured artifact (graph_replays == 0)")
    if totals["recompiles"]:
        out.append(f"captured engine recompiled {totals['recompiles']} times after warm-up")
    return out


def render_report(report: dict[str, Any]) -> str:
    head = (
        f"graph vs eager: {report['model']}\n"
        f"backend {report['backend']} on {report['device']}/{report['dtype']}    page_size "
        f"{report['page_size']}    buckets {report['buckets']}    modes {report['modes']}"
    )
    cols = f"{'bucket':>7} {'batches':>9} {'reqs':>5} {'exact':>7} {'max|dlogit|':>11} "
    cols += f"{'replays':>8} {'fallbacks':>9}  first divergence"
    lines = [head, cols]
    for r in report["per_bucket"]:
        f = r["first_divergence"]
        div = "-" if f is None else f"{f['request']} @ {f['position']}"
        lines.append(
            f"{r['bucket']:>7} {','.join(map(str, r['batch_sizes'])):>9} {r['requests']:>5} "
            f"{100 * r['exact_match_rate']:>6.1f}% {r['max_logit_diff']:>11.2e} "
            f"{r['graph_replays']:>8} {r['eager_fallbacks']:>9}  {div}"
        )
    verdict = "PASS" if report["passed"] else "FAIL\n  " + "\n  ".join(report["failures"])
    return "\n".join([*lines, verdict])


def run_regress(args: argparse.Namespace, perturb: Perturb | None = None) -> int:
    """The ``hyloop regress`` command: 0 pass, 1 mismatch or silent fallback."""
    files = list(args.config) or [CONFIG_DIR / "recipes/graph_vs_eager.yaml"]
    cfg, settings = load_recipe(files, args.overrides)
    model = args.model or settings.checkpoint or cfg.model.path or default_checkpoint()
    report = regress(cfg, settings, model, perturb)
    print(render_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0 if report["passed"] else 1
