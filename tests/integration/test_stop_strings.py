"""Stop strings and detokenizing options end to end on SmolLM2 (GGUF), greedy.

transformers' ``generate(stop_strings=...)`` is the oracle for where a request stops: it ends on
the token that completes a stop string, as vLLM does, so the token ids must be equal. It does
not cut text, so the text is checked against the whole decode cut as vLLM cuts it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hyloop import LLM, SamplingParams
from hyloop.recipes.openai_batch import CHAT, sampling_fields

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
# (prompt, stop strings): spanning tokens, ending inside a token (" Nova"), across a newline
CASES: list[tuple[str, list[str]]] = [
    ("The capital of France is", ["answer is"]),
    ("Once upon a time", [" Nov", "zzz"]),
    ("List three colors:\n1.", ["3."]),
]


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> Iterator[LLM]:
    overrides = [
        "graphs.backend=eager",
        "model.max_context=256",
        "kv_pool.page_size=16",
        "kv_pool.num_pages=32",
        "model.weights=dequantize",  # transformers, the oracle, dequantizes the file
    ]
    with LLM(model=gguf_path, overrides=overrides) as llm:
        yield llm


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": NEW_TOKENS, **kw})


def prompt_ids(llm: LLM, prompt: str) -> list[int]:
    assert llm.tokenizer is not None
    return list(llm.tokenizer.encode(prompt))


@pytest.fixture(scope="module")
def hf_ids(gguf_path: Path, llm: LLM) -> list[list[int]]:
    """transformers' greedy continuation of each case, stopped by its stop strings."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf_path.parent), gguf_path.name
    hf = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
    out = []
    for prompt, stop in CASES:
        ids = prompt_ids(llm, prompt)
        with torch.no_grad():
            seq = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                stop_strings=stop,
                tokenizer=hf_tok,
            )
        out.append(seq[0, len(ids) :].tolist())
    return out


@pytest.mark.parametrize("include", [False, True], ids=["cut", "included"])
def test_stop_strings_stop_where_transformers_stops(
    llm: LLM, hf_ids: list[list[int]], include: bool
) -> None:
    prompts = [prompt_ids(llm, p) for p, _ in CASES]
    params = [greedy(stop=s, include_stop_str_in_output=include) for _, s in CASES]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.tokenizer is not None
    for (_, stop), out, ref in zip(CASES, outs, hf_ids, strict=True):
        sample = out.outputs[0]
        assert sample.token_ids == ref
        assert (sample.finish_reason, sample.stop_reason) == ("stop", stop[0])
        whole = llm.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        cut = whole.index(stop[0]) + (len(stop[0]) if include else 0)
        assert sample.text == whole[:cut]


def drive(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams) -> list[str]:
    eng = llm.engine
    eng.add_request(request_id, prompt, params)
    texts: list[str] = []
    while eng.has_unfinished_requests():
        texts += [o.outputs[0].text for o in eng.step() if o.request_id == request_id]
    return texts


def test_delta_stream_shows_no_partial_stop_string(llm: LLM) -> None:
    prompt = prompt_ids(llm, CASES[2][0])
    final = llm.generate([prompt], greedy(stop=["3."]), use_tqdm=False)[0].outputs[0].text
    assert final == " Red\n2. Blue\n"
    texts = drive(llm, "delta", prompt, greedy(stop=["3.", "Green"], output_kind="delta"))
    assert "".join(texts) == final and len(texts) > 2
    shown = ""
    for piece in texts:  # "3" arrives one token before "." and is never shown
        shown += piece
        assert final.startswith(shown)


def test_stop_string_matched_on_the_last_allowed_token_is_a_stop(llm: LLM) -> None:
    prompt = prompt_ids(llm, CASES[2][0])
    full = llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0]
    n = len(llm.generate([prompt], greedy(stop=["3."]), use_tqdm=False)[0].outputs[0].token_ids)
    out = llm.generate([prompt], greedy(stop=["3."], max_tokens=n), use_tqdm=False)[0]
    sample = out.outputs[0]
    assert (sample.finish_reason, sample.stop_reason) == ("stop", "3.")
    assert sample.token_ids == full.token_ids[:n]


def chat(llm: LLM, text: str) -> list[int]:
    assert llm.tokenizer is not None
    rendered = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    assert isinstance(rendered, list)
    return rendered


def test_special_tokens_shown_and_the_ending_eos_only_when_included(llm: LLM) -> None:
    prompt = chat(llm, "What is 2+2? Answer with just the number.")
    shown = [greedy(skip_special_tokens=False, include_stop_str_in_output=i) for i in (True, False)]
    plain, included, eos_text = llm.generate([prompt] * 3, [greedy(), *shown], use_tqdm=False)
    assert plain.outputs[0].finish_reason == "stop"  # ended by EOS
    assert plain.outputs[0].stop_reason is None
    assert included.outputs[0].text == plain.outputs[0].text + "<|im_end|>"
    assert eos_text.outputs[0].text == plain.outputs[0].text  # vLLM hides the stop token


def test_detokenize_false_gives_ids_and_no_text(llm: LLM) -> None:
    prompt = prompt_ids(llm, CASES[0][0])
    with_text, without = llm.generate(
        [prompt] * 2, [greedy(), greedy(detokenize=False)], use_tqdm=False
    )
    assert without.outputs[0].text == "" and with_text.outputs[0].text
    assert without.outputs[0].token_ids == with_text.outputs[0].token_ids
    with pytest.raises(ValueError, match="detokenize"):
        llm.engine.add_request("no-text", prompt, greedy(stop=["x"], detokenize=False))


def test_openai_batch_bodies_pass_stop_fields_through() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "stop": "\n"}
    body |= {"include_stop_str_in_output": True, "spaces_between_special_tokens": False}
    fields = sampling_fields("line 1", CHAT, body)
    assert fields == {
        "stop": "\n",
        "include_stop_str_in_output": True,
        "spaces_between_special_tokens": False,
    }
