"""Per-request sampling parameters (vLLM-shaped), and the per-group ones of a frame model."""

from __future__ import annotations

import copy
import dataclasses
import enum
import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar

from hyloop.framework import FEATURES

# Per-request values reach the step as float32 / int32 tensors: a value past these would not
# convert, so it is refused by name, never as a failed tensor copy later.
FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1


class RequestOutputKind(enum.IntEnum):
    """What ``Engine.step()`` returns of a running request: its whole output so far
    (``CUMULATIVE``), only what is new since its last output (``DELTA``), or nothing until it
    finishes (``FINAL_ONLY``, which spares the host a copy per request per step)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_KIND_NAMES = {k.name.lower(): k for k in RequestOutputKind}
SAMPLING_EPS = 1e-5  # a temperature below this is greedy (vLLM's rule)
MAX_N = 1000  # samples per request
# Fields a request may carry whose control hyloop does not run: each one names itself when
# set away from this (vLLM's) neutral value. (Per-request Python logits processors would put
# host code inside the captured step; vLLM v1 dropped the per-request field as well.)
NOT_YET: dict[str, object] = {"logits_processors": None}


def fold_seed(seed: int) -> int:
    """Any Python int as the int64 a request table holds: ``[0, 2**64)`` as itself (two's
    complement), anything else by a 64-bit hash of all its bytes, so no two seeds collide by
    truncation (0, 2**32 and 2**70 all differ)."""
    if not 0 <= seed < 1 << 64:
        raw = seed.to_bytes((seed.bit_length() + 8) // 8, "little", signed=True)
        seed = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def bad(where: str, name: str, value: object, expected: str) -> ValueError:
    return ValueError(f"{where}.{name}: got {value!r}; expected {expected}")


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_float32(value: object) -> bool:
    """A number that is neither NaN nor beyond float32's finite range."""
    return is_number(value) and abs(value) <= FLOAT32_MAX  # type: ignore[operator]


class NotSupportedError(ValueError):
    """A vLLM field, argument or input hyloop does not support (yet); the message names it."""


@dataclass
class SamplingParams:
    """How one request samples and when it stops: vLLM's fields, names and defaults.

    ``temperature`` below 1e-5 is greedy; ``top_k`` 0 or -1 and ``top_p == 1.0`` disable those
    filters; ``seed`` fixes the request's noise (same seed, same tokens, whatever else is
    batched); ``max_tokens=None`` generates up to the context limit; ``ignore_eos`` keeps
    generating past EOS (EOS stays an ordinary, sampleable token); ``logprobs = k`` returns the
    sampled token's and the top-k tokens' ``Logprob`` at each position; ``output_kind``: see
    ``RequestOutputKind`` (hyloop also takes ``"cumulative"`` / ``"delta"`` / ``"final_only"``);
    ``truncate_prompt_tokens = k`` keeps the prompt's last k tokens (-1: the context limit);
    ``skip_special_tokens`` and ``detokenize`` shape the output text. ``frame`` (hyloop): the
    per-group sampling of a frame (TTS) model, which then samples from it and not from
    ``temperature`` / ``top_p`` / ``top_k``. The fields of ``NOT_YET`` are accepted at their
    neutral value and name themselves otherwise.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: Any = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Any = None
    guided_decoding: Any = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    best_of: int | None = None
    frame: FrameSamplingParams | None = None
    # The field names, as vLLM's msgspec struct lists them (clients copy a params by them).
    __struct_fields__: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if isinstance(self.output_kind, str) and self.output_kind in _KIND_NAMES:
            self.output_kind = _KIND_NAMES[self.output_kind]

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_temperature(self) -> float:
        """The temperature the sampler applies (0: greedy)."""
        return 0.0 if self.greedy else float(self.temperature)

    @property
    def filter_top_k(self) -> int:
        """``top_k`` as the sampler reads it (-1: off); one above the vocabulary keeps it whole,
        so a value past int32 is clipped there."""
        return -1 if self.top_k in (0, -1) or self.greedy else min(self.top_k, INT32_MAX)

    @property
    def filter_top_p(self) -> float:
        return 1.0 if self.greedy else float(self.top_p)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """vLLM's constructor that skips ``None`` values (the defaults apply)."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def validate(self, where: str = "sampling_params", max_logprobs: int | None = None) -> None:
        for name, neutral in NOT_YET.items():
            value = getattr(self, name)
            if value == neutral:
                continue
            raise NotSupportedError(
                f"{where}.{name}={value!r}: not supported by hyloop yet (leave it at {neutral!r})"
            )
        if self.max_tokens is not None and (not is_integer(self.max_tokens) or self.max_tokens < 1):
            raise bad(where, "max_tokens", self.max_tokens, "None or an int >= 1")
        if not is_integer(self.n) or not 1 <= self.n <= MAX_N:
            raise bad(where, "n", self.n, f"an int in [1, {MAX_N}]")
        if self.best_of is not None and (not is_integer(self.best_of) or self.best_of < self.n):
            raise bad(where, "best_of", self.best_of, f"None or an int >= n ({self.n})")
        temp = self.temperature
        if not (is_float32(temp) or temp == float("inf")) or not temp >= 0.0:
            raise bad(
                where, "temperature", temp, f"a float in [0, {FLOAT32_MAX:.4g}] or inf (uniform)"
            )
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(where, "top_p", self.top_p, "a float in (0, 1]")
        if not is_integer(self.top_k) or self.top_k < -1:
            raise bad(where, "top_k", self.top_k, "0 or -1 (disabled) or an int >= 1")
        if self.seed is not None and not is_integer(self.seed):
            raise bad(where, "seed", self.seed, "an int or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_integer(value) or value < 0):
                raise bad(where, name, value, "None or an int >= 0")
            if value is not None and max_logprobs is not None and value > max_logprobs:
                raise bad(where, name, value, f"at most model.max_logprobs={max_logprobs}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad(
                where,
                "output_kind",
                self.output_kind,
                "a RequestOutputKind or 'cumulative', 'delta', 'final_only'",
            )
        tpt = self.truncate_prompt_tokens
        if tpt is not None and (not is_integer(tpt) or (tpt < 1 and tpt != -1)):
            raise bad(where, "truncate_prompt_tokens", tpt, "None, -1 or an int >= 1")
        if self.frame is not None:
            if not isinstance(self.frame, FrameSamplingParams):
                raise bad(where, "frame", self.frame, "a FrameSamplingParams or None")
            self.frame.validate(f"{where}.frame")
        flags = ("ignore_eos", "detokenize", "skip_special_tokens", "include_stop_str_in_output")
        for flag in (*flags, "spaces_between_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(where, flag, getattr(self, flag), "a bool")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad(where, "extra_args", self.extra_args, "a dict or None")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, list | tuple)
            or not all(is_integer(t) for t in self.stop_token_ids)
        ):
            raise bad(where, "stop_token_ids", self.stop_token_ids, "a list of ints")
        for feature in FEATURES:
            if self.sets_any(feature.fields):
                feature.validate(self, where)

    def sets_any(self, fields: dict[str, object] | None) -> bool:
        """Whether any of ``fields`` is set away from its neutral value (None: assume so). A
        value of another type than its neutral one counts as set, so it is checked."""
        if fields is None:
            return True
        for name, neutral in fields.items():
            value = getattr(self, name)
            if value is not neutral and (type(value) is not type(neutral) or value != neutral):
                return True
        return False


SamplingParams.__struct_fields__ = tuple(f.name for f in dataclasses.fields(SamplingParams))


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
            if not (is_float32(temp) or temp == float("inf")) or not temp >= 0.0:
                expected = f"a float in [0, {FLOAT32_MAX:.4g}] or inf (uniform)"
                raise bad(where, f"{group}_temperature", temp, expected)
            if not is_number(top_p) or not 0.0 < top_p <= 1.0:
                raise bad(where, f"{group}_top_p", top_p, "in (0, 1]")
            if not is_integer(top_k) or (top_k < 1 and top_k != -1) or top_k > INT32_MAX:
                expected = f"-1 (disabled) or an int in [1, {INT32_MAX}]"
                raise bad(where, f"{group}_top_k", top_k, expected)
        penalty = self.audio_repetition_penalty
        if not is_float32(penalty) or not penalty > 0:
            expected = f"a float in (0, {FLOAT32_MAX:.4g}]"
            raise bad(where, "audio_repetition_penalty", penalty, expected)
        if not is_integer(self.repetition_window) or self.repetition_window < 1:
            raise bad(where, "repetition_window", self.repetition_window, "an int >= 1")
