"""vLLM's offline API on hyloop: the calls vLLM's offline examples make (basic, generate, chat,
the LLMEngine loop, prefix caching), written here against the SmolLM2 GGUF, plus the defaults,
prompt forms and errors a migrating script meets."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hyloop import (
    LLM,
    CompletionOutput,
    EngineArgs,
    LLMEngine,
    RequestOutput,
    SamplingParams,
    TokensPrompt,
)
from hyloop.distributed import cleanup_dist_env_and_memory
from hyloop.sampling_params import NotSupportedError
from hyloop.utils import FlexibleArgumentParser
from tests.conftest import TINY_DENSE, build_hf_checkpoint

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
SMALL = {"enforce_eager": True, "max_model_len": 512}


@pytest.fixture(scope="module")
def gguf() -> str:
    from hyloop.recipes.offline import default_checkpoint

    try:
        return str(default_checkpoint())
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def llm(gguf: str) -> Iterator[LLM]:
    with LLM(model=gguf, tensor_parallel_size=1, **SMALL) as llm:
        yield llm


def _print_loop(outputs: list[RequestOutput]) -> list[str]:
    texts = []
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        texts.append(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    return texts


def test_basic_sampling_run_prints_each_prompt(llm: LLM) -> None:
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8))
    assert [o.prompt for o in outputs] == PROMPTS
    assert all(isinstance(o.outputs[0], CompletionOutput) for o in outputs)
    assert all(o.finished and 1 <= len(o.outputs[0].token_ids) <= 8 for o in outputs)
    assert len(_print_loop(outputs)) == 4


def test_tensor_parallel_request_runs_on_one_device(gguf: str, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING):
        args = EngineArgs(model=gguf, tensor_parallel_size=2, **SMALL)
        assert "graphs.backend=eager" in args.to_overrides()
    assert "one device" in caplog.text


def test_generate_example_flow_through_engine_args_cli(gguf: str) -> None:
    parser = FlexibleArgumentParser()
    group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(group)
    group.set_defaults(model="meta-llama/Llama-3.2-1B-Instruct")
    sampling = parser.add_argument_group("Sampling parameters")
    for flag, kind in (("--max-tokens", int), ("--temperature", float), ("--top-p", float)):
        sampling.add_argument(flag, type=kind)
    sampling.add_argument("--top-k", type=int)
    argv = ["--model", gguf, "--max_model_len", "512", "--enforce-eager", "--max-tokens", "6"]
    args: dict[str, Any] = vars(parser.parse_args(argv))
    max_tokens, temperature = args.pop("max_tokens"), args.pop("temperature")
    args.pop("top_p"), args.pop("top_k")
    with LLM(**args) as llm:
        params = llm.get_default_sampling_params()
        assert params == SamplingParams()  # a GGUF carries no generation_config.json
        params.max_tokens = max_tokens
        if temperature is not None:
            params.temperature = temperature
        outputs = llm.generate(PROMPTS[:2], params)
    assert all(len(o.outputs[0].token_ids) <= 6 for o in outputs)
    assert llm.config.model.max_context == 512 and llm.config.graphs.backend == "eager"


CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]


def test_chat_example_flow(llm: LLM) -> None:
    defaults = SamplingParams()
    params = SamplingParams(
        max_tokens=6, temperature=defaults.temperature, top_p=defaults.top_p, top_k=defaults.top_k
    )
    one = llm.chat(CONVERSATION, params, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt.endswith("<|im_start|>assistant\n")
    ten = llm.chat([CONVERSATION for _ in range(10)], params, use_tqdm=True)
    assert len(ten) == 10 and all(o.finished for o in ten)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    custom = llm.chat(CONVERSATION, params, use_tqdm=False, chat_template=template)
    assert custom[0].prompt.startswith("system: You are a helpful assistant\n")


def test_chat_content_parts_equal_string_content(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    plain = [{"role": "user", "content": "Hi"}]
    a, b = llm.chat(parts, greedy, use_tqdm=False), llm.chat(plain, greedy, use_tqdm=False)
    assert a[0].prompt == b[0].prompt and a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_chat_continue_final_message_leaves_the_turn_open(llm: LLM) -> None:
    chat = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi, I am"}]
    out = llm.chat(
        chat, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False,
        add_generation_prompt=False, continue_final_message=True,
    )  # fmt: skip
    assert out[0].prompt.endswith("Hi, I am")


def test_chat_errors_name_the_message(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        llm.chat([{"role": "user", "content": "a"}, {"content": "no role"}], use_tqdm=False)
    image = {"type": "image_url", "image_url": {"url": "x"}}
    with pytest.raises(NotSupportedError, match="image_url"):
        llm.chat([{"role": "user", "content": [image]}], use_tqdm=False)


def test_llm_engine_loop(gguf: str) -> None:
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(description="engine demo"))
    args = parser.parse_args(["--model", gguf, "--enforce-eager", "--max-model-len", "512"])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        test_prompts = [  # the example's own requests
            (
                "A robot may not injure a human being",
                SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1),
            ),
            ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2)),
            (
                "What is the meaning of life?",
                SamplingParams(n=2, best_of=5, temperature=0.8, top_p=0.95, frequency_penalty=0.1),
            ),
        ]
        request_id, finished = 0, []
        while test_prompts or engine.has_unfinished_requests():
            if test_prompts:
                prompt, sampling_params = test_prompts.pop(0)
                engine.add_request(str(request_id), prompt, sampling_params)
                request_id += 1
            for request_output in engine.step():
                if request_output.finished:
                    finished.append(request_output)
                    assert "RequestOutput(request_id=" in repr(request_output)
        assert sorted(o.request_id for o in finished) == ["0", "1", "2"]
        done = {o.request_id: o for o in finished}
        assert [len(done[r].outputs) for r in "012"] == [1, 1, 2]
        prompt_lps = done["0"].prompt_logprobs
        assert prompt_lps is not None and prompt_lps[0] is None
        assert len(prompt_lps) == len(done["0"].prompt_token_ids)
        first = done["0"].outputs[0]
        assert first.logprobs is not None and len(first.logprobs) == len(first.token_ids)
        for tok, entry in zip(first.token_ids, first.logprobs, strict=True):
            assert entry[tok].rank == 1 and entry[tok].decoded_token is not None  # greedy
        assert first.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(first.token_ids, first.logprobs, strict=True))
        )
    finally:
        engine.close()


def test_per_request_logits_processors_name_themselves(llm: LLM) -> None:
    """Python processors would run host code inside the captured step: refused by name."""
    with pytest.raises(NotSupportedError, match="logits_processors="):
        llm.generate("x", SamplingParams(logits_processors=[print]), use_tqdm=False)


def test_prefix_caching_examples(gguf: str) -> None:
    prefix = "You are an expert school principal. Draft questions for a teacher interview: "
    prompts = [prefix + p for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    regular = LLM(model=gguf, gpu_memory_utilization=0.4, enable_prefix_caching=False, **SMALL)
    plain = [o.outputs[0].text for o in regular.generate(prompts, greedy)]
    del regular
    cleanup_dist_env_and_memory()
    cached_llm = LLM(model=gguf, enable_prefix_caching=True, gpu_memory_utilization=0.4, **SMALL)
    cached_llm.generate(prompts[0], greedy)  # warm-up: a single str prompt
    outputs = cached_llm.generate(prompts, sampling_params=greedy)
    assert [o.outputs[0].text for o in outputs] == plain
    assert all(o.num_cached_tokens > 0 for o in outputs)
    cached_llm.close()


def test_tokens_prompt_generates_from_its_ids(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    ids = llm.get_tokenizer().encode("The capital of France is")
    one = llm.generate(TokensPrompt(prompt_token_ids=ids), greedy, use_tqdm=False)
    bare = llm.generate(ids, greedy, use_tqdm=False)
    text = llm.generate({"prompt": "The capital of France is"}, greedy, use_tqdm=False)
    assert len(one) == len(bare) == len(text) == 1
    assert one[0].prompt_token_ids == ids and one[0].prompt is None
    assert one[0].outputs[0].token_ids == bare[0].outputs[0].token_ids
    assert one[0].outputs[0].token_ids == text[0].outputs[0].token_ids


def test_tokenizer_is_hf_compatible(llm: LLM, gguf: str) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name)
    tok = llm.get_tokenizer()
    assert tok("Hello world")["input_ids"] == hf("Hello world")["input_ids"]
    assert tok.eos_token_id == hf.eos_token_id and tok.eos_token == hf.eos_token
    chat = [{"role": "user", "content": "Hi"}]
    hf_ids = hf.apply_chat_template(chat)  # transformers 5 returns an encoding, 4 the ids
    assert tok.apply_chat_template(chat) == getattr(hf_ids, "input_ids", hf_ids)
    assert tok.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = hf("<|im_start|>user")["input_ids"]
    assert tok.decode(ids) == hf.decode(ids)


def test_use_tqdm_accepts_a_progress_bar_factory(llm: LLM) -> None:
    made: list[dict[str, Any]] = []

    class Bar:
        def __init__(self, **kw: Any) -> None:
            made.append(kw)

        def update(self, n: int) -> None: ...
        def set_postfix(self, *a: Any, **kw: Any) -> None: ...
        def close(self) -> None: ...

    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2), use_tqdm=Bar)
    assert made and made[0]["total"] == 2


def test_migration_errors_are_clear(llm: LLM, gguf: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="prompts is None"):
        llm.generate(None)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=gguf, max_model_length=512)
    with pytest.raises(NotSupportedError, match="float16"):
        LLM(model=gguf, dtype="float16")
    with pytest.raises(NotSupportedError, match="multi_modal_data"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, use_tqdm=False)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(Path(gguf).read_bytes()[: 3 * 2**20])
    with pytest.raises(ValueError, match="truncated"):
        LLM(model=str(truncated), **SMALL)


# -- request defaults: vLLM's, under generation_config.json -------------------------------------


@pytest.fixture(scope="module")
def dense_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gencfg")
    plain = build_hf_checkpoint(root / "plain", TINY_DENSE["llama"])
    tuned = build_hf_checkpoint(root / "tuned", TINY_DENSE["llama"])
    gen = json.loads((tuned / "generation_config.json").read_text())
    gen |= {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7}
    (tuned / "generation_config.json").write_text(json.dumps(gen))
    return plain, tuned


def test_defaults_follow_generation_config_as_vllm_does(dense_pair: tuple[Path, Path]) -> None:
    plain, tuned = dense_pair
    with LLM(model=plain, enforce_eager=True) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
        assert SamplingParams().temperature == 1.0 and SamplingParams().max_tokens == 16
    with LLM(model=tuned, enforce_eager=True) as llm:
        want = SamplingParams(temperature=0.6, top_p=0.9, top_k=20, max_tokens=7)
        assert llm.get_default_sampling_params() == want
        outs = llm.generate([[3, 4, 5]], use_tqdm=False)  # no params: the defaults
        assert len(outs[0].outputs[0].token_ids) <= 7
    with LLM(model=tuned, enforce_eager=True, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    with LLM(model=tuned, enforce_eager=True, overrides=["sampling_defaults.temperature=0"]) as llm:
        assert llm.get_default_sampling_params().temperature == 0


def test_generation_config_defaults_reach_every_control(
    dense_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "gen"
    folder.mkdir()
    gen = {"min_p": 0.05, "repetition_penalty": 1.3}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    with LLM(model=dense_pair[0], enforce_eager=True, generation_config=str(folder)) as llm:
        defaults = llm.get_default_sampling_params()
        assert defaults.min_p == 0.05 and defaults.repetition_penalty == 1.3
