"""``JobOutput``: paths checked first, resume from whole lines only, the fingerprint kept under
the cache (never beside the output), and what the job recipes share (``job``)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from hyloop.recipes.job import Interrupted, JobSignals, check_strings, read_input, row_seed
from hyloop.recipes.job_output import JobOutput, SameRow, check_paths, fingerprint


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYLOOP_CACHE_DIR", str(tmp_path / "cache"))


def same_id(ids: list[str]) -> SameRow:
    return lambda k, rec: rec.get("id") == ids[k]


def lines(*ids: str) -> str:
    return "".join(json.dumps({"id": i, "v": 1}) + "\n" for i in ids)


def test_a_job_writes_whole_lines_and_resumes_after_a_torn_one(tmp_path: Path) -> None:
    dst = tmp_path / "out" / "o.jsonl"
    dst.parent.mkdir()
    ids = ["a", "b", "c"]
    out = JobOutput(str(dst))
    assert out.check(None, resume=True, rows=3, same_row=same_id(ids)) == 0  # missing: all run
    out.open("job-1")
    out.write(lines("a", "b"))
    os.close(out._fd)  # killed: no close, the record stays  # noqa: SLF001
    with dst.open("a") as fh:
        fh.write('{"id": "c", "v"')  # a kill inside a write
    again = JobOutput(str(dst))
    assert again.check(None, resume=True, rows=3, same_row=same_id(ids)) == 2
    again.open("job-1")
    again.write(lines("c"))
    again.close()
    assert dst.read_text() == lines("a", "b", "c")
    assert sorted(p.name for p in dst.parent.iterdir()) == ["o.jsonl"]  # nothing beside it
    assert not list((tmp_path / "cache" / "jobs").iterdir())  # finished: the record goes


def test_resume_refuses_what_this_job_did_not_write(tmp_path: Path) -> None:
    dst = tmp_path / "o.jsonl"
    out = JobOutput(str(dst))
    out.check(None, resume=False, rows=3, same_row=same_id(["a", "b", "c"]))
    out.open("job-1")
    out.write(lines("a"))
    os.close(out._fd)  # noqa: SLF001
    with pytest.raises(ValueError, match="pass --resume"):
        JobOutput(str(dst)).check(None, resume=False, rows=3, same_row=same_id(["a", "b", "c"]))
    with pytest.raises(ValueError, match=r"o.jsonl:1 is not the output of input line 1"):
        JobOutput(str(dst)).check(None, resume=True, rows=3, same_row=same_id(["x", "b", "c"]))
    other = JobOutput(str(dst))
    other.check(None, resume=True, rows=3, same_row=same_id(["a", "b", "c"]))
    with pytest.raises(ValueError, match="another input or config"):
        other.open("job-2")
    assert dst.read_text() == lines("a")  # refused: untouched
    stray = tmp_path / "s.jsonl"
    stray.write_text(lines("a"))
    lone = JobOutput(str(stray))
    lone.check(None, resume=True, rows=3, same_row=same_id(["a", "b", "c"]))
    with pytest.raises(ValueError, match="no record of the job"):
        lone.open("job-1")


def test_paths_are_checked_before_anything_is_written(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    with pytest.raises(ValueError, match="resolves to the input file"):
        check_paths(str(src), str(tmp_path / "sub" / ".." / "in.jsonl"))
    (tmp_path / "sub").mkdir()
    os.symlink(src, tmp_path / "sub" / "link.jsonl")
    with pytest.raises(ValueError, match="resolves to the input file"):
        check_paths(str(src), str(tmp_path / "sub" / "link.jsonl"))
    with pytest.raises(ValueError, match="is a directory"):
        check_paths(str(src), str(tmp_path))
    with pytest.raises(ValueError, match="no folder"):
        check_paths(str(src), str(tmp_path / "nope" / "o.jsonl"))
    with pytest.raises(ValueError, match="--resume needs an output file"):
        JobOutput(None).check(str(src), resume=True, rows=1, same_row=same_id(["a"]))


def test_input_lines_decode_alone(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"a": 1}\n{"b": "\xe9"}\n{"c": 3}\n')
    data, texts = read_input(str(src))
    assert data == src.read_bytes()
    assert texts[0] == '{"a": 1}' and texts[2] == '{"c": 3}'
    assert isinstance(texts[1], ValueError)
    assert str(texts[1]) == f"{src}:2: byte 0xe9 at column 8 is not UTF-8"
    with pytest.raises(ValueError, match="is a directory; expected a JSONL file"):
        read_input(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_input(str(tmp_path / "missing.jsonl"))


def test_row_seeds_and_fingerprints() -> None:
    assert row_seed(0, "id 'a'") == row_seed(0, "id 'a'")
    assert len({row_seed(0, "id 'a'"), row_seed(1, "id 'a'"), row_seed(0, "line 2")}) == 3
    assert fingerprint(b"x", {"a": 1}) != fingerprint(b"y", {"a": 1})
    assert fingerprint(b"x", {"a": 1}) != fingerprint(b"x", {"a": 2})
    with pytest.raises(ValueError, match=r"row: body.messages\[1\].content: character 2"):
        check_strings("row", {"body": {"messages": [{}, {"content": "ok\udc80"}]}})


def test_a_signal_before_rows_run_interrupts_and_after_drains() -> None:
    drained: list[bool] = []
    with JobSignals() as signals:
        with pytest.raises(Interrupted) as e:
            os.kill(os.getpid(), signal.SIGTERM)
        assert e.value.exit_code == 143
    with JobSignals() as signals:
        signals.start(lambda: drained.append(True))
        os.kill(os.getpid(), signal.SIGINT)
        assert drained == [True] and signals.exit_code == 130 and signals.name == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
