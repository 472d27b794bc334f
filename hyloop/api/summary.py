"""The one-screen run summary: config in force, buckets, replays, fallbacks, cache, pools."""

from __future__ import annotations

from typing import Any


def render_summary(llm: Any) -> str:
    cfg = llm.config
    s = llm.stats()
    d = llm.engine.derived
    pt, dt = s["prefill_time"], s["decode_time"]
    lines = [
        "── hyloop run summary " + "─" * 40,
        f"model          {cfg.model.path}",
        f"device/dtype   {cfg.device} / {cfg.dtype}    weights {s['weight_bytes'] / 2**20:.1f} MiB",
        f"backend        {s['backend_config']}    buckets {cfg.graphs.buckets}",
        f"graph replays  {s['graph_replays']}    eager fallbacks {s['eager_fallbacks']}    "
        f"recompiles {s['recompiles']}    capture {s['capture_time']:.1f} s "
        "(kept out of the step times)",
        f"kv pool        page_size {cfg.kv_pool.page_size}    pages {d.kv_pages}    "
        f"free {s['kv_free_tokens']}/{s['kv_capacity_tokens']} tokens",
        f"kv in use      full {s['kv_full_tokens_used']} tokens    "
        f"sliding-window {s['kv_swa_tokens_used']} tokens"
        + (f" (window {d.swa_window}, {d.swa_pages} pages)" if d.swa_window else ""),
        f"cache          {'on' if cfg.cache.enable else 'off'} ({d.cache})    "
        f"cached tokens {s['cached_tokens']}    evictable {s['cache_evictable_tokens']}",
        f"pi reuse       {_pi_line(cfg.cache.position_independent, s)}",
        f"lookahead      {'on' if s['lookahead'] else 'off'} (min_batch {cfg.lookahead.min_batch})",
        f"scheduler      max_running {cfg.scheduler.max_running_requests}    "
        f"prefill_chunk {cfg.scheduler.prefill_chunk}    "
        f"budget {cfg.scheduler.prefill_token_budget}",
        f"requests       finished {s['requests_finished']}    aborted {s['requests_aborted']}",
        f"prefill        {s['prefill_tokens_computed']} tokens in {s['prefill_steps']} steps"
        + (f"    {s['prefill_tokens_computed'] / pt:.0f} tok/s" if pt else ""),
        f"decode         {s['decode_tokens']} tokens in {s['decode_steps']} steps"
        + (f"    {s['decode_tokens'] / dt:.1f} tok/s" if dt else ""),
    ]
    if "spec_verify_steps" in s:
        spec = cfg.speculative
        lines.append(
            f"speculative    {spec.method} (k {spec.num_speculative_tokens}, n-grams "
            f"{spec.prompt_lookup_min}..{spec.prompt_lookup_max})    "
            f"{s['spec_verify_steps']} verify steps    accepted {s['spec_accepted_tokens']} of "
            f"{s['spec_draft_tokens']} drafts ({s['spec_acceptance_rate']:.0%})    "
            f"{s['tokens_per_decode_step']:.2f} tokens per decode step"
        )
    if s.get("auto_plan") is not None:
        lines.append(
            f"auto plan      {s['auto_plan']}; captured {s['auto_capture_s']:.1f} s at jobs' "
            f"starts, none after; {s['uncaptured_steps']} steps ran eager"
        )
    lines.append(f"numerics       weights={cfg.model.weights} {cfg.dtype}: {d.numerics}")
    kernels = d.cpu_kernels
    if kernels:
        where = "hyloop's C++ kernels" if kernels["native"] else "torch ops (no C++ kernels)"
        lines.append(f"cpu kernels    {where}, {kernels['isa']}; by a fixed rule, never timed")
        for shape, kernel in kernels["choices"].items():
            lines.append(f"  {shape:<22} {kernel} at every row count")
        stack = kernels.get("stack")
        if stack is not None:
            kinds = ", ".join(f"{n} {kind}" for kind, n in stack["projections"].items())
            lines.append(f"decoder stack  every decode step in one call ({kinds})")
    extra = s.get("lookahead_hidden_host_s")
    if extra is not None:
        lines.append(f"host hidden    {extra:.3f} s by lookahead")
    if "decode_device_idle_time" in s:  # CUDA events: the device's own view of the loop
        lines.append(
            f"device time    decode busy {s['decode_device_busy_time']:.3f} s    "
            f"idle between steps {s['decode_device_idle_time']:.3f} s (waiting on the host)"
        )
    return "\n".join(lines)


def _pi_line(pi: Any, s: dict[str, Any]) -> str:
    if not pi.enable:
        return "off"
    return (
        f"on    reused tokens {s['reused_tokens']} (KV moved from another offset), "
        f"{s['recomputed_tokens']} of them recomputed    recompute_ratio {pi.recompute_ratio}    "
        f"recompute_tokens {pi.recompute_tokens}"
    )
