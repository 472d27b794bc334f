"""Structured outputs: a request's grammar (``features.grammar``) as each step's token mask.

The host writes a request's allowed next tokens into its row of an int32 bitmask (bit ``t`` of
word ``t // 32``; -1 allows all) when it takes the row and after each resolved token
(``advance``); the step masks the logits with it first (vLLM's order). Under lookahead step N+1
is launched before step N is resolved, so ``apply`` begins with the wait: ``_await_masks``
blocks on the feature's gate (closed by ``run_ahead``, opened by ``settle`` once step N has
advanced the grammars), and on CPU the resolve thread's grammar work overlaps N+1's forward.

NOTE: a CUDA graph replays device work only, never this wait; on CUDA the pipeline does not
launch a step ahead of its masks (``host_fed``: it drains instead), and the gate stays open.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from hyloop.features.base import Feature, RequestContext
from hyloop.graphs.request_table import column

if TYPE_CHECKING:
    from hyloop.framework.requests import Request
    from hyloop.framework.sampling_params import SamplingParams
    from hyloop.graphs.step_batch import StepBatch

# The gates by id: a custom op takes no Python object, so the step names its gate by an int.
_GATES: weakref.WeakValueDictionary[int, threading.Event] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)
WAIT_LIMIT_S = 120.0  # a gate closed this long means its release path was lost


# An op the compiler keeps opaque: a captured step calls it, and the wait happens there.
@torch.library.custom_op("hyloop::await_token_masks", mutates_args=())
def _await_masks(table: torch.Tensor, rows: torch.Tensor, gate: int) -> torch.Tensor:
    event = _GATES.get(gate)
    if event is not None and not event.wait(WAIT_LIMIT_S):
        raise RuntimeError(
            f"token masks: a step waited {WAIT_LIMIT_S:.0f} s for its masks and they were "
            "never released (a resolve that raised, or a gate closed without one)"
        )
    return table.index_select(0, rows)


@_await_masks.register_fake
def _(table: torch.Tensor, rows: torch.Tensor, gate: int) -> torch.Tensor:
    return table.new_empty((rows.shape[0], *table.shape[1:]))


class StructuredOutputs(Feature):
    name = "structured_outputs"
    fields = {"structured_outputs": None, "guided_decoding": None}
    flag = "masked"
    shares_artifact = False  # its wait and host-written rows stay out of the other artifacts
    host_fed = True
    columns = {"grammar": column(torch.int32, -1, shape=("mask_words",))}

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device)
        ids = torch.arange(vocab_size, device=device)
        self.mask_word, self.mask_bit = ids // 32, (ids % 32).to(torch.int32)
        self.gate, self.gate_id = threading.Event(), next(_IDS)  # open unless a step runs ahead
        self.gate.set()
        _GATES[self.gate_id] = self.gate
        self._tokenizer: Any = None  # llguidance's view of the tokenizer, built on first use

    @classmethod
    def validate(cls, p: SamplingParams, where: str) -> None:
        """Checks the constraint and compiles its grammar (cached); a dict becomes a
        ``StructuredOutputsParams``, and the old name ``guided_decoding`` moves there."""
        so, gd = p.structured_outputs, p.guided_decoding
        if so is None and gd is None:
            return
        if so is not None and gd is not None:
            raise ValueError(
                f"{where}.guided_decoding: the old name of structured_outputs; set one, not both"
            )
        # llguidance's import takes ~0.1 s, and these import the params module
        from hyloop.features.grammar import compile_grammar
        from hyloop.features.structured_params import as_structured

        name = f"{where}.{'structured_outputs' if so is not None else 'guided_decoding'}"
        params = as_structured(so if so is not None else gd, name)
        compile_grammar(params, name)
        # NOTE: the engine reads structured_outputs only; the alias is folded into it here.
        p.structured_outputs, p.guided_decoding = params, None

    def dims(self) -> dict[str, int]:
        return {"mask_words": (self.vocab_size + 31) // 32}

    def attach(self, req: Request, ctx: RequestContext, where: str) -> Any:
        p = req.params
        if p.structured_outputs is None:
            return None
        from hyloop.features.grammar import GrammarMatcher, grammar_tokenizer

        if ctx.tokenizer is None or req.prompt_rows is not None:
            raise ValueError(f"{where}.structured_outputs: the model has no tokenizer")
        if self._tokenizer is None:
            eos = sorted(ctx.eos_ids)
            self._tokenizer = grammar_tokenizer(ctx.tokenizer, ctx.vocab_size, eos)
        return GrammarMatcher(p.structured_outputs, self._tokenizer, f"{where}.structured_outputs")

    def take(self, table: Any, row: int, state: Any) -> None:
        state.fill_bitmask(table.grammar, row)

    def apply(self, logits: torch.Tensor, table: Any, batch: StepBatch) -> torch.Tensor:
        bitmask = _await_masks(table.grammar, batch.req_rows, self.gate_id)  # the wait
        allowed = (bitmask[:, self.mask_word] >> self.mask_bit) & 1
        return logits.masked_fill(allowed == 0, -torch.inf)

    def advance(self, table: Any, row: int, state: Any, token: int) -> None:
        state.accept(token)
        state.fill_bitmask(table.grammar, row)

    def run_ahead(self, batch: StepBatch) -> None:
        if batch.features & self.bit and self.device.type != "cuda":
            self.gate.clear()  # opened once the step before it is resolved (``settle``)

    def settle(self) -> None:
        self.gate.set()
