"""A request that sets none of a feature's fields never reaches it: its checks are not asked,
and its request-table columns keep their pad values; one that sets a field is handed to it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from hyloop import SamplingParams
from hyloop.features.base import Feature, table_with
from hyloop.features.min_p import MinP
from hyloop.features.penalties import Penalties
from hyloop.framework import FEATURES
from hyloop.graphs.request_table import RequestTable, column


class Spy(Feature):
    name = "spy"
    fields = {"min_p": 0.0, "stop": None}
    columns = {"spy_value": column(torch.float32, -1.0, lambda r: 7.0)}
    seen: ClassVar[list[str]] = []

    @classmethod
    def validate(cls, p: SamplingParams, where: str) -> None:
        cls.seen.append(where)


@pytest.fixture
def spy() -> Iterator[type[Spy]]:
    Spy.seen = []
    FEATURES.append(Spy)
    try:
        yield Spy
    finally:
        FEATURES.remove(Spy)


def test_neutral_fields_are_not_set() -> None:
    assert not SamplingParams().sets_any(Penalties.fields)
    assert not SamplingParams(repetition_penalty=1.0, presence_penalty=0.0).sets_any(
        Penalties.fields
    )
    assert SamplingParams(repetition_penalty=1.1).sets_any(Penalties.fields)
    assert SamplingParams(min_p=0.2).sets_any(MinP.fields)
    # a value of another type than the neutral one is checked, so it cannot slip through
    assert SamplingParams(min_p=0).sets_any(MinP.fields)
    assert SamplingParams(min_p=False).sets_any(MinP.fields)  # type: ignore[arg-type]
    assert SamplingParams().sets_any(None)  # a feature that names no fields is always asked


def test_a_feature_is_asked_only_for_the_fields_it_reads(spy: type[Spy]) -> None:
    SamplingParams().validate("plain")
    SamplingParams(repetition_penalty=1.2).validate("penalised")
    SamplingParams(stop=["x"]).validate("stopped")
    SamplingParams(min_p=0.3).validate("min_p")
    assert spy.seen == ["stopped", "min_p"]


def test_a_bad_value_still_names_itself() -> None:
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=False).validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=-1.0).validate()


@dataclasses.dataclass
class _Table(RequestTable):
    base: torch.Tensor = column(torch.int64, 0, lambda r: 3)


def test_a_row_takes_pads_for_the_features_it_does_not_use() -> None:
    table = table_with(_Table, [Spy]).allocate(2, "cpu")

    class Req:
        features: ClassVar[dict[str, Any]] = {}

    def take(row: int, req: Req, uses: tuple[str, ...]) -> None:
        table.take(row, req, {n: of(req) for n, of in table.sources(uses).items()})

    a, b = Req(), Req()
    take(0, a, uses=())
    take(1, b, uses=("spy",))
    assert table.base.tolist() == [3, 3]
    assert table.spy_value.tolist() == [-1.0, 7.0]
    # a new request in a row keeps none of the last one's values
    take(1, Req(), uses=())
    assert table.spy_value.tolist() == [-1.0, -1.0]
