"""``TTSParams``: how one TTS request samples, stops and streams."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hyloop.framework.sampling_params import FrameSamplingParams, SamplingParams


@dataclass(frozen=True, kw_only=True)
class TTSParams(FrameSamplingParams):
    """A frame's sampling (``FrameSamplingParams``: temperature 0 is greedy for that group) plus
    how the request stops and streams.

    ``ignore_stop``: the stop head is overruled, every frame continues with the codes sampled
    for it, and the request runs to ``max_frames`` (fixed-length runs, benchmarks)."""

    max_frames: int
    ignore_stop: bool = False
    seed: int | None = None
    initial_chunk_frames: int = 5
    chunk_frames: int = 25

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "params") -> TTSParams:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {unknown}; expected some of {sorted(names)}"
            )
        if "max_frames" not in values:
            raise ValueError(f"{where}.max_frames: missing; expected an int >= 1")
        params = cls(**values)
        params.validate(where)
        return params

    def validate(self, where: str = "params") -> None:
        for name in ("max_frames", "initial_chunk_frames", "chunk_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}.{name}: got {value!r}; expected an int >= 1")
        self.sampling().validate(where)

    def frame(self) -> FrameSamplingParams:
        """The frame sampling part alone."""
        names = [f.name for f in dataclasses.fields(FrameSamplingParams)]
        return FrameSamplingParams(**{n: getattr(self, n) for n in names})

    def sampling(self) -> SamplingParams:
        """The engine's view: frames are tokens, the end frame is EOS, ``delta`` outputs; the
        frame step samples from ``frame`` (greedy when both of its groups are)."""
        return SamplingParams(
            max_tokens=self.max_frames,
            seed=self.seed,
            ignore_eos=self.ignore_stop,
            output_kind="delta",
            frame=self.frame(),
        )
