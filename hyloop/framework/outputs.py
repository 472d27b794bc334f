"""What a request hands back, in vLLM's shapes: ``RequestOutput`` holding one
``CompletionOutput`` per sample, with ``Logprob`` entries. hyloop's additions:
``RequestOutput.num_reused_tokens`` (prompt tokens whose KV came from another offset), of those
``num_recomputed_tokens`` (computed again by selective recompute) and ``CompletionOutput.rows``
(the generated rows of a multi-channel model)."""

from __future__ import annotations

from dataclasses import dataclass, field

# One dict per generated position: token id -> its logprob (the sampled token and the top-k).
SampleLogprobs = list[dict[int, "Logprob"]]


@dataclass
class Logprob:
    """A token's log probability under the raw model distribution (before temperature and
    filters, vLLM's default ``raw_logprobs``); ``rank``: 1 for the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a request. ``finish_reason``: ``stop`` | ``length`` | ``abort`` | ``error``
    (None while running); ``stop_reason``: the stop token id that ended it (None for EOS or a
    length stop); ``error`` (hyloop's): what failed when the finish reason is ``error``."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    rows: list[list[int]] | None = None  # multi-channel models: the generated rows [C] each
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()``) of a request's life, and what speculative decoding
    drafted for it and kept (``speculative``)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's output so far (``finished``: its last one). ``prompt`` is the text prompt (a
    chat rendered with its template) or None for a token prompt; ``num_cached_tokens``: prompt
    tokens served from the exact-prefix cache (exact KV only; approximate KV counts as reused)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    num_reused_tokens: int = 0
    num_recomputed_tokens: int = 0
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    lora_request: None = None
    kv_transfer_params: dict[str, object] | None = field(default=None, repr=False)

    @property
    def error(self) -> str | None:
        """hyloop's: what failed, when a sample finished with reason ``error``."""
        return next((c.error for c in self.outputs if c.error is not None), None)
