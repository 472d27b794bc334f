"""vLLM's ``StructuredOutputsParams``: the one constraint a request's output must follow."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hyloop.framework.sampling_params import NotSupportedError

# The constraint fields: exactly one of them is set (vLLM's rule).
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# Fields of the old ``GuidedDecodingParams`` that choose a backend; hyloop has one (llguidance).
_LEGACY = ("backend", "backend_was_auto")
_BACKENDS = (None, "auto", "guidance", "llguidance")


@dataclass
class StructuredOutputsParams:
    """What a request's output must match: a JSON schema (``json``, a dict or its JSON text),
    any JSON object (``json_object=True``), a ``regex``, one of the strings of ``choice``, a
    ``grammar`` (Lark, as llguidance reads it, or GBNF/EBNF with ``root ::= ...`` rules), or a
    ``structural_tag`` (JSON text: ``{"structures": [{"begin", "schema", "end"}], "triggers"}``).

    The JSON options: ``disable_any_whitespace`` (no whitespace between tokens),
    ``whitespace_pattern`` (a regex for the whitespace allowed), and what an object schema
    with ``properties`` and no ``additionalProperties`` admits: by default no other keys
    (vLLM's default backend, xgrammar in strict mode), which ``disable_additional_properties``
    (vLLM's guidance option) also says; ``allow_additional_properties=True`` (hyloop's, the
    inverse) lets such objects take unlisted keys, as llguidance and vLLM's guidance backend
    do without that option. A schema's own ``additionalProperties`` always wins.
    ``disable_fallback`` is older vLLM's backend switch; with one backend it changes nothing.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    allow_additional_properties: bool = False

    def __post_init__(self) -> None:
        check_fields(vars(self), "StructuredOutputsParams")

    @property
    def closed_objects(self) -> bool:
        """Objects that list their properties take no other keys (see the class doc)."""
        return not self.allow_additional_properties

    @property
    def constraint(self) -> str:
        """The name of the constraint field that is set."""
        return next(name for name in CONSTRAINTS if getattr(self, name) is not None)

    def all_constraints_none(self) -> bool:
        return all(getattr(self, name) is None for name in CONSTRAINTS)


FIELDS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams))


def check_fields(values: Mapping[str, Any], where: str) -> None:
    """The types of ``values`` (field name -> value) and the exactly-one rule; errors name
    ``where.<field>``."""

    def bad(name: str, expected: str) -> ValueError:
        return ValueError(f"{where}.{name}: got {values[name]!r}; expected {expected}")

    for name in ("regex", "grammar", "whitespace_pattern"):
        if values.get(name) is not None and not isinstance(values[name], str):
            raise bad(name, "a str or None")
    if values.get("grammar") is not None and not values["grammar"].strip():
        raise bad("grammar", "a non-empty grammar")
    if values.get("json") is not None and not isinstance(values["json"], str | dict | bool):
        raise bad("json", "a JSON schema (a dict or its JSON text) or None")
    tag = values.get("structural_tag")
    if tag is not None and not isinstance(tag, str | dict):
        raise bad("structural_tag", "the structural tag's JSON text or None")
    choice = values.get("choice")
    if choice is not None and (
        not isinstance(choice, list | tuple)
        or not choice
        or not all(isinstance(c, str) for c in choice)
    ):
        raise bad("choice", "a non-empty list of str or None")
    if values.get("json_object") not in (None, True):
        raise bad("json_object", "True (any JSON object) or None")
    for name in (
        "disable_fallback",
        "disable_any_whitespace",
        "disable_additional_properties",
        "allow_additional_properties",
    ):
        if not isinstance(values.get(name, False), bool):
            raise bad(name, "a bool")
    if values.get("disable_additional_properties") and values.get("allow_additional_properties"):
        raise ValueError(
            f"{where}.allow_additional_properties: set it or disable_additional_properties, "
            "not both"
        )
    if values.get("whitespace_pattern") is not None and values.get("disable_any_whitespace"):
        raise ValueError(f"{where}.whitespace_pattern: set it or disable_any_whitespace, not both")
    chosen = [name for name in CONSTRAINTS if values.get(name) is not None]
    if len(chosen) != 1:
        got = " and ".join(chosen) if chosen else "none"
        raise ValueError(f"{where}: set exactly one of {', '.join(CONSTRAINTS)}; got {got}")


def as_structured(value: Any, where: str) -> StructuredOutputsParams:
    """``value`` as a ``StructuredOutputsParams``: one already, a dict of its fields, or an
    object with those fields (the old ``GuidedDecodingParams``, whose ``backend`` must be
    llguidance's or unset)."""
    if isinstance(value, StructuredOutputsParams):
        check_fields(vars(value), where)
        return value
    if isinstance(value, Mapping):
        values = dict(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        values = {
            f.name: getattr(value, f.name)
            for f in dataclasses.fields(value)
            if not f.name.startswith("_")
        }
    else:
        raise ValueError(
            f"{where}: got {value!r}; expected a StructuredOutputsParams, a dict of its "
            "fields, or None"
        )
    for name in values:
        if name not in FIELDS and name not in _LEGACY:
            raise ValueError(f"{where}.{name}: unknown field; expected one of {', '.join(FIELDS)}")
    backend = values.pop("backend", None)
    values.pop("backend_was_auto", None)
    if backend not in _BACKENDS:
        raise NotSupportedError(
            f"{where}.backend={backend!r}: hyloop compiles grammars with llguidance only "
            "(leave it None, 'auto' or 'guidance')"
        )
    check_fields(values, where)
    return StructuredOutputsParams(**values)


@dataclass
class GuidedDecodingParams:
    """vLLM's older name and fields (``backend`` included) for what is now
    ``StructuredOutputsParams``; ``SamplingParams(guided_decoding=...)`` takes it, and
    ``structured_outputs`` too. ``backend``: None, ``auto`` or llguidance's (hyloop's one)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    backend_was_auto: bool = False
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        as_structured(self, "GuidedDecodingParams")

    @classmethod
    def from_optional(cls, **kwargs: Any) -> GuidedDecodingParams | None:
        """vLLM's constructor: None when no constraint is given."""
        if all(kwargs.get(name) is None for name in CONSTRAINTS):
            return None
        return cls(**kwargs)
