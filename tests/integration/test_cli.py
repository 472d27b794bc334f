"""``hyloop generate``: JSONL in, JSONL out in input order; a bad row exits 2 naming its line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hyloop import LLM, SamplingParams
from hyloop.cli import main

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "graphs.backend=eager",
    "kv_pool.page_size=4",
    "kv_pool.num_pages=256",
    "model.max_context=128",
]
ROWS: list[dict[str, Any]] = [
    {"id": "first", "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True},
    {"prompt_token_ids": [90] * 20, "temperature": 0.9, "seed": 4, "max_tokens": 9},
    {"id": 3, "prompt_token_ids": [1, 2, 3], "max_tokens": 2, "logprobs": 2},
    {"prompt_token_ids": [200, 201], "max_tokens": 12, "top_k": 5, "temperature": 1.0, "seed": 8},
    {"prompt_token_ids": [44], "max_tokens": 1},
]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def expected_tokens(ckpt: Path) -> list[list[int]]:
    """The same rows through the Python API (fields the row omits come from the defaults)."""
    with LLM(model=ckpt, overrides=OVERRIDES) as llm:
        d = llm.engine.default_params()
        params = []
        for row in ROWS:
            fields = {k: v for k, v in row.items() if k not in ("id", "prompt_token_ids")}
            base = {"temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k}
            params.append(SamplingParams(**{**base, "max_tokens": d.max_tokens, **fields}))
        outs = llm.generate([r["prompt_token_ids"] for r in ROWS], params, use_tqdm=False)
    return [o.token_ids for o in outs]


def test_generate_keeps_order_and_adds_fields(tiny_ckpts: dict[str, Path], tmp_path: Path) -> None:
    ckpt = tiny_ckpts["llama"]
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps(r) for r in ROWS])
    dst = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(ckpt), "--input", str(src), "--output", str(dst)]
    assert main([*argv, "--no-progress", *OVERRIDES]) == 0
    out_rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(out_rows) == len(ROWS)
    for row, out, want in zip(ROWS, out_rows, expected_tokens(ckpt), strict=True):
        for key, value in row.items():
            assert out[key] == value  # input fields kept, rows in input order
        assert out["token_ids"] == want
        assert out["finish_reason"] in ("stop", "length")
        assert len(out["token_ids"]) <= row["max_tokens"]
        assert "text" in out and out["text"] is None  # the tiny checkpoint has no tokenizer
    assert len(out_rows[0]["token_ids"]) == 6 and out_rows[0]["finish_reason"] == "length"


PARSE_ERRORS = [
    ("{not json", "invalid JSON"),
    ('{"max_tokens": 3}', "prompt"),
    ('{"prompt_token_ids": [1, 2], "prompt": "x"}', "prompt"),
    ('{"prompt_token_ids": [1, 2], "temprature": 0.5}', "temprature"),
    ("[1, 2, 3]", "prompt"),
    ('{"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}', "messages"),
    ('{"messages": [{"role": "user", "content": "hi"}], "prompt_token_ids": [1]}', "messages"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": "hi"}', "non-empty list"),
    ('{"messages": [{"role": "user", "content": "hi"}, "hi"]}', "messages[1]"),
    ('{"messages": [{"role": "user"}]}', "string `role` and `content`"),
    ('{"messages": [{"role": "user", "content": 5}]}', "messages[0]"),
]
VALUE_ERRORS = [
    ('{"prompt_token_ids": [1, 2], "max_tokens": 0}', "max_tokens"),
    ('{"prompt_token_ids": [1, 2], "temperature": "hot"}', "temperature"),
    ('{"prompt_token_ids": [1, 999]}', "999"),
    ('{"prompt_token_ids": []}', "empty"),
]
STRING_IDS = ('{"prompt_token_ids": "1 2 3"}', "prompt_token_ids")


@pytest.mark.parametrize(("bad", "named"), [*PARSE_ERRORS, *VALUE_ERRORS, STRING_IDS])
def test_bad_row_exits_2_naming_the_line(
    tiny_ckpts: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    bad: str,
    named: str,
) -> None:
    lines = [json.dumps(ROWS[0]), "", json.dumps(ROWS[1]), bad, json.dumps(ROWS[2])]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    dst = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(tiny_ckpts["llama"]), "--input", str(src)]
    code = main([*argv, "--output", str(dst), "--no-progress", *OVERRIDES])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{src}:4" in err  # blank lines still count
    assert named in err
    assert not dst.exists()  # nothing half-written


def test_exit_code_from_the_command_line(tiny_ckpts: dict[str, Path], tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps(ROWS[0]), '{"prompt_token_ids": 5'])
    cmd = [sys.executable, "-m", "hyloop.cli", "generate", "--model", str(tiny_ckpts["llama"])]
    cmd += ["--input", str(src), "--no-progress", *OVERRIDES]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"{src}:2" in proc.stderr
