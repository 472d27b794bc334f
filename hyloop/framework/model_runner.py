"""Turns a scheduled batch into step inputs, runs the step and returns host-side results.

The step function ``decode_step(model, ctx, sampling)`` is the unit a graph backend captures:
forward, last-token logits, sampling and logprobs, all tensor ops with no host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyloop.framework.batch import Batch
from hyloop.framework.config import GraphsSection
from hyloop.graphs.bucket_runner import BucketRunner
from hyloop.graphs.buckets import kv_len_buckets
from hyloop.graphs.context import StepContext
from hyloop.graphs.ops import row_radix_keys, scatter_track_slots
from hyloop.graphs.sampler import sample, token_hashes
from hyloop.graphs.static_inputs import StepInputs
from hyloop.pools import KVPool, ReqToTokenPool


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [B] f32
    top_k: torch.Tensor  # [B] int64 (vocab size when disabled)
    top_p: torch.Tensor  # [B] f32
    seeds: torch.Tensor  # [B] int64, 32-bit values
    out_pos: torch.Tensor  # [B] int64 index of the token being sampled in the output
    filtered: bool  # static: some row restricts top-k / top-p
    num_logprobs: int  # static: top-k logprobs to return (0 = none)
    greedy_only: bool = False  # static: every row is greedy (eager path only)


@dataclass
class StepOutput:
    next_ids: torch.Tensor  # [B] int64
    logits: torch.Tensor | None  # [B, V] fp32 when asked
    top_lp: torch.Tensor | None  # [B, K] logprobs of the top tokens
    top_ids: torch.Tensor | None  # [B, K]
    chosen_lp: torch.Tensor | None  # [B] logprob of the sampled token
    next_rows: torch.Tensor | None = None  # [B, C] multi-channel models (next_ids: row keys)


def run_step(
    model: nn.Module,
    ctx: StepContext,
    st: SamplingTensors,
    tok_hash: torch.Tensor,
    keep_logits: bool = False,
) -> StepOutput:
    """One forward + sample. Shapes are fixed by ``ctx`` and ``st``: capture-safe."""
    hidden = model(ctx)
    if ctx.recurrent is not None:
        # Publish each row's state into its track slot (rows without a boundary write slot 0).
        for buf in (*ctx.recurrent.temporal, *ctx.recurrent.conv):
            scatter_track_slots(buf, ctx.state_slots, ctx.track_slots)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    last = hidden[rows, ctx.last_index]
    logits = model.compute_logits(last)
    next_rows = None
    if logits.dim() == 3:  # multi-channel rows: sample every channel, key the row
        b, c, _ = logits.shape
        channel = torch.arange(c, device=logits.device).repeat(b)
        next_rows = sample(
            logits.reshape(b * c, -1),
            st.temperature.repeat_interleave(c),
            st.top_k.repeat_interleave(c),
            st.top_p.repeat_interleave(c),
            st.seeds.repeat_interleave(c),
            st.out_pos.repeat_interleave(c) * c + channel,
            tok_hash,
            st.filtered,
            st.greedy_only,
        ).view(b, c)
        next_ids = row_radix_keys(next_rows, model.end_id)
        return StepOutput(next_ids, logits if keep_logits else None, None, None, None, next_rows)
    next_ids = sample(
        logits,
        st.temperature,
        st.top_k,
        st.top_p,
        st.seeds,
        st.out_pos,
        tok_hash,
        st.filtered,
        st.greedy_only,
    )
    top_lp = top_ids = chosen = None
    if st.num_logprobs > 0:
        lp = logits.log_softmax(dim=-1)
        chosen = lp.gather(1, next_ids[:, None]).squeeze(1)
        top_lp, top_ids = lp.topk(st.num_logprobs, dim=-1)
    return StepOutput(next_ids, logits if keep_logits else None, top_lp, top_ids, chosen)


class ModelRunner:
    """Owns the model and pools; builds ``StepContext`` for a batch and runs it eagerly."""

    def __init__(
        self,
        model: nn.Module,
        kv: KVPool,
        req_to_token: ReqToTokenPool,
        vocab_size: int,
        device: torch.device,
        recurrent: object | None = None,
        graphs: GraphsSection | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.req_to_token = req_to_token
        self.vocab_size = vocab_size
        self.device = device
        self.recurrent = recurrent
        self.tok_hash = token_hashes(vocab_size, device)
        channels = (
            getattr(model, "num_channels", None) if getattr(model, "is_row_model", 0) else None
        )
        self.row_shape: tuple[int, ...] = (channels,) if channels else ()
        graphs = graphs or GraphsSection()
        self.backend = resolve_backend(graphs.backend, device)
        self.graph_runner: BucketRunner | None = None
        if self.backend != "eager":
            step = kv_len_buckets(
                req_to_token.max_context,
                multiple=graphs.kv_len_bucket or None,
                pow2=graphs.kv_len_bucket == 0,
            )
            buckets = [b for b in graphs.buckets if b <= req_to_token.max_requests]
            self.graph_runner = BucketRunner(
                self._graph_step,
                backend=self.backend,  # type: ignore[arg-type]
                buckets=buckets or [req_to_token.max_requests],
                kv_len_buckets=step,
                device=device,
                padding_row=req_to_token.padding_row,
                channels=channels,
                oversize=graphs.oversize,
                compile_in_graph=graphs.compile_in_graph,
                compile_options=graphs.compile_options,
                name=f"decode-{type(model).__name__}-{id(self):x}",
            )

    # -- inputs ---------------------------------------------------------------------------------
    def build_context(self, batch: Batch) -> StepContext:
        if batch.is_decode:  # the same inputs a captured step gets
            inputs = self.decode_inputs(batch)
            return inputs.to_context(self.req_to_token.table, self.kv, self.recurrent)
        chunks = batch.chunks
        b = len(chunks)
        t = max(c.length for c in chunks)
        ids = torch.zeros(b, t, *self.row_shape, dtype=torch.int64)
        pos = torch.zeros(b, t, dtype=torch.int64)
        loc = torch.zeros(b, t, dtype=torch.int64)
        limit = self.req_to_token.max_context - 1
        for i, c in enumerate(chunks):
            req = c.req
            if req.prompt_rows is not None:
                ids[i, : c.length] = req.rows_at(c.start, c.length)
            else:
                tokens = req.all_ids[c.start : c.start + c.length]
                ids[i, : c.length] = torch.tensor(tokens, dtype=torch.int64)
            pos[i] = torch.arange(c.start, c.start + t).clamp_max(limit)
            loc[i, : c.length] = req.slots[c.start : c.start + c.length]
        return self._context(batch, ids, pos, loc)

    def _context(
        self, batch: Batch, ids: torch.Tensor, pos: torch.Tensor, loc: torch.Tensor
    ) -> StepContext:
        chunks = batch.chunks
        h2d = self.to_device
        i64 = torch.int64
        prefix = [c.start for c in chunks]
        ext = [c.length for c in chunks]
        return StepContext(
            input_ids=h2d(ids),
            positions=h2d(pos),
            out_cache_loc=h2d(loc),
            req_rows=h2d(torch.tensor([c.req.req_row for c in chunks], dtype=i64)),
            prefix_lens=h2d(torch.tensor(prefix, dtype=i64)),
            extend_lens=h2d(torch.tensor(ext, dtype=i64)),
            req_to_token=self.req_to_token.table,
            kv_len=max(p + e for p, e in zip(prefix, ext, strict=True)),
            kv=self.kv,
            recurrent=self.recurrent,
            state_slots=h2d(torch.tensor([c.req.state_slot for c in chunks], dtype=i64)),
            track_slots=h2d(torch.tensor([c.track_slot for c in chunks], dtype=i64)),
            is_decode=batch.is_decode,
        )

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the step's device. On CUDA the copy goes through pinned memory and
        is queued on the current stream, so preparing step N+2 never waits for step N+1.
        A tensor already on the device is returned as it is."""
        if self.device.type != "cuda" or host.device.type == "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _sampling_rows(self, batch: Batch) -> tuple[list[list[float]], list[list[int]], bool, int]:
        """Per-row sampling values: ``[temperature, top_p]`` floats, ``[top_k, seed, out_pos]``
        ints (one list per field), whether any row filters, and the logprobs to return."""
        temps, topp, topk, seeds, outpos = [], [], [], [], []
        filtered, nlp = False, 0
        for c in batch.chunks:
            p = c.req.params
            temps.append(p.temperature)
            topk.append(self.vocab_size if p.top_k == -1 else min(p.top_k, self.vocab_size))
            topp.append(p.top_p)
            seeds.append(c.req.seed32)
            outpos.append(c.out_pos if c.out_pos >= 0 else len(c.req.output_ids))
            filtered = filtered or p.needs_filter
            if p.logprobs is not None:
                nlp = max(nlp, p.logprobs, 1)
        return [temps, topp], [topk, seeds, outpos], filtered, min(nlp, self.vocab_size)

    def build_sampling(self, batch: Batch) -> SamplingTensors:
        (temps, topp), (topk, seeds, outpos), filtered, nlp = self._sampling_rows(batch)
        h2d = self.to_device
        return SamplingTensors(
            temperature=h2d(torch.tensor(temps, dtype=torch.float32)),
            top_k=h2d(torch.tensor(topk, dtype=torch.int64)),
            top_p=h2d(torch.tensor(topp, dtype=torch.float32)),
            seeds=h2d(torch.tensor(seeds, dtype=torch.int64)),
            out_pos=h2d(torch.tensor(outpos, dtype=torch.int64)),
            filtered=filtered,
            num_logprobs=nlp,
            greedy_only=all(t == 0 for t in temps),
        )

    def graph_stats(self) -> dict[str, int]:
        if self.graph_runner is None:
            return _no_graph_stats()
        st = self.graph_runner.stats()
        return {k: st[k] for k in ("graph_replays", "eager_fallbacks", "recompiles")}

    def capture_seconds(self) -> float:
        """Seconds spent capturing (compiling) artifacts so far."""
        return self.graph_runner.capture_seconds if self.graph_runner is not None else 0.0

    def graph_report(self) -> dict[str, object]:
        return self.graph_runner.stats() if self.graph_runner is not None else {}

    # -- captured decode ------------------------------------------------------------------------
    def _graph_step(self, inputs: StepInputs) -> dict[str, torch.Tensor]:
        """The unit a backend captures: one decode step over static inputs."""
        ctx = inputs.to_context(self.req_to_token.table, self.kv, self.recurrent)
        st = SamplingTensors(
            inputs.temperature,
            inputs.top_k,
            inputs.top_p,
            inputs.seeds,
            inputs.out_pos,
            inputs.filtered,
            inputs.num_logprobs,
        )
        out = run_step(self.model, ctx, st, self.tok_hash, keep_logits=True)
        return {k: v for k, v in vars(out).items() if v is not None}

    def decode_inputs(self, batch: Batch) -> StepInputs:
        """A captured decode step's inputs. Every per-row int goes to the device in one tensor
        and every float in another (fields are its rows: contiguous views), so a step costs two
        host-to-device copies, not one per field; the new tokens' KV slots are then gathered
        from the req->token table on the device."""
        chunks = batch.chunks
        floats, sampling_ints, filtered, nlp = self._sampling_rows(batch)
        pos = [c.start for c in chunks]
        ints = [
            pos,
            [c.req.req_row for c in chunks],
            [c.req.state_slot for c in chunks],
            [c.track_slot for c in chunks],
            [1] * len(chunks),  # extend lens
            *sampling_ints,  # top_k, seeds, out_pos
        ]
        if batch.input_ids is None and not self.row_shape:
            ints.append([c.req.output_ids[-1] for c in chunks])
        packed = self.to_device(torch.tensor(ints, dtype=torch.int64))
        f32 = self.to_device(torch.tensor(floats, dtype=torch.float32))
        positions, rows = packed[0], packed[1]
        if batch.input_ids is not None:
            ids = batch.input_ids.view(-1, 1, *self.row_shape)  # on the device (lookahead)
        elif self.row_shape:
            rows_out = [c.req.output_rows[-1] for c in chunks]
            ids = self.to_device(torch.tensor(rows_out, dtype=torch.int64))
            ids = ids.view(-1, 1, *self.row_shape)
        else:
            ids = packed[8].view(-1, 1)
        return StepInputs(
            input_ids=ids,
            positions=positions.view(-1, 1),
            out_cache_loc=self.req_to_token.table[rows, positions].to(torch.int64).view(-1, 1),
            req_rows=rows,
            prefix_lens=positions,
            extend_lens=packed[4],
            state_slots=packed[2],
            track_slots=packed[3],
            temperature=f32[0],
            top_k=packed[5],
            top_p=f32[1],
            seeds=packed[6],
            out_pos=packed[7],
            kv_len=max(pos) + 1,
            filtered=filtered,
            num_logprobs=nlp,
        )

    # -- run ------------------------------------------------------------------------------------
    def prepare(self, batch: Batch) -> Any:
        """Host work of a step: its inputs as device tensors (captured decode or eager)."""
        if batch.is_decode and self.graph_runner is not None:
            return self.decode_inputs(batch)
        return self.build_context(batch), self.build_sampling(batch)

    def bind_input_ids(self, prepared: Any, ids: torch.Tensor) -> Any:
        """Set the input ids (``[B]`` or ``[B, C]``, on device) of a prepared decode step."""
        ids = ids.view(-1, 1, *self.row_shape)
        if isinstance(prepared, StepInputs):
            prepared.input_ids = ids
        else:
            prepared[0].input_ids = ids  # (StepContext, SamplingTensors)
        return prepared

    @torch.inference_mode()
    def execute(
        self,
        prepared: Any,
        keep_logits: bool = False,
        on_staged: Callable[[], None] | None = None,
    ) -> StepOutput:
        """Run a prepared step; ``on_staged`` is called once its inputs are staged, just before
        the model runs (lookahead starts its host work there)."""
        if isinstance(prepared, StepInputs):
            assert self.graph_runner is not None
            drop = () if keep_logits else ("logits",)
            out = self.graph_runner.run(prepared, on_staged, drop)
            return StepOutput(
                next_ids=out["next_ids"],
                logits=out.get("logits") if keep_logits else None,
                top_lp=out.get("top_lp"),
                top_ids=out.get("top_ids"),
                chosen_lp=out.get("chosen_lp"),
                next_rows=out.get("next_rows"),
            )
        ctx, st = prepared
        if on_staged is not None:
            on_staged()
        return run_step(self.model, ctx, st, self.tok_hash, keep_logits)

    def run(self, batch: Batch, keep_logits: bool = False) -> StepOutput:
        return self.execute(self.prepare(batch), keep_logits)

    def close(self) -> None:
        self.graph_runner = None


def _no_graph_stats() -> dict[str, int]:
    return {"graph_replays": 0, "eager_fallbacks": 0, "recompiles": 0}


def resolve_backend(name: str, device: torch.device) -> str:
    """``auto``: CUDA graphs on a GPU, ``torch.compile`` per bucket on CPU."""
    if name == "auto":
        return "cuda_graph" if device.type == "cuda" else "compile"
    if name == "cuda_graph" and device.type != "cuda":
        raise ValueError(f"graphs.backend=cuda_graph needs a CUDA device, got device={device}")
    return name
