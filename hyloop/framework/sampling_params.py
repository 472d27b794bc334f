"""Per-request sampling parameters (vLLM-shaped), and the per-group ones of a frame model."""

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
    at every step (streaming); ``delta`` returns only what is new since its last output (token
    ids, rows and logprobs; the finished output too); ``final_only`` returns only its finished
    output, and spares the host a copy of the output per running request per step
    (``LLM.generate`` uses it). ``frame``: the per-group sampling of a frame (TTS) model, which
    then samples from it and not from ``temperature`` / ``top_p`` / ``top_k``.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] | None = field(default=None)
    ignore_eos: bool = False
    logprobs: int | None = None
    output_kind: Literal["cumulative", "delta", "final_only"] = "cumulative"
    frame: FrameSamplingParams | None = None

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
        if self.output_kind not in ("cumulative", "delta", "final_only"):
            raise bad("output_kind", self.output_kind, "'cumulative', 'delta' or 'final_only'")
        if self.frame is not None:
            if not isinstance(self.frame, FrameSamplingParams):
                raise bad("frame", self.frame, "a FrameSamplingParams or None")
            self.frame.validate(f"{where}.frame")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "a bool")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, list | tuple)
            or not all(integer(t) for t in self.stop_token_ids)
        ):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of ints")


@dataclass(frozen=True)
class FrameSamplingParams:
    """Sampling of a frame's two channel groups: the text/stop channel and the audio codes.

    Temperature 0 is greedy for that group; ``top_k == -1`` and ``top_p == 1.0`` disable those
    filters. ``audio_repetition_penalty`` (1.0: off) divides a positive (multiplies a negative)
    logit of a code that channel produced in the request's last ``repetition_window`` frames.
    """

    text_temperature: float = 1.0
    text_top_p: float = 1.0
    text_top_k: int = 50
    audio_temperature: float = 1.7
    audio_top_p: float = 0.8
    audio_top_k: int = 25
    audio_repetition_penalty: float = 1.0
    repetition_window: int = 32

    def validate(self, where: str = "frame") -> None:
        for group in ("text", "audio"):
            temp, top_p, top_k = (
                getattr(self, f"{group}_{f}") for f in ("temperature", "top_p", "top_k")
            )
            if not _number(temp) or not temp >= 0.0:
                raise ValueError(f"{where}.{group}_temperature: got {temp!r}; expected >= 0")
            if not _number(top_p) or not 0.0 < top_p <= 1.0:
                raise ValueError(f"{where}.{group}_top_p: got {top_p!r}; expected in (0, 1]")
            if not _integer(top_k) or (top_k < 1 and top_k != -1):
                raise ValueError(
                    f"{where}.{group}_top_k: got {top_k!r}; expected -1 (disabled) or an int >= 1"
                )
        penalty = self.audio_repetition_penalty
        if not _number(penalty) or not penalty > 0:
            raise ValueError(f"{where}.audio_repetition_penalty: got {penalty!r}; expected > 0")
        window = self.repetition_window
        if not _integer(window) or window < 1:
            raise ValueError(f"{where}.repetition_window: got {window!r}; expected an int >= 1")


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
