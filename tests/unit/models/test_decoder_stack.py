"""The decoder stack (``hyloop::decode_layers``): a dense model's decode step in one call equals
the same step layer by layer (torch path), in its hidden states and in the K/V it writes, for
Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms), float32, bfloat16 and int4 / int8 weights;
its result does not depend on how many threads ran it; bad input is named; what it cannot run
is refused with the reason."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import TINY_DENSE, make_batch

from hyloop.graphs.step_batch import StepBatch
from hyloop.models.cpu import cpu_ops
from hyloop.models.cpu.decoder_stack import DecoderStack, stack_refusal
from hyloop.models.layers.attention import NativePath, TorchPath
from hyloop.models.quant.apply import quantize_linears
from hyloop.models.quant.linear import WeightOnlyLinear
from hyloop.models.registry import model_class
from hyloop.pools import KVPool, ReqToTokenPool

pytestmark = pytest.mark.skipif(
    not cpu_ops.ensure_loaded(), reason="no C++ compiler: hyloop's CPU kernels cannot be built"
)

MAX_CTX = 24
LENS = [7, 4, 11]  # prompt lengths of the three requests


def tiny(name: str, dtype: torch.dtype, weights: str = "dequantize") -> Any:
    torch.manual_seed(0)
    cfg = TINY_DENSE[name]
    model = model_class(cfg)(cfg).eval().to(dtype)
    if weights != "dequantize":
        quantize_linears(model, weights, {}, torch.device("cpu"))
        for m in model.modules():
            if isinstance(m, WeightOnlyLinear):
                m.attach_panels()
    return model


def pools(model: Any, dtype: torch.dtype) -> tuple[KVPool, ReqToTokenPool]:
    c = model.contract
    kv = KVPool(len(c.kv_windows), 1 + len(LENS) * MAX_CTX, 1, c.kv_heads, c.head_dim, dtype, "cpu")
    table = ReqToTokenPool(len(LENS), MAX_CTX, "cpu")
    for r in range(len(LENS)):
        table.table[r] = 1 + r * MAX_CTX + torch.arange(MAX_CTX, dtype=torch.int32)
    return kv, table


def prefill(model: Any, kv: KVPool, table: ReqToTokenPool) -> None:
    b, t = len(LENS), max(LENS)
    ids = torch.randint(3, 200, (b, t), generator=torch.Generator().manual_seed(1))
    loc = torch.zeros(b, t, dtype=torch.int64)
    for r, n in enumerate(LENS):
        loc[r, :n] = table.table[r, :n].long()
    batch = make_batch(
        input_ids=ids,
        positions=torch.arange(t).repeat(b, 1),
        out_cache_loc=loc,
        req_rows=torch.arange(b),
        prefix_lens=torch.zeros(b, dtype=torch.int64),
        extend_lens=torch.tensor(LENS),
        req_to_token=table.table,
        kv_len=t,
        kv=kv,
    )
    with torch.no_grad():
        model(batch)


def decode_batch(kv: KVPool, table: ReqToTokenPool, compute: Any) -> StepBatch:
    b = len(LENS)
    pos = torch.tensor(LENS).view(b, 1)
    return make_batch(
        input_ids=torch.tensor([[17], [42], [99]]),
        positions=pos,
        out_cache_loc=table.table[torch.arange(b), pos.view(b)].long().view(b, 1),
        req_rows=torch.arange(b),
        prefix_lens=pos.view(b),
        extend_lens=torch.ones(b, dtype=torch.int64),
        req_to_token=table.table,
        kv_len=max(LENS) + 1,
        kv=kv,
        is_decode=True,
        compute=compute,
    )


def decode_both(name: str, dtype: torch.dtype, weights: str = "dequantize") -> dict[str, Any]:
    """One decode step after the same prefill, layer by layer and as a stack."""
    model = tiny(name, dtype, weights)
    kv, table = pools(model, dtype)
    prefill(model, kv, table)
    out: dict[str, Any] = {}
    for label, compute in (("layers", TorchPath()), ("stack", NativePath(DecoderStack(model)))):
        pool = KVPool(
            len(kv.k), kv.k[0].shape[0], 1, kv.k[0].shape[1], kv.k[0].shape[2], dtype, "cpu"
        )
        for i in range(len(kv.k)):
            pool.k[i].copy_(kv.k[i])
            pool.v[i].copy_(kv.v[i])
        with torch.no_grad():
            hidden = model(decode_batch(pool, table, compute))
        out[label] = (hidden.float(), pool)
    return out


@pytest.mark.parametrize("name", sorted(TINY_DENSE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stack_is_the_layers(name: str, dtype: torch.dtype) -> None:
    res = decode_both(name, dtype)
    (h_layers, kv_layers), (h_stack, kv_stack) = res["layers"], res["stack"]
    # float32: summation order only; bfloat16: the same roundings, in another order
    rel = 2e-5 if dtype == torch.float32 else 3e-2
    scale = float(h_layers.abs().max())
    torch.testing.assert_close(h_stack, h_layers, rtol=0, atol=rel * scale)
    loc = [1 + r * MAX_CTX + n for r, n in enumerate(LENS)]
    for i in range(len(kv_layers.k)):
        for buf_s, buf_l in ((kv_stack.k[i], kv_layers.k[i]), (kv_stack.v[i], kv_layers.v[i])):
            ref = buf_l[loc].float()
            tol = rel * float(ref.abs().max())
            torch.testing.assert_close(buf_s[loc].float(), ref, rtol=0, atol=tol)
            assert float(buf_s[loc].abs().sum()) > 0  # the new token's K/V did land
            others = [s for s in range(buf_s.shape[0]) if s not in loc]
            assert torch.equal(buf_s[others], buf_l[others])  # and nothing else moved


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_quantized_stack_is_the_quantized_layers(weights: str) -> None:
    """Integer panels in both paths; they quantize activations per group of 32, where a last
    digit's difference can flip a code, so the match is to that rounding."""
    res = decode_both("llama", torch.float32, weights)
    h_layers, h_stack = res["layers"][0], res["stack"][0]
    err = float((h_stack - h_layers).abs().max())
    assert err <= 2e-2 * float(h_layers.abs().max()), err


def test_the_result_does_not_depend_on_the_thread_count() -> None:
    """Each output is computed by one thread in one order, however the work is split."""
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(decode_both("qwen3", torch.float32)["stack"][0])
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=0, atol=0)


def _call(stack: DecoderStack, kv: KVPool, **change: Any) -> torch.Tensor:
    b, h = 2, stack.hidden
    args: dict[str, Any] = dict(
        x=torch.randn(b, h),
        k_bufs=list(kv.k),
        v_bufs=list(kv.v),
        loc=torch.tensor([3, 4]),
        slots=torch.tensor([[1, 2, 3], [1, 2, 4]]),
        bias=torch.zeros(b, 3),
        cos=torch.ones(b, 16),
        sin=torch.zeros(b, 16),
    )
    args.update(change)
    return torch.ops.hyloop.decode_layers(
        args["x"],
        stack.handle,
        args["k_bufs"],
        args["v_bufs"],
        args["loc"],
        args["slots"],
        args["bias"],
        args["cos"],
        args["sin"],
    )


def test_bad_input_is_named() -> None:
    model = tiny("llama", torch.float32)
    kv, _ = pools(model, torch.float32)
    stack = DecoderStack(model)
    assert _call(stack, kv).shape == (2, stack.hidden)
    with pytest.raises(RuntimeError, match="loc\\[1\\] = 9999 outside"):
        _call(stack, kv, loc=torch.tensor([3, 9999]))
    with pytest.raises(RuntimeError, match="slot -1 outside"):
        _call(stack, kv, slots=torch.tensor([[1, 2, 3], [1, -1, 4]]))
    with pytest.raises(RuntimeError, match="one K and one V buffer per layer"):
        _call(stack, kv, k_bufs=list(kv.k)[:1])
    with pytest.raises(RuntimeError, match="must be float32"):
        _call(stack, kv, x=torch.randn(2, stack.hidden).bfloat16())
    with pytest.raises(RuntimeError, match="is not registered"):
        torch.ops.hyloop.decode_layers(
            torch.randn(1, 64),
            -5,
            [],
            [],
            torch.zeros(1).long(),
            torch.zeros(1, 1).long(),
            torch.zeros(1, 1),
            torch.ones(1, 16),
            torch.zeros(1, 16),
        )


def test_models_it_cannot_run_are_refused_with_the_reason() -> None:
    assert stack_refusal(tiny("llama", torch.float32)) is None
    assert "not a dense Llama" in str(stack_refusal(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="no decoder stack: .*not a dense"):
        DecoderStack(torch.nn.Linear(4, 4))


def test_phase_clocks_account_for_the_step_only_when_on() -> None:
    """The stack's phase clocks: off, nothing is charged; on, every phase of a step that does
    work is charged, and the phases sum to no more than the step's own time."""
    import time

    from hyloop.models.cpu.decoder_stack import PHASES

    model = tiny("llama", torch.float32)
    kv, table = pools(model, torch.float32)
    prefill(model, kv, table)
    stack = DecoderStack(model)
    assert stack.weight_bytes == sum(
        4 * p.numel() for n, p in model.model.layers.named_parameters() if "norm" in n
    ) + sum(
        mod.panels.nbytes if getattr(mod, "panels", None) is not None else 4 * mod.weight.numel()
        for layer in model.model.layers
        for mod in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    )
    batch = decode_batch(kv, table, NativePath(stack))
    stack.phase_times(False)
    with torch.no_grad():
        model(batch)
    assert set(stack.phase_times(True).values()) == {0.0}
    t0 = time.perf_counter()
    with torch.no_grad():
        model(batch)
    wall = time.perf_counter() - t0
    seconds = stack.phase_times(False)
    assert tuple(seconds) == PHASES
    for phase in ("norm", "qkv", "attention", "o", "gate_up", "down"):
        assert seconds[phase] > 0, phase
    assert sum(seconds.values()) <= wall
    with torch.no_grad():
        model(batch)
    assert set(stack.phase_times(False).values()) == {0.0}


def _copy(kv: KVPool, dtype: torch.dtype) -> KVPool:
    pool = KVPool(len(kv.k), kv.k[0].shape[0], 1, kv.k[0].shape[1], kv.k[0].shape[2], dtype, "cpu")
    for i in range(len(kv.k)):
        pool.k[i].copy_(kv.k[i])
        pool.v[i].copy_(kv.v[i])
    return pool


@pytest.mark.parametrize(
    ("dtype", "weights"),
    [(torch.float32, "dequantize"), (torch.bfloat16, "dequantize"), (torch.float32, "int8")],
)
def test_a_row_alone_is_the_row_in_a_batch(dtype: torch.dtype, weights: str) -> None:
    """A row decoded alone (its kv heads' query groups split over the threads) gives the bits it
    gets in a batch (one task per kv head), K/V written included."""
    model = tiny("llama", dtype, weights)
    kv, table = pools(model, dtype)
    prefill(model, kv, table)
    stack = NativePath(DecoderStack(model))
    batched = _copy(kv, dtype)
    full = decode_batch(batched, table, stack)
    with torch.no_grad():
        together = model(full)
    for r in range(len(LENS)):
        alone = _copy(kv, dtype)
        pos = torch.tensor([[LENS[r]]])
        loc = table.table[r, LENS[r]].long().view(1, 1)
        batch = make_batch(
            input_ids=full.input_ids[r : r + 1],
            positions=pos,
            out_cache_loc=loc,
            req_rows=torch.tensor([r]),
            prefix_lens=pos.view(1),
            extend_lens=torch.ones(1, dtype=torch.int64),
            req_to_token=table.table,
            kv_len=max(LENS) + 1,
            kv=alone,
            is_decode=True,
            compute=stack,
        )
        with torch.no_grad():
            one = model(batch)
        assert torch.equal(one[0], together[r]), r
        for i in range(len(kv.k)):
            assert torch.equal(alone.k[i][loc.view(-1)], batched.k[i][loc.view(-1)])
            assert torch.equal(alone.v[i][loc.view(-1)], batched.v[i][loc.view(-1)])


def verify_batch(
    table: ReqToTokenPool, ids: torch.Tensor, extend: list[int], kv: KVPool, compute: Any
) -> StepBatch:
    """A verify step of ``ids`` [requests, positions] after each request's prompt (``LENS``),
    ``extend`` of each request's positions real (the rest padding)."""
    b, t = ids.shape
    pos = torch.tensor(LENS).view(b, 1) + torch.arange(t)
    batch = make_batch(
        input_ids=ids,
        positions=pos,
        out_cache_loc=table.table[torch.arange(b).view(b, 1), pos].long(),
        req_rows=torch.arange(b),
        prefix_lens=torch.tensor(LENS),
        extend_lens=torch.tensor(extend),
        req_to_token=table.table,
        kv_len=max(LENS) + t,
        kv=kv,
        compute=compute,
    )
    batch.verify = True
    return batch


@pytest.mark.parametrize(
    ("dtype", "weights"), [(torch.float32, "dequantize"), (torch.float32, "int8")]
)
def test_a_verify_steps_padding_is_not_computed_and_its_rows_are_unchanged(
    dtype: torch.dtype, weights: str
) -> None:
    """A verify step's rows are padded to the longest (here 3 positions for 3, 1 and 2 real
    ones): the stack computes the real positions alone, bit for bit what they are with every
    position real (their logits too); the padding's hidden states are zeros and its K/V are
    not written."""
    model = tiny("llama", dtype, weights)
    kv, table = pools(model, dtype)
    prefill(model, kv, table)
    stack = NativePath(DecoderStack(model))
    b, t = len(LENS), 3
    pos = torch.tensor(LENS).view(b, 1) + torch.arange(t)
    loc = table.table[torch.arange(b).view(b, 1), pos].long()
    ids = torch.randint(3, 200, (b, t), generator=torch.Generator().manual_seed(2))

    def verify(extend: list[int]) -> tuple[torch.Tensor, torch.Tensor, KVPool]:
        pool = _copy(kv, dtype)
        batch = verify_batch(table, ids, extend, pool, stack)
        with torch.no_grad():
            hidden = model(batch)
            live = batch.live_positions()
            logits = model.compute_logits(hidden.reshape(b * t, -1), live.view(-1))
        return hidden, logits.view(b, t, -1), pool

    full_h, full_logits, full_kv = verify([t] * b)
    h, logits, padded_kv = verify([3, 1, 2])
    live = torch.arange(t) < torch.tensor([3, 1, 2]).view(b, 1)
    assert torch.equal(h[live], full_h[live])
    assert torch.equal(logits[live], full_logits[live])
    assert not h[~live].any()
    for i in range(len(kv.k)):
        assert torch.equal(padded_kv.k[i][loc[live]], full_kv.k[i][loc[live]])
        assert torch.equal(padded_kv.k[i][loc[~live]], kv.k[i][loc[~live]])  # not written
        assert torch.equal(padded_kv.v[i][loc[~live]], kv.v[i][loc[~live]])
        assert not torch.equal(full_kv.k[i][loc[~live]], kv.k[i][loc[~live]])


def wide(head_dim: int, dtype: torch.dtype) -> Any:
    """A tiny Llama whose heads have a size the stack's fused verify attention runs (64: a
    group of 3 query heads, as SmolLM2's; 128: groups of 2)."""
    torch.manual_seed(0)
    heads, kv_heads = (3, 1) if head_dim == 64 else (4, 2)
    cfg = dict(
        TINY_DENSE["llama"],
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )
    return model_class(cfg)(cfg).eval().to(dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("extend", [[4, 4, 4], [4, 1, 3]])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_steps_positions_are_their_plain_steps_bit_for_bit(
    dtype: torch.dtype, head_dim: int, extend: list[int], threads: int
) -> None:
    """A verify step's positions attend together (each request's columns read once for all its
    rows, split into parts where the requests are few for the threads): each real position's
    hidden state and K/V are the bits of the plain decode step that computes it alone, one step
    after another; with padding too (the live rows' requests from their places)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = wide(head_dim, dtype)
        kv, table = pools(model, dtype)
        prefill(model, kv, table)
        stack = NativePath(DecoderStack(model))
        b, t = len(LENS), max(extend)
        pos = torch.tensor(LENS).view(b, 1) + torch.arange(t)
        loc = table.table[torch.arange(b).view(b, 1), pos].long()
        ids = torch.randint(3, 200, (b, t), generator=torch.Generator().manual_seed(3))
        together = _copy(kv, dtype)
        with torch.no_grad():
            verified = model(verify_batch(table, ids, extend, together, stack))
        one_by_one = _copy(kv, dtype)
        for j in range(t):
            rows = [r for r in range(b) if j < extend[r]]
            step = make_batch(
                input_ids=ids[rows, j : j + 1],
                positions=pos[rows, j : j + 1],
                out_cache_loc=loc[rows, j : j + 1],
                req_rows=torch.tensor(rows),
                prefix_lens=pos[rows, j],
                extend_lens=torch.ones(len(rows), dtype=torch.int64),
                req_to_token=table.table,
                kv_len=max(LENS) + j + 1,
                kv=one_by_one,
                is_decode=True,
                compute=stack,
            )
            with torch.no_grad():
                plain = model(step)
            for i, r in enumerate(rows):
                assert torch.equal(plain[i, 0], verified[r, j]), (r, j)
        live = torch.arange(t) < torch.tensor(extend).view(b, 1)
        for i in range(len(kv.k)):
            assert torch.equal(together.k[i][loc[live]], one_by_one.k[i][loc[live]])
            assert torch.equal(together.v[i][loc[live]], one_by_one.v[i][loc[live]])
    finally:
        torch.set_num_threads(saved)
