"""Input builders: a scheduled ``Batch`` -> the device tensors one step reads.

Decode steps get ``StepInputs`` (what a captured step copies into its static buffers; an eager
decode step reads the same tensors through ``StepInputs.to_context``). Prefill chunks get a
``StepContext`` of ``[B, T]`` rows. Both get ``SamplingTensors``.
"""

from __future__ import annotations

import torch

from hyloop.framework.batch import Batch
from hyloop.framework.sampling_params import SamplingParams
from hyloop.framework.step_fn import SamplingTensors
from hyloop.graphs.context import StepContext
from hyloop.graphs.sampler import candidate_cap
from hyloop.graphs.static_inputs import StepInputs
from hyloop.pools import KVPool, RecurrentPool, ReqToTokenPool


class InputBuilder:
    def __init__(
        self,
        req_to_token: ReqToTokenPool,
        kv: KVPool,
        recurrent: RecurrentPool | None,
        vocab_size: int,
        device: torch.device,
        row_shape: tuple[int, ...],
    ) -> None:
        self.req_to_token = req_to_token
        self.kv = kv
        self.recurrent = recurrent
        self.vocab_size = vocab_size
        self.device = device
        self.row_shape = row_shape  # (C,) for multi-channel rows, () for tokens

    @staticmethod
    def filter_group(params: SamplingParams) -> tuple[float, int, float]:
        """``(temperature, top_k, top_p)`` of the distribution whose filters size the step's
        sampler (``sampler.candidate_cap``); a step kind that samples another way overrides it."""
        return (params.temperature, params.top_k, params.top_p)

    @staticmethod
    def samples(params: SamplingParams) -> bool:
        """Whether the request draws from noise at all (else it is greedy)."""
        return params.temperature > 0

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the step's device. On CUDA the copy goes through pinned memory and
        is queued on the current stream, so preparing step N+2 never waits for step N+1.
        A tensor already on the device is returned as it is."""
        if self.device.type != "cuda" or host.device.type == "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def context(self, inputs: StepInputs) -> StepContext:
        return inputs.to_context(self.req_to_token.table, self.kv, self.recurrent)

    # -- decode ---------------------------------------------------------------------------------
    def decode(self, batch: Batch) -> StepInputs:
        """A decode step's inputs. Every per-row int goes to the device in one tensor and every
        float in another (fields are its rows: contiguous views), so a step costs two
        host-to-device copies, not one per field; the new tokens' KV slots are then gathered
        from the req->token table on the device."""
        chunks = batch.chunks
        floats, sampling_ints, top_cap, nlp = self._sampling_rows(batch)
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
            rows_out = [c.req.output_rows[-1] for c in chunks]  # type: ignore[index]
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
            top_cap=top_cap,
            num_logprobs=nlp,
        )

    # -- prefill --------------------------------------------------------------------------------
    def prefill(self, batch: Batch) -> tuple[StepContext, SamplingTensors]:
        """Chunks of ``[B, T]`` rows (padded to the longest chunk) and their sampling."""
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
            loc[i, : c.length] = req.slots[c.start : c.start + c.length]  # type: ignore[index]
        h2d = self.to_device
        per_row = torch.tensor(
            [
                [c.req.req_row for c in chunks],
                [c.start for c in chunks],
                [c.length for c in chunks],
                [c.req.state_slot for c in chunks],
                [c.track_slot for c in chunks],
            ],
            dtype=torch.int64,
        )
        rows, prefix, ext, state, track = h2d(per_row)
        ctx = StepContext(
            input_ids=h2d(ids),
            positions=h2d(pos),
            out_cache_loc=h2d(loc),
            req_rows=rows,
            prefix_lens=prefix,
            extend_lens=ext,
            req_to_token=self.req_to_token.table,
            kv_len=max(c.start + c.length for c in chunks),
            kv=self.kv,
            recurrent=self.recurrent,
            state_slots=state,
            track_slots=track,
            is_decode=False,
        )
        (temps, topp), (topk, seeds, outpos), top_cap, nlp = self._sampling_rows(batch)
        f32 = h2d(torch.tensor([temps, topp], dtype=torch.float32))
        i64 = h2d(torch.tensor([topk, seeds, outpos], dtype=torch.int64))
        sampling = SamplingTensors(
            f32[0], i64[0], f32[1], i64[1], i64[2], top_cap, nlp, self.greedy_only(batch)
        )
        return ctx, sampling

    # -- sampling -------------------------------------------------------------------------------
    def _sampling_rows(self, batch: Batch) -> tuple[list[list[float]], list[list[int]], int, int]:
        """Per-row sampling values: ``[temperature, top_p]`` floats, ``[top_k, seed, out_pos]``
        ints (one list per field), the sampler's candidate cap and the logprobs to return."""
        temps, topp, topk, seeds, outpos = [], [], [], [], []
        nlp = 0
        for c in batch.chunks:
            p = c.req.params
            temps.append(p.temperature)
            topk.append(self.vocab_size if p.top_k == -1 else min(p.top_k, self.vocab_size))
            topp.append(p.top_p)
            seeds.append(c.req.seed32)
            outpos.append(c.out_pos if c.out_pos >= 0 else len(c.req.output_ids))
            if p.logprobs is not None:
                nlp = max(nlp, p.logprobs, 1)
        groups = (self.filter_group(c.req.params) for c in batch.chunks)
        cap = candidate_cap(groups, self.vocab_size)
        return [temps, topp], [topk, seeds, outpos], cap, min(nlp, self.vocab_size)

    def greedy_only(self, batch: Batch) -> bool:
        return not any(self.samples(c.req.params) for c in batch.chunks)
