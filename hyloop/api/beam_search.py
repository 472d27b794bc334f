"""Beam search (vLLM's ``LLM.beam_search``), run as batches of one-token requests.

Each step is one batch: every live beam becomes a request whose prompt is its whole sequence
(the prompt, then the beam's tokens) and which asks for one token and its ``2 * beam_width``
top logprobs. Each token of that entry extends the beam into a candidate; a candidate ending in
EOS (unless ``ignore_eos``) is finished, and of the rest a prompt's ``beam_width`` best by score
live on. After ``max_tokens`` steps the finished and the live beams are ranked together and the
``beam_width`` best returned, best first.

KV: a beam's parent sequence was the previous step's prompt, so the radix tree holds its KV and
the beam's request computes one position; beams with a common prefix read the same tree pages
(nothing is copied). With ``cache.enable=false`` every step recomputes each whole sequence: the
same beams, only slower.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from hyloop.framework.outputs import Logprob, RequestOutput
from hyloop.framework.prompts import cache_salt
from hyloop.framework.sampling_params import (
    NotSupportedError,
    RequestOutputKind,
    SamplingParams,
    is_integer,
    is_number,
)

if TYPE_CHECKING:
    from hyloop.framework.engine import Engine

log = logging.getLogger(__name__)


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters.

    Beams are ranked by ``cum_logprob / length ** length_penalty`` (``get_beam_search_score``).
    ``temperature`` 0 expands each beam from its top logprobs alone; above 0 each step's token
    is also drawn, and joins the candidates. ``include_stop_str_in_output`` is taken for vLLM's
    signature (beam search has no stop strings); ``structured_outputs`` must stay None.
    Checked by ``validate`` when a search starts.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: Any = None

    def validate(self, where: str = "params", max_logprobs: int | None = None) -> None:
        def bad(name: str, value: object, expected: str) -> ValueError:
            return ValueError(f"{where}.{name}: got {value!r}; expected {expected}")

        if not is_integer(self.beam_width) or self.beam_width < 1:
            raise bad("beam_width", self.beam_width, "an int >= 1")
        if max_logprobs is not None and 2 * self.beam_width > max_logprobs:
            raise bad(
                "beam_width",
                self.beam_width,
                f"at most {max_logprobs // 2} (each step asks for 2 * beam_width logprobs, "
                f"and model.max_logprobs={max_logprobs})",
            )
        if not is_integer(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an int >= 1")
        if not is_number(self.temperature) or not self.temperature >= 0.0:
            raise bad("temperature", self.temperature, "a float >= 0")
        if not is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise bad("length_penalty", self.length_penalty, "a finite float")
        for flag in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, getattr(self, flag), "a bool")
        if self.structured_outputs is not None:
            raise NotSupportedError(f"{where}.structured_outputs: not supported by beam search")


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt's ids, then the beam's; ``logprobs`` one entry
    per beam token (the whole top-logprobs entry it was chosen from). ``text`` (the decoded
    ``tokens``, prompt included) and ``finish_reason`` (``stop``: it ended in EOS; ``length``:
    ``max_tokens`` or the context limit) are set on the returned beams."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    multi_modal_data: Any = None
    mm_processor_kwargs: dict[str, Any] | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first: ``beam_width`` of them, or fewer when fewer ever
    existed."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """The search state of one prompt: its live ``beams`` and its ``completed`` ones."""

    def __init__(
        self,
        prompt_tokens: list[int],
        lora_request: Any = None,
        logprobs: list[dict[int, Logprob]] | None = None,
        **kwargs: Any,
    ) -> None:
        first = BeamSearchSequence(
            tokens=list(prompt_tokens),
            logprobs=list(logprobs or []),
            lora_request=lora_request,
            **kwargs,
        )
        self.beams: list[BeamSearchSequence] = [first]
        self.completed: list[BeamSearchSequence] = []
        self.cache_salt: str | None = None  # the prompt's, for every beam's request


def get_beam_search_score(
    tokens: list[int],
    cumulative_logprob: float,
    eos_token_id: int | Collection[int] | None,
    length_penalty: float = 1.0,
) -> float:
    """``cumulative_logprob / length ** length_penalty``, the length counting every token
    (the prompt's too) but a final EOS."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    length = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    return cumulative_logprob / (length**length_penalty)


def create_sort_beams_key_function(
    eos_token_id: int | Collection[int] | None, length_penalty: float
) -> Callable[[BeamSearchSequence], float]:
    """A sort key ranking beams by ``get_beam_search_score`` (sort it with reverse=True)."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else frozenset(eos_token_id or ())

    def key(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos, length_penalty)

    return key


class BeamSearch:
    """One ``beam_search`` call over ``engine``; its request ids start with ``tag``."""

    def __init__(self, engine: Engine, params: BeamSearchParams, tag: str) -> None:
        if not isinstance(params, BeamSearchParams):
            raise ValueError(
                f"beam_search(): params of type {type(params).__name__}; expected a "
                "BeamSearchParams"
            )
        params.validate("beam_search params", engine.cfg.model.max_logprobs)
        if engine.derived.row_channels:
            raise NotSupportedError("beam_search(): multi-channel row models are not supported")
        if not engine.cache.reuses:
            log.warning(
                "beam_search: the prefix cache is off (cache.enable=false), so each step "
                "recomputes every beam's whole sequence"
            )
        self.engine = engine
        self.params = params
        self.tag = tag
        self.eos = frozenset() if params.ignore_eos else engine.eos_ids
        self.sort_key = create_sort_beams_key_function(engine.eos_ids, params.length_penalty)
        self.step_params = SamplingParams(
            max_tokens=1,
            logprobs=2 * params.beam_width,
            temperature=params.temperature,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        tok = engine.tokenizer
        primary = getattr(tok, "eos_token_id", None) if tok is not None else None
        ids = engine.derived.eos_token_ids
        self.primary_eos = primary if primary is not None else (ids[0] if ids else None)
        self._steps = 0

    def run(
        self,
        prompts: list[Any],
        use_tqdm: bool | Callable[..., Any] = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """The best beams of each prompt (``LLM.beam_search``'s, as a list), in prompt order;
        ``concurrency_limit`` prompts are searched at a time (None: all at once)."""
        limit = concurrency_limit
        if limit is not None and (not is_integer(limit) or limit < 1):
            raise ValueError(
                f"beam_search(): concurrency_limit: got {limit!r}; expected None or an int >= 1"
            )
        instances = []
        for i, p in enumerate(prompts):
            where = f"beam_search prompts[{i}]"
            instances.append(BeamSearchInstance(self.engine.validate_prompt(where, p)))
            instances[-1].cache_salt = cache_salt(where, p)
        limit = limit or max(1, len(instances))
        groups = [instances[i : i + limit] for i in range(0, len(instances), limit)]
        steps = self.params.max_tokens
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(
            total=len(groups) * steps, desc="beam search", unit="step", disable=not use_tqdm
        )
        try:
            for group in groups:
                done = 0
                while done < steps and self._step(group):
                    done += 1
                    bar.update(1)
                bar.update(steps - done)  # a group whose beams all ended early
        finally:
            bar.close()
        return [self._output(inst) for inst in instances]

    def _step(self, group: list[BeamSearchInstance]) -> bool:
        """Extend each live beam of ``group`` by one token; False when none was left."""
        room = self.engine.max_context
        for inst in group:  # a beam at the context limit can take no more tokens
            for beam in inst.beams:
                if len(beam.tokens) >= room:
                    beam.finish_reason = "length"
                    inst.completed.append(beam)
            inst.beams = [b for b in inst.beams if len(b.tokens) < room]
        live = [(g, beam) for g, inst in enumerate(group) for beam in inst.beams]
        if not live:
            return False
        outputs = self._expand([(beam.tokens, group[g].cache_salt) for g, beam in live])
        candidates: list[list[BeamSearchSequence]] = [[] for _ in group]
        for (g, beam), out in zip(live, outputs, strict=True):
            entry = out.outputs[0].logprobs if out is not None else None
            if not entry:  # aborted: the beam is dropped
                continue
            for tok, lp in entry[0].items():
                child = BeamSearchSequence(
                    tokens=[*beam.tokens, tok],
                    logprobs=[*beam.logprobs, entry[0]],
                    lora_request=beam.lora_request,
                    cum_logprob=beam.cum_logprob + lp.logprob,
                    multi_modal_data=beam.multi_modal_data,
                    mm_processor_kwargs=beam.mm_processor_kwargs,
                )
                if tok in self.eos:
                    child.finish_reason = "stop"
                    child.stop_reason = None if tok == self.primary_eos else tok
                    group[g].completed.append(child)
                else:
                    candidates[g].append(child)
        width = self.params.beam_width
        for inst, cands in zip(group, candidates, strict=True):
            inst.beams = sorted(cands, key=self.sort_key, reverse=True)[:width]
        return True

    def _expand(self, seqs: list[tuple[list[int], str | None]]) -> list[RequestOutput | None]:
        """One token and its top logprobs for each sequence (with its cache salt), as one batch
        of requests."""
        engine = self.engine
        ids = [f"{self.tag}-{self._steps}-{i}" for i in range(len(seqs))]
        self._steps += 1
        pending = set(ids)
        outs: dict[str, RequestOutput] = {}
        try:
            for rid, (seq, salt) in zip(ids, seqs, strict=True):
                prompt = seq if salt is None else {"prompt_token_ids": seq, "cache_salt": salt}
                engine.add_request(rid, prompt, self.step_params)
            while len(outs) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        outs[out.request_id] = out
        finally:  # an error (or an interrupt) leaves nothing of this step running
            engine.abort_request([rid for rid in ids if rid not in outs])
        return [outs.get(rid) for rid in ids]

    def _output(self, inst: BeamSearchInstance) -> BeamSearchOutput:
        for beam in inst.beams:
            beam.finish_reason = "length"
        ranked = sorted([*inst.completed, *inst.beams], key=self.sort_key, reverse=True)
        best = ranked[: self.params.beam_width]
        tok = self.engine.tokenizer
        for beam in best:
            beam.text = tok.decode(beam.tokens) if tok is not None else None
        return BeamSearchOutput(sequences=best)
