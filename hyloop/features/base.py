"""The protocol every per-request generation feature implements, and what its checks share.

A feature says which request fields it reads (``fields``, with their neutral values), what a
request may ask of it (``validate``), what it keeps of a request that uses it (``attach``: None
when the request does not), its request-table ``columns`` (a request not using it takes their
padding values) and, when it acts
inside the step, its ``bit`` of the step's static ``features``. The core calls its hooks: in the
step ``apply`` (the logits before sampling) and ``after_sample``; on the host ``take`` (a request
takes its table row), ``advance`` (a resolved step's token reaches the request), ``run_ahead``
(a step is launched before the one it follows is resolved), ``settle`` (that one is) and
``stop_hit`` (a stop the request's newest token completed). A request that uses no feature
calls none of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hyloop.framework.sampling_params import (  # what every feature's checks share
    FLOAT32_MAX,
    INT32_MAX,
    bad,
    is_float32,
    is_integer,
    is_number,
)
from hyloop.graphs.request_table import RequestTable

if TYPE_CHECKING:
    from hyloop.framework.requests import Request
    from hyloop.framework.sampling_params import SamplingParams
    from hyloop.graphs.step_batch import StepBatch

__all__ = ["FLOAT32_MAX", "INT32_MAX", "bad", "is_float32", "is_integer", "is_number"]


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
    # The request fields it reads, each with its neutral value: the core asks a request's
    # ``validate`` and ``attach`` only when one is set away from it (None: always asks).
    fields: ClassVar[dict[str, object] | None] = None
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

    def stop_hit(self, req: Request, tokenizer: Any) -> str | None:
        """A stop the newest token of ``req`` completed (its ``stop_reason``), or None."""
        return None


def table_with(base: type[RequestTable], features: list[type[Feature]]) -> type[RequestTable]:
    """``base`` with the features' columns, each owned by its feature (``base`` itself when
    they declare none)."""
    extra: list[tuple[str, Any, Any]] = []
    taken = {c.name for c in dataclasses.fields(base)}
    for f in features:
        for name, col in f.columns.items():
            if name in taken:
                raise TypeError(f"feature {f.name!r}: column {name!r} is taken already")
            taken.add(name)
            owned = dataclasses.replace(col.metadata["column"], owner=f.name)
            # A fresh field per table: dataclasses write into the field they are given.
            field = dataclasses.field(default=None, metadata={"column": owned})
            extra.append((name, torch.Tensor, field))
    return dataclasses.make_dataclass(base.__name__, extra, bases=(base,)) if extra else base
