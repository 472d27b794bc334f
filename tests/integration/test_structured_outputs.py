"""Structured outputs on SmolLM2, lookahead on: seeded JSON-schema requests parse and validate,
``choice`` returns one of its choices, a regex is matched, ``n`` samples each follow the
grammar; the grammar's host work runs while the step runs (the resolve thread's hidden time)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hyloop import LLM, SamplingParams
from hyloop.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> Iterator[LLM]:
    path = gguf_path
    overrides = [
        "graphs.backend=eager",
        "lookahead.enable=true",
        "lookahead.min_batch=1",
        "model.max_context=512",
    ]
    with LLM(model=path, overrides=overrides) as llm:
        yield llm


def conforms(value: Any) -> bool:
    """``SCHEMA``, checked by hand."""
    props = SCHEMA["properties"]
    return (
        isinstance(value, dict)
        and set(value) == set(props)
        and isinstance(value["name"], str)
        and len(value["name"]) <= 24
        and isinstance(value["age"], int)
        and 0 <= value["age"] <= 120
        and value["city"] in props["city"]["enum"]
        and isinstance(value["tags"], list)
        and len(value["tags"]) <= 3
        and all(isinstance(t, str) and len(t) <= 12 for t in value["tags"])
    )


def test_seeded_json_schema_requests_all_validate(llm: LLM) -> None:
    shaped = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(temperature=0.8, seed=s, max_tokens=160, structured_outputs=shaped)
        for s in range(8)
    ]
    hidden = llm.stats().get("lookahead_hidden_host_s", 0.0)
    outs = llm.generate(["A person, as a JSON record:"] * 8, params, use_tqdm=False)
    for o in outs:
        sample = o.outputs[0]
        assert sample.finish_reason == "stop", sample.text
        assert conforms(json.loads(sample.text)), sample.text
    assert len({o.outputs[0].text for o in outs}) > 1  # seeded samples, not one greedy path
    assert llm.stats()["lookahead_hidden_host_s"] > hidden  # lookahead stayed on


def test_choice_regex_and_grammar(llm: LLM) -> None:
    choices = ["positive", "negative", "neutral"]
    grammar = 'start: "(" NUM ("," NUM)? ("," NUM)? ")"\nNUM: /[0-9]{1,3}/'
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=8,
            structured_outputs=StructuredOutputsParams(choice=choices),
        ),
        SamplingParams(
            temperature=0.9,
            seed=4,
            max_tokens=16,
            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
        ),
        SamplingParams(
            temperature=0.7,
            seed=2,
            max_tokens=30,
            structured_outputs=StructuredOutputsParams(grammar=grammar),
        ),
        SamplingParams(temperature=0.0, max_tokens=8),  # unconstrained, batched with them
    ]
    prompts = ["The review 'I loved it' is", "A date:", "A tuple of numbers:", "Hello"]
    outs = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[0] in choices
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", outs[1]), outs[1]
    assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3}){0,2}\)", outs[2]), outs[2]
    alone = llm.generate(prompts[3], params[3], use_tqdm=False)[0].outputs[0].text
    assert outs[3] == alone


def test_n_samples_each_follow_the_grammar(llm: LLM) -> None:
    p = SamplingParams(
        n=3,
        temperature=1.0,
        seed=9,
        max_tokens=12,
        structured_outputs=StructuredOutputsParams(regex=r"(yes|no|maybe)( (yes|no|maybe)){0,2}"),
    )
    out = llm.generate("Answer:", p, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for sample in out.outputs:
        assert re.fullmatch(r"(yes|no|maybe)( (yes|no|maybe)){0,2}", sample.text), sample.text


def test_bad_structured_params_fail_alone(llm: LLM) -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate(
            "x",
            SamplingParams(structured_outputs=StructuredOutputsParams(regex="([0-9]")),
            use_tqdm=False,
        )
    ok = llm.generate("x", SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) >= 1
