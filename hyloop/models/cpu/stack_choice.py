"""Whether a decode step runs its layers as one stack (``decoder_stack``) or one by one,
measured on this machine at each row count the steps will run.

The stack saves a dispatch and a thread wake-up per operator and reads its own panel GEMMs;
the layers may have faster kernels for some shapes on some CPUs (oneDNN's AMX bfloat16, say).
So at assembly, once the layers' own kernels are chosen (``kernel_choice``), one decode step of
the model over a 64-token context is timed both ways at each row count, and the faster kept.
Timings live in the kernel table beside the GEMMs' (``stack <shape>`` entries, kernels ``stack``
and ``layers``), so a later run here measures nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hyloop.graphs.step_batch import StepBatch, StepPools
from hyloop.models.cpu.decoder_stack import DecoderStack
from hyloop.models.cpu.kernel_choice import STACK_KERNELS, KernelTable, time_candidates
from hyloop.models.layers.attention import NativePath
from hyloop.pools import KVPool

log = logging.getLogger(__name__)

CONTEXT = 64  # keys each row attends to in the timed step


def stack_shape(model: nn.Module, stack: DecoderStack) -> str:
    """The kernel table's key: what the two timings depend on."""
    spec = model.spec
    kinds = ",".join(f"{k}:{n}" for k, n in sorted(stack.kinds.items()))
    dtype = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    return (
        f"stack {dtype} L{spec.num_layers} h{spec.hidden_size} i{spec.intermediate_size} "
        f"q{spec.num_heads} kv{spec.num_kv_heads} d{spec.head_dim} {kinds}"
    )


def decode_batch(model: nn.Module, rows: int, compute: Any) -> StepBatch:
    """A decode step of ``rows`` rows at position ``CONTEXT`` over a scratch KV pool."""
    c = model.contract
    dtype = model.model.embed_tokens.weight.dtype
    slots = 1 + rows * (CONTEXT + 1)
    kv = KVPool(len(c.kv_windows), slots, 1, c.kv_heads, c.head_dim, dtype, "cpu")
    for buf in (*kv.k, *kv.v):
        buf.normal_(0, 0.5)
    table = (1 + torch.arange(rows * (CONTEXT + 1))).view(rows, CONTEXT + 1).int()
    table = torch.cat([table, torch.zeros(1, CONTEXT + 1, dtype=torch.int32)])
    zeros = torch.zeros(rows, dtype=torch.int64)
    pos = torch.full((rows, 1), CONTEXT, dtype=torch.int64)
    return StepBatch(
        input_ids=torch.randint(3, c.vocab_size, (rows, 1)),
        positions=pos,
        out_cache_loc=table[:rows, CONTEXT].long().view(rows, 1),
        req_rows=torch.arange(rows),
        prefix_lens=pos.view(rows),
        extend_lens=torch.ones(rows, dtype=torch.int64),
        state_slots=zeros,
        track_slots=zeros,
        out_pos=zeros,
        keeps=torch.ones_like(zeros),
        pools=StepPools(table, kv, None, compute=compute),
        kv_len=CONTEXT + 1,
        is_decode=True,
    )


def choose_stack_rows(
    model: nn.Module,
    stack: DecoderStack,
    rows: Iterable[int],
    table: KernelTable | None = None,
    budget_s: float = 0.3,
) -> dict[int, bool]:
    """Time a decode step with and without ``stack`` at each row count (those ``table`` lacks),
    keep the timings, and return whether the stack was the faster at each."""
    table = table if table is not None else KernelTable.load()
    shape = stack_shape(model, stack)
    by_rows = table.entries.setdefault(shape, {})
    measured = table.measured
    t0 = time.perf_counter()
    with torch.inference_mode():
        for r in sorted(set(rows)):
            if all(k in by_rows.get(r, {}) for k in STACK_KERNELS):
                continue
            step = {
                "stack": decode_batch(model, r, NativePath(stack)),
                "layers": decode_batch(model, r, NativePath()),
            }
            timed = time_candidates(
                {k: (lambda b=b: model(b)) for k, b in step.items()}, budget_s=budget_s
            )
            by_rows[r] = {k: round(v, 1) for k, v in timed.items()}
            table.measured += 1
    if table.measured > measured:
        table.measure_s += time.perf_counter() - t0
        try:
            table.save()
        except OSError as e:
            log.warning("hyloop: could not keep the stack's timings in %s: %s", table.path, e)
    choice = {r: us["stack"] <= us["layers"] for r, us in by_rows.items() if r in set(rows)}
    log.info("hyloop: decoder stack per row count (measured): %s", choice)
    return choice
