"""Where a decode step's time goes: torch.profiler events of warm decode steps, by category.

Each profiled step runs inside a ``record_function`` marker, so every profiler event under it
is one of the step's ops, and the self CPU times of the marker and all its descendants add up
to the step's wall time. Each event's self time goes to the category of the first rule in
``RULES`` that matches its name; the marker's own self time (wall time covered by no op: the
engine's Python, the scheduler) and the self time of wrappers (``hyloop::packed_linear`` around
``mkldnn::_linear_pointwise``, ``aten::linear`` around ``aten::addmm``) are "python/dispatch".

Under ``torch.compile`` inductor fuses ops into generated kernels; with
``torch._inductor.config.cpp.enable_kernel_profile`` each one is an event named
``graph_<n>_cpp_fused_<ops>_<k>`` and is classified by the op names in it. Time inside the
compiled region that no kernel event covers is kept apart as "compiled, unattributed".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, record_function

STEP_MARK = "hyloop_bench.decode_step"

CATEGORIES = (
    "gemm",
    "attention",
    "norm/rope/act",
    "sampling",
    "copies",
    "python/dispatch",
    "compiled, unattributed",
    "fused mixed",
    "other",
)

# (pattern, category), first match wins; matched against the event name with re.search.
# Generated kernels (``cpp_fused_...``) are matched before op names: a fused kernel's name
# joins the names of the aten ops it came from with "_", and the first rule that fits says
# what it does.
_FUSED = "cpp_fused_"


def _fused(*ops: str) -> str:
    """A generated kernel whose name lists any of ``ops`` (whole op names, not prefixes)."""
    return _FUSED + r".*(?<![a-z0-9])(?:" + "|".join(ops) + r")(?![a-z0-9])"


# Only multiplies, sums and views: the one-row GEMV (``W * x`` reduced over the input dim).
_FUSED_GEMV = (
    _FUSED + r"(?=.*(?<![a-z])mul(?![a-z]))(?=.*(?<![a-z])sum(?![a-z]))"
    r"(?:(?:_unsafe_view|view|mul|sum|add|_to_copy|convert_element_type)_+)+\d+$"
)
RULES: tuple[tuple[str, str], ...] = (
    (r"^" + re.escape(STEP_MARK) + r"$", "python/dispatch"),
    # Compiled regions: their self time is what no kernel or extern-call event covers.
    (r"^(## Call CompiledFxGraph|CompiledFunction)", "compiled"),
    # Guard checks and the entry into the compiled region run before any kernel.
    (r"^(TorchDynamo Cache Lookup|Torch-Compiled Region|torch\.compile)", "python/dispatch"),
    # Generated kernels, by the ops fused into them. A kernel that joins attention or the
    # sampler with a norm or an activation (a one-row step fuses whole layers, GEMVs included)
    # has no one category: its time is shown as is.
    (_fused("_*softmax", "argmax") + r"(?=.*(?<![a-z])(?:rsqrt|silu)(?![a-z]))", "fused mixed"),
    (
        _fused(
            "argmax", "topk", "sort", "cumsum", "bitwise_and", "bitwise_xor", "_*rshift_*", "log"
        ),
        "sampling",
    ),
    (
        _fused("_*softmax", "index_select", "bmm", r"index(?!_copy|_put)", "amax", "exp"),
        "attention",
    ),
    (_FUSED_GEMV, "gemm"),
    (
        _fused(
            "rsqrt",
            "mean",
            "pow",
            "silu",
            "sigmoid",
            "gelu",
            "cos",
            "sin",
            "neg",
            "mul",
            "add",
            "div",
            "sub",
        ),
        "norm/rope/act",
    ),
    (_fused("index_copy", "index_put", "cat", "clone", "_*to_copy", "copy", "embedding"), "copies"),
    # Wrappers: their self time is dispatch; the work is in the op they call.
    (r"^hyloop::packed_linear$", "python/dispatch"),
    (r"^aten::(linear|matmul|einsum|softmax|to|contiguous|reshape|flatten)$", "python/dispatch"),
    # GEMMs.
    (r"^mkldnn::_linear_pointwise", "gemm"),
    (r"^aten::(mm|addmm|_addmm_activation)$", "gemm"),
    (r"^(aoti_torch_cpu_|)(mkldnn__linear_pointwise|addmm|mm)", "gemm"),
    # Attention: the KV gather, the score/value products, softmax.
    (r"^aten::(bmm|baddbmm|_softmax|_scaled_dot_product|scaled_dot_product)", "attention"),
    (r"^aten::(index_select|index|gather|_safe_softmax)$", "attention"),
    # Sampling.
    (r"^aten::(argmax|argmin|max|topk|sort|cumsum|multinomial|exponential_)$", "sampling"),
    (r"^aten::(bitwise_|__rshift__|__lshift__|__xor__|remainder|log$)", "sampling"),
    # Copies and gathers of whole rows.
    (r"^aten::(copy_|_to_copy|index_copy_?|index_put_?|_index_put_impl_|cat|clone)$", "copies"),
    (
        r"^aten::(embedding|stack|fill_|zero_|zeros|zeros|scatter_?|narrow_copy|masked_fill_?)$",
        "copies",
    ),
    # Norms, RoPE, activations: the element-wise and reduction ops.
    (r"^aten::(rms_norm|_fused_rms_norm|layer_norm|native_layer_norm|silu|gelu)", "norm/rope/act"),
    (
        r"^aten::(mul|add|sub|div|pow|rsqrt|sqrt|mean|sum|neg|sigmoid|exp|cos|sin)_?$",
        "norm/rope/act",
    ),
    (
        r"^aten::(where|clamp|clamp_min|minimum|maximum|lt|gt|le|ge|eq|ne|ones_like|zeros_like|arange)$",
        "norm/rope/act",
    ),
    # Metadata and allocation: no data moves, the cost is dispatch.
    (r"^detach_$", "python/dispatch"),
    (
        r"^aten::(empty|empty_like|empty_strided|view|narrow|scalar_tensor|detach_|_unsafe_view|reshape|expand|as_strided"
        r"|slice|select|unsqueeze|squeeze|t|transpose|permute|detach|alias|resolve_conj"
        r"|resolve_neg|lift_fresh|_reshape_alias|unbind|split|chunk|split_with_sizes|item"
        r"|_local_scalar_dense|result_type|is_nonzero|numel|size|stride)$",
        "python/dispatch",
    ),
)
_COMPILED_RULES = [(re.compile(p), c) for p, c in RULES]


def classify(name: str) -> str:
    """The category of a profiler event named ``name`` (``other`` when no rule matches)."""
    for pattern, category in _COMPILED_RULES:
        if pattern.search(name):
            return category
    return "other"


@dataclass
class StepProfile:
    """Self CPU microseconds by category and by event name over the profiled steps."""

    steps: int = 0
    wall_us: float = 0.0
    by_category: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    by_event: dict[str, float] = field(default_factory=dict)
    kernel_events: int = 0  # generated-kernel events seen (0 under compile: none are visible)

    def add(self, name: str, self_us: float) -> None:
        category = classify(name)
        if category == "compiled":
            category = "compiled, unattributed"
        self.by_category[category] += self_us
        self.by_event[name] = self.by_event.get(name, 0.0) + self_us
        self.kernel_events += _FUSED in name

    def shares(self) -> dict[str, float]:
        total = sum(self.by_category.values()) or 1.0
        return {c: us / total for c, us in self.by_category.items()}

    def top(self, n: int = 10, category: str | None = None) -> list[dict[str, Any]]:
        """The ``n`` events with the most self time (of ``category`` only, if given)."""
        events = [kv for kv in self.by_event.items() if category in (None, classify(kv[0]))]
        ranked = sorted(events, key=lambda kv: -kv[1])[:n]
        return [
            {
                "name": name,
                "category": classify(name),
                "self_ms_per_step": us / 1e3 / max(1, self.steps),
            }
            for name, us in ranked
        ]


def _descendants(root: FunctionEvent) -> list[FunctionEvent]:
    out, stack = [], list(root.cpu_children)
    while stack:
        ev = stack.pop()
        out.append(ev)
        stack.extend(ev.cpu_children)
    return out


def profile_steps(step: Callable[[], None], steps: int) -> StepProfile:
    """Profile ``steps`` calls of ``step`` (CPU activity), each under the step marker."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function(STEP_MARK):
                step()
    result = StepProfile()
    for mark in prof.events():
        if mark.name != STEP_MARK:
            continue
        result.steps += 1
        result.wall_us += mark.cpu_time_total
        result.add(mark.name, mark.self_cpu_time_total)
        for ev in _descendants(mark):
            result.add(ev.name, ev.self_cpu_time_total)
    return result


def kernel_profile_enabled() -> bool:
    """Turn on inductor's per-kernel profiler events (for compiles that follow)."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True
    return bool(inductor_config.cpp.enable_kernel_profile)


def profile_engine(
    engine: Any, prompts: list[list[int]], steps: int, warm: int = 3
) -> dict[str, Any]:
    """Decode ``prompts`` on ``engine`` (its bucket already captured): ``warm`` steps, ``steps``
    timed steps without the profiler, then ``steps`` profiled ones; every one a decode step."""
    from hyloop import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=warm + 2 * steps + 4, ignore_eos=True)
    base = engine.stats()["decode_steps"]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{base}-{i}", prompt, params)
    s = engine.stats()
    while engine.stats()["decode_steps"] == s["decode_steps"]:  # the prefill, one decode step
        engine.step()
    for _ in range(warm):
        engine.step()
    s0 = dict(engine.stats())
    for _ in range(steps):
        engine.step()
    s1 = dict(engine.stats())
    prof = profile_steps(engine.step, steps)
    s2 = dict(engine.stats())
    while engine.has_unfinished_requests():
        engine.step()
    for a, b in ((s0, s1), (s1, s2)):
        d = {k: b[k] - a[k] for k in ("decode_steps", "decode_tokens", "prefill_steps")}
        if d != {"decode_steps": steps, "decode_tokens": steps * len(prompts), "prefill_steps": 0}:
            raise RuntimeError(f"expected {steps} decode steps of {len(prompts)} rows, got {d}")
    return {
        "step_ms": 1e3 * (s1["decode_time"] - s0["decode_time"]) / steps,
        "profiled_step_ms": prof.wall_us / 1e3 / steps,
        "steps": steps,
        "shares": prof.shares(),
        "kernel_events": prof.kernel_events // steps,
        "top_events": prof.top(10),
        "other_events": prof.top(10, "other"),  # what no rule names: a table to extend
        "events_ms_per_step": {e["name"]: e["self_ms_per_step"] for e in prof.top(1000)},
    }
