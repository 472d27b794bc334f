"""An OpenAI Batch body's output constraint: vLLM's ``structured_outputs`` field, its older
``guided_*`` fields and OpenAI's ``response_format``, mapped as vLLM's server maps them onto one
``StructuredOutputsParams`` and compiled without the model (errors name the body field)."""

from __future__ import annotations

import json
import reprlib
from typing import Any

from hyloop.features.grammar import compile_grammar
from hyloop.features.structured_params import CONSTRAINTS, StructuredOutputsParams, as_structured

# vLLM's older body fields for one constraint each: the StructuredOutputsParams field they set.
GUIDED = {f"guided_{name}": name for name in ("json", "regex", "choice", "grammar")}
_RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60
short = _repr.repr  # a value quoted in an error message, cut short


def structured_outputs(where: str, body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The body's output constraint, compiled (None: none), as vLLM's server maps it: from
    ``structured_outputs`` (its fields), a ``guided_*`` field or ``response_format`` (these fill
    in a ``structured_outputs`` of options only); errors name the body field holding the value."""
    label = f"{where}: body.structured_outputs"
    values = body.get("structured_outputs")
    if values is not None and not isinstance(values, dict):
        raise ValueError(f"{label}: got {short(values)}; expected an object of its fields")
    values = dict(values or {})
    # (body path, StructuredOutputsParams field, value) of each other field that sets one
    given = [(key, name, body[key]) for key, name in GUIDED.items() if body.get(key) is not None]
    given += _response_format(where, body.get("response_format"))
    keys = ["structured_outputs"] * any(values.get(name) is not None for name in CONSTRAINTS)
    keys += [path.split(".")[0] for path, _, _ in given]
    if len(keys) > 1:
        listed = " and ".join(f"body.{key}" for key in keys)
        raise ValueError(f"{where}: {listed} each set an output constraint; give one")
    old = new = label
    for path, name, value in given:  # at most one
        values[name] = value
        old, new = f"{label}.{name}", f"{where}: body.{path}"
    try:
        if not keys:  # options alone constrain nothing (vLLM); a stand-in checks their types
            as_structured({**values, "json_object": True}, label)
            return None
        params = as_structured(values, label)
        compile_grammar(params, label)
    except ValueError as e:
        message = str(e)
        raise type(e)(new + message[len(old) :] if message.startswith(old) else message) from None
    return params


def _response_format(where: str, value: Any) -> list[tuple[str, str, Any]]:
    """The constraint ``response_format`` sets, as vLLM reads it (none for text, or for a
    json_schema without a schema): its body path, StructuredOutputsParams field and value."""
    label = f"{where}: body.response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return []
    if kind not in _RESPONSE_FORMATS:
        raise ValueError(f"{label}: got {short(value)}; expected a type in {_RESPONSE_FORMATS}")
    if kind == "json_object":
        return [("response_format", "json_object", True)]
    if kind == "structural_tag":  # the whole object, as vLLM passes it on
        return [("response_format", "structural_tag", json.dumps(value))]
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError(f"{label}.json_schema: got {short(spec)}; expected an object with a name")
    # NOTE: a misspelt schema key would leave the output unconstrained, so none pass.
    keys = ("name", "schema", "strict", "description")
    unknown = sorted(set(spec) - set(keys))
    if unknown:
        raise ValueError(f"{label}.json_schema: unknown field {unknown[0]!r}; expected {keys}")
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise ValueError(f"{label}.json_schema.schema: got {short(schema)}; expected an object")
    return [] if schema is None else [("response_format.json_schema.schema", "json", schema)]
