"""Per-request device tensors a step reads like a pool: ``RequestTable`` and its ``column``s.

A column is declared once, with where its value comes from (``sources``); the step kind computes
a request's values once, when it takes its req->token row (``take``), and a step reads them
through its ``req_rows``. The table never calls back into the code that declared its columns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T", bound="RequestTable")


@dataclass(frozen=True)
class Column:
    dtype: torch.dtype
    pad: float | int
    of: Callable[[Any], Any] | None  # the request's value (host); None: reset to ``pad``
    shape: tuple[int | str, ...]  # trailing dims; a str names a dim given to ``allocate``
    marks: bool = False  # ``of`` gives the indices of a ``[n]`` row that hold 1 (the rest pad)
    owner: str | None = None  # the feature it belongs to: a request not using it takes ``pad``


def column(
    dtype: torch.dtype,
    pad: float | int,
    of: Callable[[Any], Any] | None = None,
    shape: tuple[int | str, ...] = (),
    marks: bool = False,
) -> Any:
    """Declare a per-request tensor of a ``RequestTable``: its dtype, the value of the padding
    row (and of a row before a request takes it), and how a request's value is computed
    (``of(request)``; None for state that the step updates itself, reset when a row is taken;
    ``marks``: the indices set to 1, as a mask over a vocabulary)."""
    return field(default=None, metadata={"column": Column(dtype, pad, of, shape, marks)})


@dataclass
class RequestTable:
    """Per-request device tensors ``[rows, *shape]``: every dataclass field of a subclass
    declared with ``column``. Row ``r`` belongs to the request holding req->token row ``r``;
    the last row is the padding request's and keeps the pad values."""

    def __post_init__(self) -> None:
        self.owners: list[Any] = []  # the request holding each row

    @classmethod
    def columns(cls) -> dict[str, Column]:
        plain = [f.name for f in dataclasses.fields(cls) if "column" not in f.metadata]
        if plain:
            raise TypeError(f"{cls.__name__}.{plain[0]}: declare request tensors with column()")
        return {f.name: f.metadata["column"] for f in dataclasses.fields(cls)}

    @classmethod
    def allocate(cls: type[T], rows: int, device: torch.device | str, **dims: int) -> T:
        tensors = {}
        for name, c in cls.columns().items():
            shape = tuple(dims[d] if isinstance(d, str) else d for d in c.shape)
            tensors[name] = torch.full((rows, *shape), c.pad, dtype=c.dtype, device=device)
        table = cls(**tensors)
        table.owners = [None] * rows
        return table

    @classmethod
    def sources(cls, uses: Container[str] = ()) -> dict[str, Callable[[Any], Any]]:
        """Each column a request using the features ``uses`` takes a value for, and where it
        comes from (``of``); the rest take their pad value (a feature's, when not used)."""
        cols = cls.columns().items()
        return {n: c.of for n, c in cols if c.of and (c.owner is None or c.owner in uses)}

    def take(self, row: int, req: Any, values: dict[str, Any]) -> None:
        """``req`` holds ``row`` now: write its ``values`` there (host, once per request: see
        ``owners``); a column not in ``values`` takes its pad value."""
        self.owners[row] = req
        for name, c in self.columns().items():
            t: torch.Tensor = getattr(self, name)
            value = values.get(name)
            if c.marks:
                t[row] = c.pad
                if value is not None and len(value):
                    t[row, torch.as_tensor(value, dtype=torch.int64, device=t.device)] = 1
            elif value is None:
                t[row] = c.pad
            elif isinstance(value, int | float):
                t[row] = value
            else:
                t[row].copy_(torch.as_tensor(value, dtype=c.dtype), non_blocking=True)
