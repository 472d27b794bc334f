"""A dense model's decoder layers as one CPU operator per decode step (``cpu_decoder.cpp``).

``hyloop::decode_layers`` runs every layer of a Llama / Qwen2 / Qwen3 model for one new token
per row (a decode step, or a prefill of one-token chunks), on one team of threads, its phases
separated by barriers: no operator per norm,
projection or attention in between, no thread wake-up per kernel, and each projection read
through its panels (the same ones the layer-by-layer path's ``hyloop::panel_linear`` reads).
Longer prefill chunks, and any model or step this does not cover, run the layers one by one.

It is the ``stack`` of the CPU compute path (``layers.attention.paged.NativePath``), built at
assembly when ``model.cpu_stack`` allows it; ``DecoderLM.forward`` hands it decode steps. The
KV pool's buffers are arguments the operator mutates (``Tensor(a!)[]``), so a compiled step
orders it like any other write of the pool.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from hyloop.graphs.step_batch import StepBatch
from hyloop.models.cpu.panels import BF16, F32, I4, I8, Panels
from hyloop.models.kv_layout import attention_meta

MAX_HIDDEN, MAX_GROUP, MAX_ROTARY = 8192, 64, 1024  # cpu_decoder.cpp's fixed buffers
# cpu_decoder.cpp's Phase: norms, the four GEMMs, attention (q/k norms, RoPE, the K/V write
# included), and the barriers' waits.
PHASES = ("norm", "qkv", "attention", "o", "gate_up", "down", "wait")


def stack_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot run as one stack (None: it can)."""
    contract = getattr(model, "contract", None)
    spec = contract.stack if contract is not None else None
    if spec is None:
        return f"{type(model).__name__} is not a dense Llama / Qwen2 / Qwen3 model"
    if spec.mlp_bias:
        return "MLP biases"
    if spec.hidden_size > MAX_HIDDEN or spec.num_heads // spec.num_kv_heads > MAX_GROUP:
        return "hidden size or query group beyond the kernel's buffers"
    if spec.rotary_dim > MAX_ROTARY or spec.rotary_dim % 2:
        return "rotary dims"
    embed = spec.embed.weight
    if embed.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {embed.dtype}"
    if embed.device.type != "cpu":
        return "not on the CPU"
    group_dims = spec.num_heads // spec.num_kv_heads * spec.head_dim
    formats = set()
    for layer in spec.layers():
        kinds = tuple(_format(p) for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
        if None in kinds:
            return "a projection hyloop's panels cannot hold"
        if kinds[1] == "int" and group_dims % 32:
            return "a quantized o projection over query groups that are not whole int8 groups"
        if kinds[3] == "int" and spec.intermediate_size % 32:
            return "a quantized down projection over an intermediate size not in groups of 32"
        formats.add(kinds)
    if len(formats) > 1:
        return "layers that mix dense and quantized projections differently"
    return None


def _format(module: nn.Module) -> str | None:
    """A projection's rows format: ``int`` (int4 / int8 panels), ``dense`` (float32 / bfloat16,
    panels or a weight to pack), None (neither)."""
    panels = getattr(module, "panels", None)
    if panels is not None:
        return "int" if panels.kind in (I4, I8) else "dense"
    weight = getattr(module, "weight", None)
    ok = weight is not None and weight.dtype in (torch.float32, torch.bfloat16)
    return "dense" if ok else None


def panels_of(module: nn.Module, split: bool = False) -> Panels:
    """The projection's panels: its own (a packed or weight-only Linear has them) or packed
    here from its weight (``split``: a fused gate/up projection's halves interleaved)."""
    panels = getattr(module, "panels", None)
    if panels is not None:
        return panels
    weight = module.weight.detach()
    return Panels.dense(weight, weight.shape[0] // 2 if split else 0)


class DecoderStack:
    """``model``'s decoder layers registered with ``hyloop::decode_layers`` (one handle)."""

    def __init__(self, model: nn.Module) -> None:
        why = stack_refusal(model)
        if why is not None:
            raise ValueError(f"no decoder stack: {why}")
        spec = model.contract.stack
        dtype = spec.embed.weight.dtype
        layers = spec.layers()
        self.rotary = spec.rotary
        self.hidden = spec.hidden_size
        self.pool_layers = [layer.kv_layer for layer in layers]
        self.handle = int(
            torch.ops.hyloop.stack_create(
                spec.hidden_size,
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.intermediate_size,
                spec.rms_norm_eps,
                spec.scale,
                dtype == torch.bfloat16,
            )
        )
        weakref.finalize(self, torch.ops.hyloop.stack_free, self.handle)
        self.kinds: dict[str, int] = {}
        self.weight_bytes = 0  # what a step reads of the layers' weights: panels and norms
        with torch.no_grad():
            for layer in layers:
                projections = [
                    panels_of(layer.qkv),
                    panels_of(layer.o),
                    panels_of(layer.gate_up, split=True),
                    panels_of(layer.down),
                ]
                norms = layer.norms
                torch.ops.hyloop.stack_add_layer(
                    self.handle,
                    [p.data for p in projections],
                    [p.kind for p in projections],
                    [int(p.half) for p in projections],
                    [n.detach().float() for n in norms],
                    [_bias(layer.qkv), _bias(layer.o)],
                )
                for p in projections:
                    self.kinds[_KIND_NAMES[p.kind]] = self.kinds.get(_KIND_NAMES[p.kind], 0) + 1
                self.weight_bytes += sum(p.nbytes for p in projections)
                self.weight_bytes += sum(4 * n.numel() for n in norms)  # held as float32

    def __call__(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The layers' output ``[B, T, H]`` for embedded tokens ``x [B, T, H]``: one per row
        (a decode step), or a verify step's ``T`` positions per row, each a row of the stack
        that sees its request's positions before it (runs of ``T`` rows: ``group``)."""
        b, t = x.shape[:2]
        n = b * t
        pool = batch.pools.kv
        meta = attention_meta(batch)
        positions = batch.positions.reshape(n)
        cos = self.rotary.cos[positions].float()  # (the tables follow the model's dtype)
        sin = self.rotary.sin[positions].float()
        length = meta.slots.numel() // b
        live = None
        if t == 1:
            slots, bias = meta.slots.view(b, -1), meta.mask.view(b, -1)
        else:  # each position a row over its request's columns, those up to it visible
            slots = meta.slots.view(b, 1, length).expand(b, t, length).reshape(n, length)
            zero = torch.zeros((), dtype=torch.float32, device=x.device)
            bias = torch.where(meta.mask.view(n, length), zero, float("-inf"))
            # a row's positions past its drafts pad the step: not computed (zeros)
            live = batch.live_positions().reshape(n)
        args = (
            x.reshape(n, self.hidden),
            self.handle,
            [pool.k[i] for i in self.pool_layers],
            [pool.v[i] for i in self.pool_layers],
            meta.loc.reshape(n),
            slots,
            bias,
            cos,
            sin,
            t,
        )
        if live is None:
            out = torch.ops.hyloop.decode_layers(*args)
        else:
            out = torch.ops.hyloop.decode_layers_live(*args, live)
        return out.view(b, t, self.hidden)

    def phase_times(self, enable: bool = True) -> dict[str, float]:
        """Seconds per phase of the steps since the last call, as the calling thread (rank 0)
        saw them: its own work per phase, and in ``wait`` its time at barriers waiting for the
        others; then reset. ``enable`` turns the clocks on for the steps that follow (off by
        default: no clock is read)."""
        seconds = torch.ops.hyloop.stack_phase_times(self.handle, enable)
        if seconds.numel() == 0:
            return dict.fromkeys(PHASES, 0.0)
        return dict(zip(PHASES, seconds[0].tolist(), strict=True))

    def describe(self) -> dict[str, Any]:
        """What the run summary reports: projections per weight kind."""
        return {"projections": dict(self.kinds), "rows": "every"}


_KIND_NAMES = {F32: "float32", BF16: "bfloat16", I4: "int4", I8: "int8"}


def _bias(linear: nn.Module) -> torch.Tensor | None:
    bias = getattr(linear, "bias", None)
    return None if bias is None else bias.detach().float()
