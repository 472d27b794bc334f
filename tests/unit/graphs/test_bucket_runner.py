"""BucketRunner: compiled / CUDA-graph replay equals the eager oracle; padding is inert.

The toy step reads and writes a pool like a paged-attention layer does, with integer-valued
fp32 data, so the compiled artifact must match eager bit for bit whatever order Inductor sums
in. Compiling is slow on small CPUs: the runners are module-scoped and the buckets few.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from conftest import load_hf_model

from hyloop.framework.step_kinds import TokenSampling
from hyloop.framework.token_step import TokenStep
from hyloop.graphs.capture.backends import GUARD_EVERY, CompiledStep, RecompileError
from hyloop.graphs.capture.bucket_runner import BucketRunner, check_batch
from hyloop.graphs.capture.buckets import ArtifactKey, kv_len_buckets, pick_bucket
from hyloop.graphs.capture.buffer import CaptureBuffer
from hyloop.graphs.safety import check_capture_safe
from hyloop.graphs.sampler import sample, token_hashes
from hyloop.graphs.step_batch import GREEDY, ROW_FIELDS, StepBatch, StepOutput, StepPools
from hyloop.models.layers.attention import TorchPath
from hyloop.models.loader import load_model
from hyloop.pools import KVPool, ReqToTokenPool

VOCAB, DIM = 32, 8
MAX_REQS, MAX_CTX = 12, 24  # req->token rows 0..11, padding row 12
PAD_ROW = MAX_REQS
BUCKETS, KV_BUCKETS = [2, 4], [8, 16]


@dataclasses.dataclass
class ToyPools:
    """A one-layer "KV pool" and its req->token table; row r, position p -> slot 1 + r*L + p."""

    kv: torch.Tensor
    table: torch.Tensor
    emb: torch.Tensor
    w: torch.Tensor
    tok_hash: torch.Tensor
    sampling: TokenSampling

    @classmethod
    def build(cls, device: str = "cpu", seed: int = 0) -> ToyPools:
        g = torch.Generator().manual_seed(seed)
        ints = lambda *shape, lo=-3, hi=4: torch.randint(lo, hi, shape, generator=g).float()  # noqa: E731
        table = torch.zeros(MAX_REQS + 1, MAX_CTX, dtype=torch.int32)
        table[:MAX_REQS] = 1 + torch.arange(MAX_REQS * MAX_CTX, dtype=torch.int32).view(
            MAX_REQS, MAX_CTX
        )
        kv = ints(1 + MAX_REQS * MAX_CTX, DIM)
        tensors = (kv, table, ints(VOCAB, DIM), ints(DIM, VOCAB, lo=-2, hi=3))
        kv, table, emb, w = (t.to(device) for t in tensors)
        sampling = TokenSampling.allocate(
            MAX_REQS + 1, device, vocab=VOCAB, mask_words=(VOCAB + 31) // 32
        )
        return cls(kv, table, emb, w, token_hashes(VOCAB, device), sampling)

    def step_pools(self) -> StepPools:
        return StepPools(self.table, self.kv, requests=self.sampling, compute=TorchPath())


class ToyKind:
    """A step kind over the toy pools: ``step`` is what the runner captures."""

    def __init__(self, pools: ToyPools, step: Callable[[StepBatch], StepOutput]) -> None:
        self.pools = pools.step_pools()
        self.step = step
        self.prepared: list[ArtifactKey] = []

    def prepare_capture(self, keys: list[ArtifactKey]) -> None:
        self.prepared += keys


def make_toy_step(pools: ToyPools, scale: float = 1.0) -> Callable[[StepBatch], StepOutput]:
    def toy_step(b: StepBatch) -> StepOutput:
        kv = b.pools.kv
        x = pools.emb[b.input_ids[:, 0]] * (b.positions + 1).float() * scale
        kv.index_copy_(0, b.out_cache_loc[:, 0], x)
        slots = b.pools.req_to_token[b.req_rows, : b.kv_len].long()
        cols = torch.arange(b.kv_len, device=x.device)
        seen = (cols[None, :] <= b.positions).float()
        logits = (kv[slots] * seen[..., None]).sum(1) @ pools.w
        s, rows = b.pools.requests, b.req_rows
        next_ids = sample(
            logits, s.temperature[rows], s.top_k[rows], s.top_p[rows], s.seed[rows], b.out_pos,
            pools.tok_hash, b.top_cap,
        )  # fmt: skip
        return StepOutput(next_ids, logits)

    return toy_step


def runner_for(
    pools: ToyPools, step: Callable[[StepBatch], StepOutput], backend: str, **kw: object
) -> BucketRunner:
    kind = ToyKind(pools, step)
    buckets = kw.pop("buckets", BUCKETS)
    kv_buckets = kw.pop("kv_len_buckets", KV_BUCKETS)
    buffer = CaptureBuffer.init(max(buckets), kind.pools, max(kv_buckets))  # type: ignore[call-overload]
    return BucketRunner(
        kind, buffer, backend=backend, buckets=buckets, kv_len_buckets=kv_buckets, **kw
    )  # type: ignore[arg-type]


def make_inputs(
    pools: ToyPools, n: int, kv_len: int, seed: int, filtered: bool = False
) -> StepBatch:
    """``n`` decode rows of distinct requests; the longest row reads exactly ``kv_len`` keys.
    Each request's sampling goes into its row of the request table, as a step kind's would."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(MAX_REQS, generator=g)[:n]
    prefix = torch.randint(0, kv_len, (n,), generator=g)
    prefix[0] = kv_len - 1
    loc = 1 + rows * MAX_CTX + prefix
    s = pools.sampling
    device = pools.kv.device
    s.temperature[rows] = torch.where(torch.arange(n) % 2 == 0, 0.0, 0.8).to(device)
    s.top_k[rows] = 5 if filtered else VOCAB  # capped at 8
    s.top_p[rows] = 0.9 if filtered else 1.0
    s.seed[rows] = torch.randint(0, 2**32, (n,), generator=g).to(device)
    i64 = dict(dtype=torch.int64, device=device)
    return StepBatch(
        input_ids=torch.randint(0, VOCAB, (n, 1), generator=g).to(device),
        positions=prefix.view(n, 1).clone().to(device),
        out_cache_loc=loc.view(n, 1).to(device),
        req_rows=rows.to(**i64),
        prefix_lens=prefix.to(device),
        extend_lens=torch.ones(n, **i64),
        state_slots=torch.zeros(n, **i64),
        track_slots=torch.zeros(n, **i64),
        out_pos=torch.randint(0, 100, (n,), generator=g).to(device),
        keeps=torch.ones(n, **i64),
        pools=pools.step_pools(),
        kv_len=kv_len,
        is_decode=True,
        top_cap=8 if filtered else 0,
        keep_logits=True,
    )


def assert_same(a: StepOutput, b: StepOutput) -> None:
    assert torch.equal(a.next_ids, b.next_ids)
    assert a.logits is not None and b.logits is not None
    assert torch.equal(a.logits, b.logits)


@pytest.fixture(scope="module")
def pools() -> ToyPools:
    return ToyPools.build()


@pytest.fixture(scope="module")
def eager(pools: ToyPools) -> BucketRunner:
    return runner_for(pools, make_toy_step(pools), "eager")


@pytest.fixture(scope="module")
def compiled(pools: ToyPools) -> BucketRunner:
    return runner_for(pools, make_toy_step(pools), "compile", name="toy")


# -- the capture buffer and buckets (no compiling) -----------------------------------------------
def test_capture_buffer_pads_every_row_beyond_the_batch(pools: ToyPools) -> None:
    buffer = CaptureBuffer.init(4, pools.step_pools(), kv_len=16)
    view = buffer.view(4, kv_len=8)
    CaptureBuffer.copy_from(view, make_inputs(pools, 3, 8, seed=1))
    assert view.req_rows.data_ptr() == buffer.full.req_rows.data_ptr()  # same storage
    for f in ROW_FIELDS:
        pad = PAD_ROW if f.metadata["pad"] < 0 else f.metadata["pad"]
        assert getattr(buffer.full, f.name)[3:].eq(pad).all(), f.name
    assert buffer.full.extend_lens[:3].eq(1).all()


def test_copy_into_the_capture_buffer_is_capture_safe(pools: ToyPools) -> None:
    view = CaptureBuffer.init(4, pools.step_pools(), kv_len=16).view(4, kv_len=16)
    inputs = make_inputs(pools, 3, 8, seed=1)
    check_capture_safe(CaptureBuffer.copy_from, view, inputs)  # no host read of any value
    assert torch.equal(view.out_pos[:3], inputs.out_pos)


def test_views_refuse_what_they_were_not_built_for(pools: ToyPools) -> None:
    view = CaptureBuffer.init(4, pools.step_pools(), kv_len=16).view(2, kv_len=8)
    with pytest.raises(ValueError, match="batch of 3 rows, expected <= 2"):
        CaptureBuffer.copy_from(view, make_inputs(pools, 3, 8, seed=1))
    with pytest.raises(ValueError, match="kv_len 9, expected <= 8"):
        CaptureBuffer.copy_from(view, make_inputs(pools, 2, 9, seed=1))
    with pytest.raises(ValueError, match=r"mode .* \(8, 0, 0\), expected \(0, 0, 0\)"):
        CaptureBuffer.copy_from(view, make_inputs(pools, 2, 8, seed=1, filtered=True))
    greedy = dataclasses.replace(make_inputs(pools, 2, 8, seed=1), features=GREEDY)
    with pytest.raises(ValueError, match=r"mode .* \(0, 0, 1\), expected \(0, 0, 0\)"):
        CaptureBuffer.copy_from(view, greedy)


def test_step_batch_check_names_the_field(pools: ToyPools) -> None:
    bad = dataclasses.replace(
        make_inputs(pools, 2, 8, seed=1), out_pos=torch.zeros(2, dtype=torch.int32)
    )
    with pytest.raises(TypeError, match=r"StepBatch.out_pos: torch.int32, expected an int64"):
        check_batch(bad)
    bad = dataclasses.replace(
        make_inputs(pools, 2, 8, seed=1), positions=torch.zeros(2, dtype=torch.int64)
    )
    with pytest.raises(ValueError, match=r"StepBatch.positions: shape \(2,\), expected \(2, 1\)"):
        check_batch(bad)


def test_buckets(pools: ToyPools) -> None:
    assert kv_len_buckets(1000, multiple=256) == [256, 512, 768, 1000]
    assert kv_len_buckets(100, pow2=True) == [16, 32, 64, 100]
    assert kv_len_buckets(100, multiple=None) == [100]
    assert [pick_bucket((2, 4), n) for n in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, None]
    with pytest.raises(ValueError, match=r"buckets: bucket 0 in \[0, 2\], expected ints >= 1"):
        runner_for(pools, make_toy_step(pools), "compile", buckets=[0, 2], kv_len_buckets=[8])


def test_oversize_eager_fallback_is_counted(pools: ToyPools, eager: BucketRunner) -> None:
    runner = runner_for(pools, make_toy_step(pools), "compile", oversize="eager")
    inputs = make_inputs(pools, 6, 8, seed=2)
    assert_same(runner.run(inputs), eager.run(inputs))
    stats = runner.stats()
    assert (stats["eager_fallbacks"], stats["graph_replays"], stats["captured"]) == (1, 0, [])


# -- compile backend vs the eager oracle --------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "kv_len"), [(1, 5), (2, 8), (3, 3), (4, 8), (1, 9), (4, 16), (5, 12), (9, 16)]
)
def test_compile_equals_eager_across_bucket_edges(
    compiled: BucketRunner, eager: BucketRunner, pools: ToyPools, n: int, kv_len: int
) -> None:
    before = compiled.stats()
    inputs = make_inputs(pools, n, kv_len, seed=n * 100 + kv_len)
    want = eager.run(inputs)
    got = compiled.run(inputs)
    assert_same(got, want)
    after = compiled.stats()
    pieces = -(-n // BUCKETS[-1])
    assert after["graph_replays"] - before["graph_replays"] == pieces
    assert after["split_batches"] - before["split_batches"] == (n > BUCKETS[-1])
    assert (bucket := pick_bucket(BUCKETS, min(n, BUCKETS[-1]))) is not None
    assert (bucket, pick_bucket(KV_BUCKETS, kv_len), 0, 0, False) in after["captured"]
    assert after["recompiles"] == 0


def test_sampling_mode_selects_its_own_artifact(
    compiled: BucketRunner, eager: BucketRunner, pools: ToyPools
) -> None:
    inputs = make_inputs(pools, 3, 6, seed=7, filtered=True)
    assert_same(compiled.run(inputs), eager.run(inputs))
    assert (4, 8, 8, 0, False) in compiled.stats()["captured"]


def test_kv_len_beyond_the_largest_bucket_runs_eager(
    compiled: BucketRunner, eager: BucketRunner, pools: ToyPools
) -> None:
    before = compiled.stats()["eager_fallbacks"]
    inputs = make_inputs(pools, 2, 20, seed=3)
    assert_same(compiled.run(inputs), eager.run(inputs))
    assert compiled.stats()["eager_fallbacks"] == before + 1


def test_padded_rows_write_only_the_sink(compiled: BucketRunner, pools: ToyPools) -> None:
    inputs = make_inputs(pools, 3, 8, seed=4)
    pools.kv[0] = 99.0
    before = pools.kv.clone()
    compiled.run(inputs)  # bucket 4: one padded row
    loc = inputs.out_cache_loc[:, 0]
    changed = (pools.kv != before).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= {0, *loc.tolist()}
    # The padded row is token 0 at position 0: it wrote emb[0] into slot 0 and nowhere else.
    assert torch.equal(pools.kv[0], pools.emb[0])
    want = pools.emb[inputs.input_ids[:, 0]] * (inputs.positions + 1).float()
    assert torch.equal(pools.kv[loc], want)


def test_outputs_survive_the_next_replay(compiled: BucketRunner, pools: ToyPools) -> None:
    first = compiled.run(make_inputs(pools, 3, 8, seed=5))
    assert first.logits is not None
    kept = StepOutput(first.next_ids.clone(), first.logits.clone())
    second = compiled.run(make_inputs(pools, 3, 8, seed=6))
    assert_same(first, kept)
    assert second.logits is not None and not torch.equal(first.logits, second.logits)


@pytest.mark.parametrize("backend", ["compile", "eager"])
def test_on_staged_runs_once_between_staging_and_the_step(
    compiled: BucketRunner, eager: BucketRunner, pools: ToyPools, backend: str
) -> None:
    """Lookahead starts host work in ``on_staged``: inputs staged, the pool not yet written."""
    runner = compiled if backend == "compile" else eager
    inputs = make_inputs(pools, 3, 8, seed=11)
    loc = inputs.out_cache_loc[:, 0]
    pools.kv[loc] = 0.0
    seen: list[bool] = []

    def on_staged() -> None:
        staged = [
            a.static.input_ids[:3].equal(inputs.input_ids) for a in runner._artifacts.values()
        ]
        seen.append(backend == "eager" or any(staged))
        assert not pools.kv[loc].any(), "the step ran before on_staged"

    runner.run(inputs, on_staged)
    assert seen == [True]
    want = pools.emb[inputs.input_ids[:, 0]] * (inputs.positions + 1).float()
    assert torch.equal(pools.kv[loc], want)


def test_no_recompile_over_200_replays(
    compiled: BucketRunner, eager: BucketRunner, pools: ToyPools
) -> None:
    compiled.capture(kv_lens=[8])
    captured = compiled.stats()["captured"]
    before = compiled.stats()["graph_replays"]
    for i in range(200):
        n, kv_len = 1 + i % 4, 1 + (i * 7) % 8  # every batch size and kv_len within kv bucket 8
        inputs = make_inputs(pools, n, kv_len, seed=1000 + i)
        if i % 20 == 0:
            assert_same(compiled.run(inputs), eager.run(inputs))
        else:
            compiled.run(inputs)
    stats = compiled.stats()
    assert stats["graph_replays"] - before == 200
    assert stats["recompiles"] == 0
    assert stats["captured"] == captured


def test_capture_starts_with_the_largest_bucket(compiled: BucketRunner) -> None:
    keys = compiled.capture(kv_lens=[8])
    assert [k.batch for k in keys] == [4, 2]
    assert (4, 8, 0, 0, False) in compiled.stats()["captured"]
    assert compiled.kind.prepared  # the kind heard of each capture before it ran


def test_recompile_is_fatal_and_stays_in_its_runner(
    compiled: BucketRunner, eager: BucketRunner, pools: ToyPools
) -> None:
    knob = {"offset": 1.0}
    base = ToyPools.build(seed=9)

    def drifting_step(b: StepBatch) -> StepOutput:
        # A Python value read by the step: baked into the artifact, guarded by Dynamo.
        return StepOutput(b.input_ids[:, 0], base.emb[b.input_ids[:, 0]] + knob["offset"])

    other = runner_for(
        base, drifting_step, "compile", buckets=[2], kv_len_buckets=[8], name="drift"
    )
    inputs = make_inputs(base, 2, 8, seed=11)
    assert torch.equal(other.run(inputs).logits, base.emb[inputs.input_ids[:, 0]] + 1.0)
    # Interleaved with another runner of another step: neither disturbs the other.
    check = make_inputs(pools, 3, 8, seed=12)
    assert_same(compiled.run(check), eager.run(check))
    assert torch.equal(other.run(inputs).logits, base.emb[inputs.input_ids[:, 0]] + 1.0)
    knob["offset"] = 2.0
    # Guards run on every GUARD_EVERY-th replay: the drift is caught within that many.
    with pytest.raises(RecompileError, match=r"drift: bucket\(batch=2, kv_len=8, .*recompiled"):
        for _ in range(GUARD_EVERY):
            other.run(inputs)
    assert other.stats()["recompiles"] == 1
    assert_same(compiled.run(check), eager.run(check))
    assert compiled.stats()["recompiles"] == 0


def test_warm_replays_run_the_compiled_frame_and_check_guards_periodically() -> None:
    base = ToyPools.build(seed=14)

    def step(b: StepBatch) -> StepOutput:
        return StepOutput(b.input_ids[:, 0], base.emb[b.input_ids[:, 0]] * 2)

    runner = runner_for(base, step, "compile", buckets=[2], kv_len_buckets=[8], name="direct")
    inputs = make_inputs(base, 2, 8, seed=15)
    expected = base.emb[inputs.input_ids[:, 0]] * 2
    assert torch.equal(runner.run(inputs).logits, expected)  # captures and warms up
    (artifact,) = runner._artifacts.values()
    guarded = artifact._compiled
    calls = []
    artifact._compiled = lambda static: calls.append(1) or guarded(static)
    for i in range(2 * GUARD_EVERY):
        other = make_inputs(base, 2, 8, seed=16 + i)
        assert torch.equal(runner.run(other).logits, base.emb[other.input_ids[:, 0]] * 2)
    assert len(calls) == 2  # the guarded path: every GUARD_EVERY-th replay only
    assert runner.stats()["recompiles"] == 0


def test_strict_stance_refuses_the_recompile() -> None:
    knob = {"offset": 1}
    base = ToyPools.build(seed=13)

    def drifting_step(b: StepBatch) -> StepOutput:
        return StepOutput(b.out_pos + knob["offset"])

    view = CaptureBuffer.init(2, base.step_pools(), kv_len=8).view(2, kv_len=8)
    key = ArtifactKey(2, 8)
    step = CompiledStep(drifting_step, view, key, tag="strict", strict_stance=True)
    inputs = make_inputs(base, 2, 8, seed=13)
    CaptureBuffer.copy_from(view, inputs)
    with torch.inference_mode():
        step.warm_up(2)
        assert torch.equal(step.replay().next_ids, inputs.out_pos + 1)
        knob["offset"] = 5
        with pytest.raises(RecompileError, match="refused by fail_on_recompile"):
            step.replay()
    assert step.recompiles == 1
    # The stance was scoped to the replay: compiling elsewhere still works.
    assert torch.compile(lambda x: x * 3, fullgraph=True)(torch.ones(2)).eq(3).all()


# -- cuda_graph backend -------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compile_in_graph", [False, True])
def test_cuda_graph_equals_eager(compile_in_graph: bool) -> None:
    pools = ToyPools.build(device="cuda")
    step = make_toy_step(pools)
    oracle = runner_for(pools, step, "eager")
    graphs = runner_for(pools, step, "cuda_graph", compile_in_graph=compile_in_graph)
    keys = graphs.capture()
    assert keys[0].batch == BUCKETS[-1] and keys[0].kv_len == KV_BUCKETS[-1]
    kept: list[tuple[StepOutput, StepOutput]] = []
    for n, kv_len in [(1, 5), (2, 8), (3, 3), (4, 16), (5, 12), (9, 16)]:
        inputs = make_inputs(pools, n, kv_len, seed=n * 100 + kv_len)
        want = oracle.run(inputs)
        pools.kv[0] = 99.0
        before = pools.kv.clone()
        got = graphs.run(inputs)
        assert_same(got, want)
        changed = (pools.kv != before).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) <= {0}  # eager already wrote the real slots with the same values
        assert got.logits is not None
        kept.append((got, dataclasses.replace(got, logits=got.logits.clone())))
    for got, copy in kept:
        assert_same(got, copy)  # later replays did not overwrite earlier outputs
    stats = graphs.stats()
    assert stats["recompiles"] == 0 and stats["eager_fallbacks"] == 0
    assert stats["split_batches"] == 2


# -- the tiny dense model's decode step ---------------------------------------------------------
@pytest.mark.slow
def test_tiny_llama_decode_compiled_equals_eager(tiny_ckpts) -> None:
    model = load_model(tiny_ckpts["llama"], torch.float32, torch.device("cpu")).model
    max_reqs, max_ctx = 4, 64
    c = model.contract
    kv = KVPool(len(c.kv_windows), 1 + max_reqs * max_ctx, 1, c.kv_heads, c.head_dim,
                torch.float32, "cpu")  # fmt: skip
    r2t = ReqToTokenPool(max_reqs, max_ctx, "cpu")
    for row in range(max_reqs):  # row r, position p -> slot 1 + r * max_ctx + p
        r2t.write(row, 0, 1 + row * max_ctx + torch.arange(max_ctx))
    pools = StepPools(r2t.table, kv, compute=TorchPath())
    kind = TokenStep(model, pools, TorchPath(), 256, max_ctx)  # all-greedy sampling table

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g) for n in (5, 9, 13)]
    n, t = len(prompts), max(len(p) for p in prompts)
    # Prefill eagerly, one padded [n, t] step.
    ids, pos, loc = (torch.zeros(n, t, dtype=torch.int64) for _ in range(3))
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
        pos[i] = torch.arange(t)
        loc[i, : len(p)] = 1 + i * max_ctx + torch.arange(len(p))
    lens = torch.tensor([len(p) for p in prompts])
    zeros = torch.zeros(n, dtype=torch.int64)
    prefill = StepBatch(
        ids, pos, loc, torch.arange(n), zeros, lens, zeros, zeros, zeros, zeros + 1, kind.pools,
        kv_len=t,
    )  # fmt: skip
    with torch.inference_mode():
        tokens = [[int(x)] for x in kind.step(prefill).next_ids]

    common = dict(buckets=[4], kv_len_buckets=[32, 64])
    buffer = CaptureBuffer.init(4, kind.captured_pools, 64)
    eager = BucketRunner(kind, buffer, backend="eager", **common)  # type: ignore[arg-type]
    compiled = BucketRunner(kind, buffer, backend="compile", name="llama", **common)  # type: ignore[arg-type]
    for k in range(6):
        prefix = lens + k
        inputs = StepBatch(
            torch.tensor([ts[-1] for ts in tokens]).view(n, 1), prefix.view(n, 1),
            (1 + torch.arange(n) * max_ctx + prefix).view(n, 1), torch.arange(n), prefix,
            torch.ones(n, dtype=torch.int64), zeros, zeros, zeros + k + 1, zeros + 1, kind.pools,
            kv_len=int(prefix.max()) + 1, is_decode=True, keep_logits=True,
        )  # fmt: skip
        want = eager.run(inputs)
        got = compiled.run(inputs)  # rewrites the same KV slots with the same values
        assert torch.equal(got.next_ids, want.next_ids)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
        for ts, x in zip(tokens, want.next_ids.tolist(), strict=True):
            ts.append(x)
    stats = compiled.stats()
    assert (stats["graph_replays"], stats["recompiles"], stats["captured"]) == (
        6,
        0,
        [(4, 32, 0, 0, 0)],
    )
    # The eager oracle itself: greedy continuation of transformers, by full recomputation.
    hf = load_hf_model(tiny_ckpts["llama"])
    with torch.no_grad():
        for prompt, ts in zip(prompts, tokens, strict=True):
            seq = prompt.tolist()
            for _ in range(len(ts)):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            assert seq[len(prompt) :] == ts
