"""Per-request sampling parameters (vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` is greedy; ``top_k == -1`` and ``top_p == 1.0`` disable those filters;
    ``seed`` fixes the request's noise (same seed, same tokens, whatever else is batched);
    ``ignore_eos`` keeps generating past EOS (EOS stays an ordinary, sampleable token);
    ``logprobs = k`` returns the top-k ``{token_id: logprob}`` of each generated position;
    ``output_kind``: ``cumulative`` makes ``Engine.step()`` return the request's output so far
    at every step (streaming); ``final_only`` returns only its finished output, and spares the
    host a copy of the output per running request per step (``LLM.generate`` uses it).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] | None = field(default=None)
    ignore_eos: bool = False
    logprobs: int | None = None
    output_kind: Literal["cumulative", "final_only"] = "cumulative"

    def validate(self, where: str = "sampling_params") -> None:
        def bad(name: str, value: object, expected: str) -> ValueError:
            return ValueError(f"{where}.{name}: got {value!r}; expected {expected}")

        def number(value: object) -> bool:
            return isinstance(value, int | float) and not isinstance(value, bool)

        def integer(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not integer(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an int >= 1")
        if not number(self.temperature) or not self.temperature >= 0.0:
            raise bad("temperature", self.temperature, "a float >= 0")
        if not number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "a float in (0, 1]")
        if not integer(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", self.top_k, "-1 (disabled) or an int >= 1")
        if self.seed is not None and not integer(self.seed):
            raise bad("seed", self.seed, "an int or None")
        if self.logprobs is not None and (not integer(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "None or an int >= 0")
        if self.output_kind not in ("cumulative", "final_only"):
            raise bad("output_kind", self.output_kind, "'cumulative' or 'final_only'")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "a bool")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, list | tuple)
            or not all(integer(t) for t in self.stop_token_ids)
        ):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of ints")

    @property
    def needs_filter(self) -> bool:
        return self.temperature > 0 and (self.top_k != -1 or self.top_p < 1.0)
