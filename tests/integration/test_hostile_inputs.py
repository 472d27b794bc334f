"""Hostile and careless inputs to every batch recipe and the API: each gets a clear error naming
the field (or the file and line) and the reason, a bad row fails alone, and nothing is lost.

Kinds: the output naming the input, an existing output without ``--resume``, a directory as
input, a model path holding ``${x}``, a YAML syntax error (``run-batch``, ``generate``,
``warmup``), undecodable bytes, lone surrogates (ids, prompts, messages), numeric sampling fields
that are NaN, negative or overflow float32, fields clipped as vLLM clips them (``max_tokens``
past the context, ``top_k`` past the vocabulary, ``n`` up to 1000), ``temperature: Infinity``,
seeds past 64 bits, bad ``hyloop tts`` lines, ``generate`` after ``close()``, two threads
calling ``generate``.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from kill_resume import job_env

from hyloop import LLM, SamplingParams
from hyloop.cli import main

pytestmark = pytest.mark.slow
EAGER = ["graphs.backend=eager", "model.max_context=128"]
SURROGATE = "id-\udc00"


@pytest.fixture(autouse=True)
def _jobs_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resume records go to this test's own cache (the built kernels linked in)."""
    monkeypatch.setenv("HYLOOP_CACHE_DIR", job_env(tmp_path / "cache")["HYLOOP_CACHE_DIR"])


@pytest.fixture(scope="module")
def model(tiny_ckpts: dict[str, Path]) -> Path:
    return tiny_ckpts["llama"]


def batch_line(cid: str, **body: Any) -> str:
    row = {"custom_id": cid, "method": "POST", "url": "/v1/completions"}
    return json.dumps({**row, "body": {"prompt": [5, 6, 7], "max_tokens": 3, **body}})


def write(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def run_batch(src: Path, dst: Path, model: Path, *extra: str) -> int:
    argv = ["run-batch", "-i", str(src), "-o", str(dst), "--model", str(model), "--no-progress"]
    return main([*argv, *extra, *EAGER])


def test_run_batch_bad_lines_fail_alone_and_name_their_field(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases: list[tuple[str | bytes, str | None]] = [
        (batch_line("ok-0", temperature=0), None),
        (batch_line(SURROGATE), "custom_id: character 3 is '\\udc00', a lone surrogate"),
        (b'{"custom_id": "bytes", "body": "\xff\xfe"}', "rows.jsonl:3: byte 0xff at column 33"),
        (batch_line("t-big", temperature=1e300), "body.temperature: got 1e+300; expected a float"),
        (batch_line("t-nan", temperature=float("nan")), "body.temperature: got nan"),
        (batch_line("rep", repetition_penalty=1e300), "body.repetition_penalty: got 1e+300"),
        (batch_line("neg", top_p=-0.5), "body.top_p: got -0.5; expected a float in (0, 1]"),
        (batch_line("min-p", min_p=float("nan")), "body.min_p: got nan"),
        (batch_line("n-big", n=1001), "body.n: got 1001; expected an int in [1, 1000]"),
        (batch_line("bias", logit_bias={"5": 1e300}), "body.logit_bias['5']: got 1e+300"),
        (batch_line("ok-long", max_tokens=10**6, temperature=0), None),
        (batch_line("ok-topk", top_k=10**12, seed=3), None),
        (batch_line("ok-inf", temperature=float("inf"), seed=1), None),
        (batch_line("ok-n", n=3, seed=2**70), None),
        (batch_line("ok-last", temperature=0), None),
    ]
    src = write(tmp_path / "rows.jsonl", [line for line, _ in cases])
    dst = tmp_path / "out" / "out.jsonl"
    dst.parent.mkdir()
    assert run_batch(src, dst, model) == 0
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert len(out) == len(cases)
    for n, (line, (_, needle)) in enumerate(zip(out, cases, strict=True), 1):
        if needle is None:
            assert line["error"] is None, line
        else:
            assert line["response"]["body"] is None and line["error"]["message"].startswith(
                f"line {n}"
            ), line
            assert needle in line["error"]["message"], line["error"]["message"]
    by_id = {line["custom_id"]: line["response"]["body"] for line in out if line["error"] is None}
    (choice,) = by_id["ok-long"]["choices"]
    assert choice["finish_reason"] == "length"  # stopped at the context, as vLLM clips it
    assert by_id["ok-long"]["usage"]["total_tokens"] == 128
    assert len(by_id["ok-n"]["choices"]) == 3
    assert "Traceback" not in capsys.readouterr().err


def test_seeds_of_any_size_sample_differently(model: Path) -> None:
    with LLM(model=model, overrides=EAGER) as llm:
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12) for s in (0, 2**32, 2**70)]
        outs = llm.generate([[5, 6, 7]] * 3, params, use_tqdm=False)
        again = llm.generate([[5, 6, 7]], params[2], use_tqdm=False)
    tokens = [tuple(o.outputs[0].token_ids) for o in outs]
    assert len(set(tokens)) == 3, tokens  # no truncation to 32 bits
    assert tuple(again[0].outputs[0].token_ids) == tokens[2]


def test_infinite_temperature_samples_uniformly_among_the_kept_tokens(model: Path) -> None:
    allowed = [5, 6, 7, 8]
    params = SamplingParams(temperature=float("inf"), seed=1, max_tokens=120, ignore_eos=True)
    params.allowed_token_ids = allowed
    with LLM(model=model, overrides=EAGER) as llm:
        (out,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    ids = out.outputs[0].token_ids
    assert len(ids) == 120 and set(ids) <= set(allowed)  # masked tokens stay out
    assert min(ids.count(t) for t in allowed) >= 15  # each about a quarter (120 / 4 = 30)


def test_the_output_is_checked_before_anything_is_written(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write(tmp_path / "rows.jsonl", [batch_line("a")])
    before = src.read_bytes()
    assert run_batch(src, src, model) == 2  # the output is the input
    assert "resolves to the input file" in capsys.readouterr().err
    assert run_batch(src, tmp_path / "." / "rows.jsonl", model) == 2
    assert src.read_bytes() == before
    assert run_batch(tmp_path, tmp_path / "out.jsonl", model) == 2  # a directory as input
    assert "is a directory; expected a JSONL file" in capsys.readouterr().err
    dst = tmp_path / "out.jsonl"
    dst.write_text("keep me\n")
    assert run_batch(src, dst, model) == 2  # exists, and no --resume
    assert "pass --resume" in capsys.readouterr().err and dst.read_text() == "keep me\n"
    assert run_batch(src, tmp_path / "no" / "out.jsonl", model) == 2
    assert "no folder" in capsys.readouterr().err
    literal = tmp_path / "${x}" / "model"
    assert run_batch(src, tmp_path / "new.jsonl", literal) == 2  # taken literally
    err = capsys.readouterr().err
    assert f"--model {literal}: no such file" in err and "Interpolation" not in err
    assert not (tmp_path / "new.jsonl").exists()  # failed early: no output created


@pytest.mark.parametrize("command", ["run-batch", "generate", "warmup"])
def test_yaml_syntax_errors_name_file_line_and_column(
    tmp_path: Path, model: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("graphs:\n  backend: eager\n  buckets: [1, 2\nseed: 3\n")
    src = write(tmp_path / "rows.jsonl", [batch_line("a")])
    argv = {
        "run-batch": ["run-batch", "-i", str(src), "-o", str(tmp_path / "o.jsonl")],
        "generate": ["generate", "--input", str(src), "--output", str(tmp_path / "o.jsonl")],
        "warmup": ["warmup"],
    }[command]
    assert main([*argv, "--model", str(model), "--config", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"{re.escape(str(bad))}:4:\d+: invalid YAML", err), err
    assert "Traceback" not in err
    assert not (tmp_path / "o.jsonl").exists()


def test_generate_bad_lines_fail_alone(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines: list[str | bytes] = [
        json.dumps({"id": "a", "prompt_token_ids": [5, 6], "max_tokens": 2, "temperature": 0}),
        b'{"id": "\xc3\x28", "prompt_token_ids": [5]}',
        json.dumps({"id": SURROGATE, "prompt_token_ids": [5], "max_tokens": 2}),
        json.dumps({"prompt": "hi \ud800", "max_tokens": 2}),
        json.dumps({"messages": [{"role": "user", "content": "\udfff"}]}),
        json.dumps({"prompt_token_ids": [5], "temperature": 1e300}),
        json.dumps({"prompt_token_ids": [5], "presence_penalty": float("nan")}),
        json.dumps({"id": "z", "prompt_token_ids": [7, 8], "max_tokens": 2, "temperature": 0}),
    ]
    src = write(tmp_path / "in.jsonl", lines)
    dst = tmp_path / "out.jsonl"
    argv = ["generate", "--input", str(src), "--output", str(dst), "--model", str(model)]
    assert main([*argv, "--no-progress", *EAGER]) == 1
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    errors = [r.get("error") for r in out]
    assert errors[0] is None and errors[-1] is None
    needles = [
        f"{src}:2: byte 0xc3 at column 9 is not UTF-8",
        f"{src}:3: id: character 3 is '\\udc00', a lone surrogate",
        f"{src}:4: prompt: character 3 is '\\ud800'",
        f"{src}:5: messages[0].content: character 0 is '\\udfff'",
        f"{src}:6: temperature: got 1e+300; expected a float in [0, 3.403e+38]",
        f"{src}:7: presence_penalty: got nan; expected a float in [-2, 2]",
    ]
    for got, needle in zip(errors[1:-1], needles, strict=True):
        assert got is not None and got.startswith(needle), (got, needle)
    assert "Traceback" not in capsys.readouterr().err


def test_tts_bad_lines_fail_alone(
    moss_local_ckpts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = moss_local_ckpts["nvq3_v16_l1"]
    (tmp_path / "junk.npy").write_text("not an array")
    good = [[3, 16, 16, 16], [4, 16, 16, 16], [250, 1, 2, 3]]
    lines: list[str | bytes] = [
        json.dumps({"id": "a", "rows": good, "max_frames": 3, "ignore_stop": True}),
        json.dumps({"id": "b", "rows": [[3, 99, 1, 1]], "max_frames": 3}),
        json.dumps({"id": "c", "rows_npy": "junk.npy", "max_frames": 3}),
        json.dumps({"id": "d", "text": "hi", "voice": [[1, 2, 300]], "max_frames": 3}),
        json.dumps({"id": "e", "rows": good, "max_frames": 3, "audio_temperature": 1e300}),
        json.dumps({"id": "f", "rows": good, "max_frames": 3, "temp": 1}),
        b"{not json",
        json.dumps({"id": "g", "rows": good, "max_frames": 4, "ignore_stop": True}),
    ]
    src = write(tmp_path / "in.jsonl", lines)
    dst = tmp_path / "out" / "res.jsonl"
    argv = ["tts", "--model", str(ckpt), "--input", str(src), "--output", str(dst)]
    assert main([*argv, "--no-progress", "graphs.backend=eager"]) == 1
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r.get("id") for r in out] == ["a", "b", "c", "d", "e", "f", None, "g"]
    assert (out[0]["num_frames"], out[-1]["num_frames"]) == (3, 4)
    needles = [
        f"{src}:2: rows: row 0 channel 1 id 99 outside [0, 17)",
        f"{src}:3: rows_npy: {tmp_path / 'junk.npy'} is not an .npy array",
        f"{src}:4: voice: codes in [1, 300]; expected [0, 16)",
        f"{src}:5: frame.audio_temperature: got 1e+300",
        f"{src}:6: unknown field(s) ['temp']",
        f"{src}:7: invalid JSON",
    ]
    err = capsys.readouterr().err
    for rec, needle in zip(out[1:-1], needles, strict=True):
        assert rec["error"].startswith(needle), (rec["error"], needle)
        assert f"hyloop: error: {rec['error']}" in err
    assert "Traceback" not in err


def test_the_api_refuses_clearly_and_serves_two_threads(model: Path) -> None:
    llm = LLM(model=model, overrides=EAGER)
    with pytest.raises(ValueError, match=r"prompt: character 1 is '\\udc00'"):
        llm.generate({"prompt": "a\udc00"}, use_tqdm=False)
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=24)
    prompts = [[5 + i, 6, 7] for i in range(6)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def call(k: int) -> None:
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            got[k] = [o.outputs[0].token_ids for o in outs]
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and got == {0: alone, 1: alone}
    llm.engine.check_invariants()
    llm.close()
    with pytest.raises(RuntimeError, match=r"LLM.generate: this LLM was closed \(LLM.close\(\)\)"):
        llm.generate([[5, 6]], use_tqdm=False)
