"""``LLM.beam_search`` by vLLM's rules, against a beam search over transformers' logits on a
tiny checkpoint (each beam's next-token log-softmax from a full forward of its sequence): widths
1, 2, 4, length penalties over beams finished by EOS, ``ignore_eos``, a batch of prompts and
``concurrency_limit``; the beams share their prefix KV through the radix tree; bad params fail
naming the field."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_DENSE, build_hf_checkpoint, load_hf_model
from tokenizers import Tokenizer, models, pre_tokenizers
from tqdm.auto import tqdm

from hyloop import LLM, TextPrompt, TokensPrompt
from hyloop.beam_search import BeamSearchOutput, BeamSearchSequence
from hyloop.sampling_params import BeamSearchParams

pytestmark = pytest.mark.slow

P0 = [5, 9, 3, 12, 9, 9]
P1 = [7, 7, 8, 30, 41]
STEPS = 8
EAGER = ["graphs.backend=eager", "model.max_context=128", "kv_pool.num_pages=1024"]
Beam = tuple[list[int], float]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf_checkpoint(tmp_path_factory.mktemp("beams") / "llama", TINY_DENSE["llama"])


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> torch.nn.Module:
    return load_hf_model(ckpt)


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> Iterator[LLM]:
    with LLM(model=ckpt, overrides=EAGER) as llm:
        yield llm


@pytest.fixture(scope="module")
def eos_id(hf: torch.nn.Module) -> int:
    """The second most likely token after ``P0``: always a first-step candidate, so with it as
    EOS a beam finishes at the first step and competes with the longer ones at the end."""
    return int(torch.topk(_next_logprobs(hf, [P0])[0], 2).indices[1])


@pytest.fixture(scope="module")
def eos_llm(ckpt: Path, eos_id: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    """The same weights with ``eos_id`` as EOS, and a word-level tokenizer (``t<id>``)."""
    model = tmp_path_factory.mktemp("eos") / "llama"
    shutil.copytree(ckpt, model)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model / name).read_text())
        (model / name).write_text(json.dumps(cfg | {"eos_token_id": eos_id}))
    vocab = {f"t{i}": i for i in range(TINY_DENSE["llama"]["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model / "tokenizer.json"))
    with LLM(model=model, overrides=EAGER) as llm:
        yield llm


def _next_logprobs(hf: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor(seqs)).logits[:, -1].float()
    return torch.log_softmax(logits, dim=-1)


def _score(beam: Beam, eos: set[int], length_penalty: float) -> float:
    tokens, cum = beam
    length = len(tokens) - (tokens[-1] in eos)
    return cum / length**length_penalty


def _reference(
    hf: torch.nn.Module,
    prompt: list[int],
    width: int,
    eos: set[int],
    length_penalty: float = 1.0,
    ignore_eos: bool = False,
    steps: int = STEPS,
) -> list[Beam]:
    """vLLM's rules: each beam's top ``2 * width`` tokens are candidates; one ending in EOS is
    finished, the ``width`` best of the rest live on; finished and live beams ranked at the end."""

    def rank(beams: list[Beam]) -> list[Beam]:
        return sorted(beams, key=lambda b: _score(b, eos, length_penalty), reverse=True)[:width]

    live: list[Beam] = [(list(prompt), 0.0)]
    done: list[Beam] = []
    for _ in range(steps):
        if not live:
            break
        lps = _next_logprobs(hf, [tokens for tokens, _ in live])  # a step's beams: one length
        candidates: list[Beam] = []
        for (tokens, cum), lp in zip(live, lps, strict=True):
            top = torch.topk(lp, 2 * width)
            for value, tok in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                child = ([*tokens, tok], cum + value)
                (done if tok in eos and not ignore_eos else candidates).append(child)
        live = rank(candidates)
    return rank(done + live)


def _check(out: BeamSearchOutput, want: list[Beam], eos: set[int], ignore_eos: bool) -> None:
    got = out.sequences
    assert [s.tokens for s in got] == [tokens for tokens, _ in want]
    for seq, (tokens, cum) in zip(got, want, strict=True):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
        new = len(seq.logprobs)
        assert sum(e[t].logprob for e, t in zip(seq.logprobs, tokens[-new:], strict=True)) == (
            pytest.approx(seq.cum_logprob, abs=1e-6)
        )
        ended = tokens[-1] in eos and not ignore_eos
        assert seq.finish_reason == ("stop" if ended else "length")
        assert seq.stop_reason is None


@pytest.mark.parametrize("width", [1, 2, 4])
def test_beams_match_the_reference(llm: LLM, hf: torch.nn.Module, width: int) -> None:
    eos = set(llm.llm_engine.eos_ids)
    [out] = llm.beam_search([TokensPrompt(prompt_token_ids=P0)], BeamSearchParams(width, STEPS))
    _check(out, _reference(hf, P0, width, eos), eos, ignore_eos=False)
    assert len(out.sequences) == width
    assert all(s.text is None for s in out.sequences)  # no tokenizer: no text
    assert all(s.tokens[: len(P0)] == P0 for s in out.sequences)  # tokens include the prompt


@pytest.mark.parametrize("length_penalty", [1.0, 0.3, 2.0])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_eos_beams_finish_and_compete_by_length_penalty(
    eos_llm: LLM, hf: torch.nn.Module, eos_id: int, width: int, length_penalty: float
) -> None:
    eos = {eos_id}
    params = BeamSearchParams(width, STEPS, length_penalty=length_penalty)
    [out] = eos_llm.beam_search([P0], params)
    want = _reference(hf, P0, width, eos, length_penalty)
    _check(out, want, eos, ignore_eos=False)
    scores = [_score((s.tokens, s.cum_logprob), eos, length_penalty) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)  # best first


def test_length_penalty_changes_which_beams_win(hf: torch.nn.Module, eos_id: int) -> None:
    """The reference itself: EOS beams are in play, and the penalty reorders them."""
    short = _reference(hf, P0, 2, {eos_id}, length_penalty=0.3)
    long = _reference(hf, P0, 2, {eos_id}, length_penalty=2.0)
    assert any(tokens[-1] == eos_id for tokens, _ in short + long)
    assert short != long


@pytest.mark.parametrize("width", [1, 4])
def test_ignore_eos_keeps_eos_beams_alive(
    eos_llm: LLM, hf: torch.nn.Module, eos_id: int, width: int
) -> None:
    params = BeamSearchParams(width, STEPS, ignore_eos=True)
    [out] = eos_llm.beam_search(P0, params)
    _check(out, _reference(hf, P0, width, {eos_id}, ignore_eos=True), {eos_id}, ignore_eos=True)
    assert all(len(s.tokens) == len(P0) + STEPS for s in out.sequences)


def test_a_batch_of_prompts_and_concurrency_limit(llm: LLM, hf: torch.nn.Module) -> None:
    eos = set(llm.llm_engine.eos_ids)
    params = BeamSearchParams(beam_width=2, max_tokens=STEPS)
    outs = llm.beam_search([P0, P1], params)
    for out, prompt in zip(outs, [P0, P1], strict=True):
        _check(out, _reference(hf, prompt, 2, eos), eos, ignore_eos=False)
    one_at_a_time = llm.beam_search([P0, P1], params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in one_at_a_time] == [
        [s.tokens for s in o.sequences] for o in outs
    ]


def test_text_prompts_and_text(eos_llm: LLM) -> None:
    tok = eos_llm.get_tokenizer()
    text = " ".join(f"t{i}" for i in P0)
    assert tok.encode(text) == P0
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    prompts = [text, TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=P0)]
    outs = eos_llm.beam_search(prompts, params)
    tokens = [[s.tokens for s in o.sequences] for o in outs]
    assert tokens[0] == tokens[1] == tokens[2]
    for seq in outs[0].sequences:
        assert seq.text == tok.decode(seq.tokens)  # the whole sequence, prompt included


def test_beams_share_prefix_kv_through_the_tree(ckpt: Path, hf: torch.nn.Module) -> None:
    """Each beam request computes its one new position and reads the rest from the tree; with
    the cache off the beams are the same, each step recomputing every sequence."""
    prompt = [11, 23, 5, 17, 88, 3, 19, 40, 62, 9]
    width, params = 4, BeamSearchParams(beam_width=4, max_tokens=STEPS)
    computed, found = {}, {}
    for enable in (True, False):
        with LLM(model=ckpt, overrides=[*EAGER, f"cache.enable={str(enable).lower()}"]) as llm:
            s0 = llm.stats()
            [out] = llm.beam_search([prompt], params)
            s1 = llm.stats()
            computed[enable] = s1["prefill_tokens_computed"] - s0["prefill_tokens_computed"]
            found[enable] = s1["cached_tokens"] - s0["cached_tokens"]
            llm.llm_engine.check_invariants()
            eos = set(llm.llm_engine.eos_ids)
            _check(out, _reference(hf, prompt, width, eos), eos, ignore_eos=False)
    # the prompt once, then one position per beam request (at most ``width`` per later step)
    assert computed[True] <= len(prompt) + width * (STEPS - 1)
    assert found[True] >= width * (STEPS - 2) * len(prompt)
    assert found[False] == 0
    assert computed[False] >= width * (STEPS - 2) * len(prompt)


def test_beams_at_the_context_limit_end_there(llm: LLM, hf: torch.nn.Module) -> None:
    limit = llm.llm_engine.max_context
    prompt = [(7 * i + 3) % 250 + 3 for i in range(limit - 3)]  # room for 3 tokens
    eos = set(llm.llm_engine.eos_ids)
    [out] = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=STEPS))
    _check(out, _reference(hf, prompt, 2, eos, steps=3), eos, ignore_eos=False)
    assert max(len(s.tokens) for s in out.sequences) == limit


def test_sampled_steps_keep_the_rules(llm: LLM) -> None:
    """Above temperature 0 each step's sampled token joins the candidates; the beams still
    carry their logprobs, best first."""
    [out] = llm.beam_search([P0], BeamSearchParams(3, 5, temperature=1.0))
    eos = set(llm.llm_engine.eos_ids)
    scores = [_score((s.tokens, s.cum_logprob), eos, 1.0) for s in out.sequences]
    assert len(out.sequences) == 3 and scores == sorted(scores, reverse=True)
    for seq in out.sequences:
        new = seq.tokens[len(P0) :]
        assert len(seq.logprobs) == len(new)
        total = sum(e[t].logprob for e, t in zip(seq.logprobs, new, strict=True))
        assert total == pytest.approx(seq.cum_logprob, abs=1e-6)


def test_progress_bar_factory(llm: LLM) -> None:
    bars: list[dict[str, Any]] = []

    def factory(**kw: Any) -> Any:
        bars.append(kw)
        return tqdm(**kw)

    llm.beam_search([P0, P1], BeamSearchParams(2, 3), use_tqdm=factory, concurrency_limit=1)
    assert bars and bars[0]["total"] == 2 * 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 11, "max_tokens": 4}, "beam_width"),  # 22 logprobs > max_logprobs=20
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"beam_width": 2, "max_tokens": 4, "ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_bad_params_name_the_field(llm: LLM, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"params\.{field}: got"):
        llm.beam_search([P0], BeamSearchParams(**kwargs))


def test_bad_calls_fail_clearly(llm: LLM) -> None:
    params = BeamSearchParams(2, 4)
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search([P0], params, concurrency_limit=0)
    with pytest.raises(ValueError, match=r"prompts\[1\].*outside the vocab"):
        llm.beam_search([P0, [1, 99999]], params)
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search([P0], params, lora_request=object())
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search([P0], {"beam_width": 2})  # type: ignore[arg-type]
    assert not llm.llm_engine.has_unfinished_requests()


def test_vllm_shapes() -> None:
    p = BeamSearchParams(beam_width=3, max_tokens=5)
    assert (p.ignore_eos, p.temperature, p.length_penalty) == (False, 0.0, 1.0)
    assert p.include_stop_str_in_output is False
    seq = BeamSearchSequence(tokens=[1, 2], logprobs=[])
    assert (seq.cum_logprob, seq.text, seq.finish_reason, seq.lora_request) == (
        0.0,
        None,
        None,
        None,
    )
    from hyloop.beam_search import get_beam_search_score

    assert get_beam_search_score([1, 2, 3, 2], -6.0, 2, length_penalty=1.0) == -2.0
    assert get_beam_search_score([1, 2, 3, 4], -6.0, 2, length_penalty=0.5) == -3.0
