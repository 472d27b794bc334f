"""``hyloop generate`` rows with ``messages``: rendered with the model's chat template.

A chat row must produce exactly the tokens of a ``prompt_token_ids`` row holding the chat-templated
ids (from transformers on the same SmolLM2 GGUF file, and from the tokenizer on a tiny checkpoint);
a model with no tokenizer or no chat template fails the row alone (an error record naming its line
and the reason; exit 1) while the other rows run.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from hyloop.cli import main

GREEDY = {"temperature": 0.0}  # a row's default temperature is vLLM's, 1.0
TINY_OVERRIDES = ["graphs.backend=eager", "kv_pool.num_pages=64", "model.max_context=64"]
CHAT = [{"role": "user", "content": "hi there"}]
WORDS = ["[UNK]", "<s>", "</s>", "hi", "there", "user", "system", "assistant", "be", "brief"]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)
USER_FIRST = (
    "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the chat must open with the "
    "user') }}{% endif %}" + TEMPLATE
)


def run_generate(
    tmp_path: Path, model: Path, rows: list[dict[str, Any]], overrides: list[str]
) -> list[dict[str, Any]]:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dst = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(model), "--input", str(src), "--output", str(dst)]
    assert main([*argv, "--no-progress", *overrides]) == 0
    return [json.loads(line) for line in dst.read_text().splitlines()]


def refusal(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run two good rows and a chat row (line 3): the chat row fails alone, exit 1."""
    good = {"ignore_eos": True}  # the default max_tokens, 16, each
    rows = [{"prompt_token_ids": [5, 6], **good}, {"prompt_token_ids": [7], **good}]
    rows.append({"messages": CHAT})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dst = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(model), "--input", str(src), "--output", str(dst)]
    assert main([*argv, "--no-progress", *TINY_OVERRIDES]) == 1
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [len(r["token_ids"]) for r in out[:2]] == [16, 16]
    assert out[2] == {"messages": CHAT, "error": out[2]["error"]}
    assert out[2]["error"].startswith(f"{src}:3: messages: ")
    err = capsys.readouterr().err
    assert f"{src}:3: messages:" in err
    return out[2]["error"]


def with_tokenizer(tmp_path: Path, ckpt: Path, template: str | None) -> Path:
    """A copy of the tiny checkpoint with a word-level tokenizer.json (and a chat template)."""
    model = tmp_path / "ckpt"
    shutil.copytree(ckpt, model)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model / "tokenizer.json"))
    if template is not None:
        (model / "chat_template.jinja").write_text(template)
    return model


def test_chat_row_is_refused_without_a_tokenizer(
    tiny_ckpts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refusal(tmp_path, tiny_ckpts["llama"], capsys)
    assert "no tokenizer" in err


def test_chat_row_is_refused_without_a_chat_template(
    tiny_ckpts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refusal(tmp_path, with_tokenizer(tmp_path, tiny_ckpts["llama"], None), capsys)
    assert "no chat template" in err


def test_chat_row_the_template_rejects_names_the_line(
    tiny_ckpts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = with_tokenizer(tmp_path, tiny_ckpts["llama"], USER_FIRST)
    src = tmp_path / "in.jsonl"
    chat = [{"role": "system", "content": "be brief"}, *CHAT]
    src.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": chat}) + "\n")
    argv = ["generate", "--model", str(model), "--input", str(src), "--no-progress"]
    assert main([*argv, *TINY_OVERRIDES]) == 1  # no --output: errors on stderr
    out, err = capsys.readouterr()
    assert f"{src}:2: messages:" in err and "must open with the user" in err
    assert out.count(">>> ") == 1  # the first chat ran


def test_chat_row_equals_its_templated_ids_on_a_tiny_checkpoint(
    tiny_ckpts: dict[str, Path], tmp_path: Path
) -> None:
    model = with_tokenizer(tmp_path, tiny_ckpts["llama"], TEMPLATE)
    # The template renders "user hi there assistant".
    templated = [WORDS.index(w) for w in ["user", "hi", "there", "assistant"]]
    rows = [
        {"id": "chat", "messages": CHAT, "max_tokens": 6, "ignore_eos": True, **GREEDY},
        {"id": "ids", "prompt_token_ids": templated, "max_tokens": 6, "ignore_eos": True, **GREEDY},
    ]
    chat, ids = run_generate(tmp_path, model, rows, TINY_OVERRIDES)
    assert chat["messages"] == CHAT  # input fields kept
    assert len(chat["token_ids"]) == 6
    assert chat["token_ids"] == ids["token_ids"]


@pytest.mark.slow
def test_chat_row_equals_transformers_templated_ids_on_smollm2(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from hyloop.recipes.offline import default_checkpoint

    try:
        gguf = default_checkpoint()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    hf_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Name a primary colour."},
        ],
    ]
    rows: list[dict[str, Any]] = []
    for chat in chats:
        enc = hf_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        templated = list(enc["input_ids"] if isinstance(enc, Mapping) else enc)
        rows.append({"messages": chat, "max_tokens": 6, "ignore_eos": True, **GREEDY})
        rows.append({"prompt_token_ids": templated, "max_tokens": 6, "ignore_eos": True, **GREEDY})
    overrides = [
        "graphs.backend=eager",
        "model.max_context=256",
        "kv_pool.page_size=16",
        "kv_pool.num_pages=32",
    ]
    out = run_generate(tmp_path, gguf, rows, overrides)
    for chat_out, ids_out in zip(out[::2], out[1::2], strict=True):
        assert len(chat_out["token_ids"]) == 6
        assert chat_out["token_ids"] == ids_out["token_ids"]
        assert chat_out["text"] == ids_out["text"] and chat_out["text"]
