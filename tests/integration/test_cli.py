"""``hyloop generate``: JSONL in, JSONL out in input order; fields a row leaves out get the
engine's defaults, requested logprobs are written, and a bad row gets an error record naming
its line while every other row runs (exit 1); a command-line error exits 2."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hyloop import LLM
from hyloop.cli import main
from hyloop.framework.outputs import RequestOutput

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "graphs.backend=eager",
    "kv_pool.page_size=4",
    "kv_pool.num_pages=256",
    "model.max_context=128",
]
# Rows without a temperature sample at the default (1.0): they carry a seed to be comparable.
ROWS: list[dict[str, Any]] = [
    {
        "id": "first",
        "prompt_token_ids": [5, 6, 7, 8],
        "max_tokens": 6,
        "ignore_eos": True,
        "seed": 1,
    },
    {"prompt_token_ids": [90] * 20, "temperature": 0.9, "seed": 4, "max_tokens": 9},
    {"id": 3, "prompt_token_ids": [1, 2, 3], "max_tokens": 4, "logprobs": 2, "temperature": 0.0},
    {"prompt_token_ids": [200, 201], "max_tokens": 12, "top_k": 5, "temperature": 1.0, "seed": 8},
    {"prompt_token_ids": [44], "temperature": 0.0, "ignore_eos": True},  # max_tokens: 16
]
LOGPROB_KEYS = {"token_id", "logprob", "rank", "decoded_token"}


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def generate(src: Path, dst: Path | None, ckpt: Path, overrides: list[str] = OVERRIDES) -> int:
    argv = ["generate", "--model", str(ckpt), "--input", str(src), "--no-progress"]
    return main([*argv, *(["--output", str(dst)] if dst else []), *overrides])


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def expected(tiny_ckpts: dict[str, Path]) -> list[RequestOutput]:
    """The same rows through the Python API: the defaults, with each row's fields over them."""
    with LLM(model=tiny_ckpts["llama"], overrides=OVERRIDES) as llm:
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.top_k, d.max_tokens) == (1.0, 0, 16)  # vLLM's
        params = [
            dataclasses.replace(
                d, **{k: v for k, v in r.items() if k not in ("id", "prompt_token_ids")}
            )
            for r in ROWS
        ]
        return llm.generate([r["prompt_token_ids"] for r in ROWS], params, use_tqdm=False)


def check_ran(row: dict[str, Any], rec: dict[str, Any], want: RequestOutput) -> None:
    sample = want.outputs[0]
    for key, value in row.items():
        if key != "logprobs":  # a row's logprobs count becomes the logprobs written
            assert rec[key] == value  # input fields kept
    assert rec["token_ids"] == sample.token_ids
    assert rec["finish_reason"] == sample.finish_reason in ("stop", "length")
    assert rec["text"] is None  # the tiny checkpoint has no tokenizer
    assert rec["num_prompt_tokens"] == len(row["prompt_token_ids"])
    assert "error" not in rec
    assert ("logprobs" in rec) == ("logprobs" in row) == ("cumulative_logprob" in rec)


def test_generate_keeps_order_and_adds_fields(
    tiny_ckpts: dict[str, Path], tmp_path: Path, expected: list[RequestOutput]
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps(r) for r in ROWS])
    dst = tmp_path / "out.jsonl"
    assert generate(src, dst, tiny_ckpts["llama"]) == 0
    out = read_records(dst)
    assert len(out) == len(ROWS)
    for row, rec, want in zip(ROWS, out, expected, strict=True):
        check_ran(row, rec, want)
    assert len(out[0]["token_ids"]) == 6 and out[0]["finish_reason"] == "length"
    assert len(out[4]["token_ids"]) == 16  # the default max_tokens


def test_requested_logprobs_are_written(
    tiny_ckpts: dict[str, Path], tmp_path: Path, expected: list[RequestOutput]
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps(ROWS[2])])
    dst = tmp_path / "out.jsonl"
    assert generate(src, dst, tiny_ckpts["llama"]) == 0
    (rec,) = read_records(dst)
    want = expected[2].outputs[0]
    assert want.logprobs is not None and want.cumulative_logprob is not None
    assert len(rec["logprobs"]) == len(rec["token_ids"]) == 4
    for tok, position, entry in zip(rec["token_ids"], rec["logprobs"], want.logprobs, strict=True):
        assert position[0]["token_id"] == tok  # the sampled token first
        assert all(set(e) == LOGPROB_KEYS for e in position)
        top = [e for e in position if e["rank"] <= 2]
        assert [e["rank"] for e in top] == [1, 2]  # then the top-k by rank
        assert len(position) in (2, 3) and len({e["token_id"] for e in position}) == len(position)
        assert {e["token_id"]: e["logprob"] for e in position} == pytest.approx(
            {t: lp.logprob for t, lp in entry.items()}, abs=1e-5
        )
        assert position[0]["decoded_token"] is None  # no tokenizer
    assert rec["cumulative_logprob"] == pytest.approx(want.cumulative_logprob, abs=1e-4)
    assert rec["cumulative_logprob"] == pytest.approx(sum(p[0]["logprob"] for p in rec["logprobs"]))


PARSE_ERRORS = [
    ("{not json", "invalid JSON"),
    ('{"max_tokens": 3}', "prompt"),
    ('{"prompt_token_ids": [1, 2], "prompt": "x"}', "prompt"),
    ('{"prompt_token_ids": [1, 2], "temprature": 0.5}', "temprature"),
    ('{"prompt_token_ids": [1, 2], "output_kind": "delta"}', "output_kind"),
    ("[1, 2, 3]", "prompt"),
    ('{"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}', "messages"),
    ('{"messages": [{"role": "user", "content": "hi"}], "prompt_token_ids": [1]}', "messages"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": "hi"}', "non-empty list"),
    ('{"messages": [{"role": "user", "content": "hi"}, "hi"]}', "messages[1]"),
    ('{"messages": [{"role": "user"}]}', "messages[0]: no `content`"),
    ('{"messages": [{"role": "user", "content": 5}]}', "messages[0]"),
    ('{"prompt_token_ids": "1 2 3"}', "prompt_token_ids"),
    ('{"prompt_token_ids": [1, 2], "max_tokens": 0}', "max_tokens: got 0"),
    ('{"prompt_token_ids": [1, 2], "temperature": "hot"}', "temperature: got 'hot'"),
    ('{"prompt_token_ids": [1, 2], "n": 2}', "n=2, best_of=None: a `hyloop generate` record"),
    ('{"prompt_token_ids": [1, 2], "logit_bias": {"999": 1.0}}', "logit_bias: got [999]"),
    ('{"prompt_token_ids": [1, 2], "prompt_logprobs": 1}', "prompt_logprobs=1: not written"),
]
MODEL_ERRORS = [  # found once the model is loaded
    ('{"prompt_token_ids": [1, 999]}', "prompt_token_ids: token id 999"),
    ('{"prompt_token_ids": []}', "prompt_token_ids: empty"),
    (json.dumps({"prompt_token_ids": [9] * 200}), "prompt_token_ids: prompt of 200 tokens"),
    ('{"prompt": "hello"}', "prompt: a text prompt needs a tokenizer"),
]


@pytest.mark.parametrize(("bad", "named"), [*PARSE_ERRORS, *MODEL_ERRORS])
def test_bad_row_gets_an_error_record_and_the_rest_run(
    tiny_ckpts: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    expected: list[RequestOutput],
    bad: str,
    named: str,
) -> None:
    lines = [json.dumps(ROWS[0]), "", json.dumps(ROWS[1]), bad, json.dumps(ROWS[2])]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    dst = tmp_path / "out.jsonl"
    assert generate(src, dst, tiny_ckpts["llama"]) == 1  # some rows failed
    err = capsys.readouterr().err
    out = read_records(dst)
    assert len(out) == 4  # one record per non-blank line, in input order
    error = out[2]["error"]
    assert error.startswith(f"{src}:4: ") and named in error  # blank lines still count
    assert f"hyloop: error: {error}" in err
    try:
        value = json.loads(bad)
    except json.JSONDecodeError:
        value = None
    kept = value if isinstance(value, dict) else {}
    assert out[2] == {**kept, "error": error}  # the input fields, no text or tokens
    for row, rec, want in zip(ROWS[:3], [out[0], out[1], out[3]], expected[:3], strict=True):
        check_ran(row, rec, want)


def test_row_the_pool_cannot_hold_fails_alone(tiny_ckpts: dict[str, Path], tmp_path: Path) -> None:
    """A request refused on admission (it needs more KV than the pool has) fails alone; the
    batch around it still runs and is written in order."""
    overrides = [*OVERRIDES, "kv_pool.num_pages=24"]  # 92 KV tokens
    rows = [{"prompt_token_ids": [5 + i], "max_tokens": 3, "temperature": 0.0} for i in range(5)]
    rows[3] = {"prompt_token_ids": [3] * 60, "max_tokens": 60}
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps(r) for r in rows])
    dst = tmp_path / "out.jsonl"
    assert generate(src, dst, tiny_ckpts["llama"], overrides) == 1
    out = read_records(dst)
    assert out[3] == {**rows[3], "error": out[3]["error"]}
    assert out[3]["error"].startswith(f"{src}:4: ") and "KV tokens" in out[3]["error"]
    assert [len(r["token_ids"]) for i, r in enumerate(out) if i != 3] == [3, 3, 3, 3]
    assert [r["prompt_token_ids"] for r in out] == [r["prompt_token_ids"] for r in rows]


def test_exit_codes_from_the_command_line(tiny_ckpts: dict[str, Path], tmp_path: Path) -> None:
    """No --output: texts on stdout, errors on stderr; exit 1 when a row failed, 2 when the
    command itself is wrong (the input file is missing)."""
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps(ROWS[0]), '{"prompt_token_ids": 5'])
    cmd = [sys.executable, "-m", "hyloop.cli", "generate", "--model", str(tiny_ckpts["llama"])]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = [*cmd, "--input", str(src), "--no-progress", *OVERRIDES]
    proc = subprocess.run(run, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"hyloop: error: {src}:2: invalid JSON" in proc.stderr
    assert ">>> [5, 6, 7, 8]" in proc.stdout and "invalid JSON" not in proc.stdout
    missing = [*cmd, "--input", str(tmp_path / "nope.jsonl"), *OVERRIDES]
    proc = subprocess.run(missing, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "nope.jsonl" in proc.stderr


def test_generate_with_speculative_config_writes_the_same_rows(
    tiny_ckpts: dict[str, Path], tmp_path: Path, expected: list[RequestOutput]
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps(r) for r in ROWS])
    dst = tmp_path / "out.jsonl"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    argv = ["generate", "--model", str(tiny_ckpts["llama"]), "--input", str(src), "--no-progress"]
    assert main([*argv, "--speculative-config", spec, "--output", str(dst), *OVERRIDES]) == 0
    for row, rec, want in zip(ROWS, read_records(dst), expected, strict=True):
        check_ran(row, rec, want)
    with pytest.raises(SystemExit):
        main([*argv, "--speculative-config", '{"method": "eagle"}', *OVERRIDES])
