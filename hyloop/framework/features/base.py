"""The protocol every per-request generation feature implements, and what its checks share.

A feature says what a request may ask of it (``validate``), what it keeps of a request that uses
it (``attach``: None when the request does not), its request-table ``columns`` and, when it acts
inside the step, its ``bit`` of the step's static ``features``. The core calls its hooks: in the
step ``apply`` (the logits before sampling) and ``after_sample``; on the host ``take`` (a request
takes its table row), ``advance`` (a resolved step's token reaches the request), ``run_ahead``
(a step is launched before the one it follows is resolved) and ``settle`` (that one is).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hyloop.graphs.request_table import RequestTable

if TYPE_CHECKING:
    from hyloop.framework.requests import Request
    from hyloop.framework.sampling_params import SamplingParams
    from hyloop.graphs.step_batch import StepBatch

# Per-request values reach the step as float32 / int32 tensors: a value past these would not
# convert, so it is refused by name, never as a failed tensor copy later.
FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class RequestContext:
    """What ``attach`` reads of the engine a request joins."""

    tokenizer: Any
    vocab_size: int
    eos_ids: frozenset[int]


class Feature:
    """One per-request feature of the token step (an instance per step kind).

    NOTE: ``apply`` leaves a neutral row's logits bit-exact (a request not using the feature,
    the padding row): a step applies a feature to all its rows, and a captured step applies
    every ``shares_artifact`` feature once any applies (fewer artifacts).
    """

    name: ClassVar[str]
    columns: ClassVar[dict[str, Any]] = {}  # name -> ``column(...)`` of the token table
    in_step: ClassVar[bool] = True  # acts inside the step (takes a bit), else host only
    shares_artifact: ClassVar[bool] = True
    host_fed: ClassVar[bool] = False  # the host writes its rows after each step (``advance``)
    flag: ClassVar[str | None] = None  # a ``StepBatch`` property that reads its bit
    bit: ClassVar[int] = 0  # set by ``register``

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    @classmethod
    def validate(cls, p: SamplingParams, where: str) -> None:
        """Types and ranges of the request's fields it reads (``where`` names the request)."""

    def dims(self) -> dict[str, int]:
        """Sizes of its columns' named dims besides ``vocab``."""
        return {}

    def attach(self, req: Request, ctx: RequestContext, where: str) -> Any:
        return None

    def take(self, table: RequestTable, row: int, state: Any) -> None:
        return None

    def apply(self, logits: torch.Tensor, table: Any, batch: StepBatch) -> torch.Tensor:
        return logits

    def after_sample(self, table: Any, batch: StepBatch, ids: torch.Tensor) -> None:
        return None

    def advance(self, table: RequestTable, row: int, state: Any, token: int) -> None:
        return None

    def run_ahead(self, batch: StepBatch) -> None:
        return None

    def settle(self) -> None:
        return None


def table_with(base: type[RequestTable], features: list[type[Feature]]) -> type[RequestTable]:
    """``base`` with the features' columns (``base`` itself when they declare none)."""
    extra: list[tuple[str, Any, Any]] = []
    taken = {c.name for c in dataclasses.fields(base)}
    for f in features:
        for name, col in f.columns.items():
            if name in taken:
                raise TypeError(f"feature {f.name!r}: column {name!r} is taken already")
            taken.add(name)
            # A fresh field per table: dataclasses write into the field they are given.
            extra.append(
                (name, torch.Tensor, dataclasses.field(default=None, metadata=col.metadata))
            )
    return dataclasses.make_dataclass(base.__name__, extra, bases=(base,)) if extra else base


def bad(where: str, name: str, value: object, expected: str) -> ValueError:
    return ValueError(f"{where}.{name}: got {value!r}; expected {expected}")


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_float32(value: object) -> bool:
    """A number that is neither NaN nor beyond float32's finite range."""
    return is_number(value) and abs(value) <= FLOAT32_MAX  # type: ignore[operator]
