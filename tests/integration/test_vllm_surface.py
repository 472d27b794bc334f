"""The vLLM surface real clients touch: the ``vllm`` alias and its metadata, the module paths,
the engine arguments lm-eval passes, ``model_config``, ``__struct_fields__``,
``GuidedDecodingParams``, the tokenizer's ``BatchEncoding``, strict JSON schemas."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from hyloop import LLM, SamplingParams
from hyloop.api.engine_args import EngineArgs
from hyloop.compat import vllm as alias
from hyloop.features.grammar import GrammarMatcher, grammar_tokenizer
from hyloop.framework.sampling_params import NotSupportedError
from hyloop.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from hyloop.transformers_utils.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[2]
VLLM_PATHS = [
    "lora.request",
    "transformers_utils.tokenizer",
    "tokenizers",
    "entrypoints.chat_utils",
    "renderers.hf",
    "sampling_params",
    "inputs",
    "outputs",
]


@pytest.fixture
def installed() -> Any:
    assert alias.install()
    yield
    alias.uninstall()


def test_alias_resolves_vllm_to_hyloop_with_its_metadata(installed: None) -> None:
    import hyloop

    vllm = importlib.import_module("vllm")
    assert vllm is hyloop
    for path in VLLM_PATHS:
        assert importlib.import_module(f"vllm.{path}") is importlib.import_module(f"hyloop.{path}")
    from vllm.lora.request import LoRARequest

    assert LoRARequest is importlib.import_module("hyloop.lora.request").LoRARequest
    assert md.version("vllm") == alias.VLLM_VERSION
    assert importlib.import_module("hyloop.sampling_params").__spec__.name.startswith("hyloop")
    import tokenizers  # the library, not hyloop's vLLM path

    assert hasattr(tokenizers, "Tokenizer")


def test_uninstalled_alias_leaves_no_vllm(installed: None) -> None:
    importlib.import_module("vllm.sampling_params")
    alias.uninstall()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("vllm")
    with pytest.raises(md.PackageNotFoundError):
        md.version("vllm")
    alias.install()


def _python(code: str, *args: str, path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env_path = f"{path}:{ROOT}" if path else str(ROOT)
    return subprocess.run(
        [sys.executable, *args] if not code else [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        timeout=300,
    )


def test_a_real_vllm_is_never_shadowed(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("REAL = True\n")
    info = tmp_path / "vllm-9.9.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.0\n")
    code = (
        "import hyloop.compat.vllm as a, importlib.metadata as md, vllm\n"
        "print(a.installed(), vllm.REAL, md.version('vllm'))"
    )
    done = _python(code, path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "9.9.0"]
    assert "a real vllm is installed" in done.stderr


def test_python_m_runs_a_program_with_the_alias(tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        from importlib.metadata import version
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        print(LLM.__module__, version("vllm"), sys.argv[1:])
        """)
    )
    done = _python("", "-m", "hyloop.compat.vllm", str(script), "--flag", "x")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["hyloop.api.llm", alias.VLLM_VERSION, "['--flag',", "'x']"]
    as_module = _python("", "-m", "hyloop.compat.vllm", "-m", "client", "y", path=tmp_path)
    assert as_module.returncode == 0, as_module.stderr
    assert as_module.stdout.split()[-1] == "['y']"
    missing = _python("", "-m", "hyloop.compat.vllm", "no-such-program")
    assert missing.returncode == 2 and "no-such-program" in missing.stderr


def test_engine_arguments_lm_eval_passes_are_accepted(installed: None) -> None:
    vllm_lm = importlib.import_module("lm_eval.models.vllm_causallms")
    seen: dict[str, Any] = {}

    class Captured(Exception):
        pass

    def record(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise Captured

    mp = pytest.MonkeyPatch()
    mp.setattr(vllm_lm, "LLM", record)
    with mp.context(), pytest.raises(Captured):
        vllm_lm.VLLM(pretrained="ckpt")
    assert "max_lora_rank" in seen and seen["enable_lora"] is False
    EngineArgs(**seen).to_overrides()  # every default lm-eval sends: accepted
    with pytest.raises(NotSupportedError, match="enable_lora"):
        EngineArgs(**{**seen, "enable_lora": True}).to_overrides()


def test_model_config_and_lora_refusal(tiny_ckpts: dict[str, Path]) -> None:
    with LLM(str(tiny_ckpts["llama"]), enforce_eager=True, max_model_len=96, seed=7) as llm:
        config = llm.llm_engine.model_config
        assert config.max_model_len == 96 == llm.llm_engine.max_context
        assert config.model == str(tiny_ckpts["llama"]) and config.seed == 7
        assert config.get_vocab_size() == llm.llm_engine.vocab_size
        from hyloop.lora.request import LoRARequest

        with pytest.raises(NotSupportedError, match="lora_request"):
            llm.generate([[1, 2]], lora_request=LoRARequest("adapter", 1, "/nowhere"))


def test_sampling_params_struct_fields_round_trip() -> None:
    import dataclasses

    names = [f.name for f in dataclasses.fields(SamplingParams)]
    assert list(SamplingParams.__struct_fields__) == names
    sp = SamplingParams(temperature=0.3, stop=["x"], seed=5)
    copy = SamplingParams(**{f: getattr(sp, f) for f in sp.__struct_fields__})  # outlines' way
    assert copy == sp


def test_guided_decoding_params_as_vllm_kept_it() -> None:
    assert GuidedDecodingParams.from_optional(json=None, regex=None) is None
    gd = GuidedDecodingParams.from_optional(regex="a+", backend="guidance")
    sp = SamplingParams(guided_decoding=gd)
    sp.validate()
    assert sp.structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(NotSupportedError, match="backend"):
        GuidedDecodingParams(regex="a+", backend="outlines")
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(regex="a+", choice=["b"])


def test_get_tokenizer_batch_encoding_and_template(gguf_path: Path) -> None:
    from transformers import AutoTokenizer

    from hyloop.entrypoints.chat_utils import resolve_hf_chat_template
    from hyloop.renderers.hf import resolve_chat_template

    tok = get_tokenizer(str(gguf_path), tokenizer_mode="auto", trust_remote_code=False)
    hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    texts = ["Hello world", "The capital of France is Paris."]
    enc = tok(texts, return_attention_mask=False)
    assert enc.input_ids == enc["input_ids"] == hf(texts).input_ids
    assert "attention_mask" not in enc and tok("a").attention_mask == [1]
    with pytest.raises(AttributeError):
        _ = enc.token_type_ids
    assert (tok.eos_token_id, tok.bos_token_id) == (hf.eos_token_id, hf.bos_token_id)
    assert tok.pad_token_id == hf.pad_token_id and tok.name_or_path == str(gguf_path)
    assert get_tokenizer(gguf_path, add_bos_token=True).encode("a")[0] == hf.bos_token_id
    assert resolve_hf_chat_template(tok, None, None, model_config=None) == tok.chat_template
    assert resolve_chat_template(tok, "{{ x }}", None) == "{{ x }}"
    with pytest.raises(NotSupportedError, match="legacy"):
        get_tokenizer(gguf_path, legacy=True)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _accepts(params: StructuredOutputsParams, text: str, tok: Any, ll: Any) -> bool:
    matcher = GrammarMatcher(params, ll)
    return all(matcher.accept(t) for t in tok.encode(text, add_special_tokens=False))


def test_json_schemas_are_strict_unless_allowed(gguf_path: Path) -> None:
    tok = get_tokenizer(gguf_path)
    ll = grammar_tokenizer(tok, tok.vocab_size)
    extra = '{"name": "Ann", "age": 3, "city": "Oslo"}'
    listed = '{"name": "Ann", "age": 3}'
    old = SamplingParams(guided_decoding=GuidedDecodingParams(json=PERSON))
    old.validate()
    for strict in (StructuredOutputsParams(json=PERSON), old.structured_outputs):
        assert _accepts(strict, listed, tok, ll) and not _accepts(strict, extra, tok, ll)
    loose = StructuredOutputsParams(json=PERSON, allow_additional_properties=True)
    assert _accepts(loose, extra, tok, ll)
    own = StructuredOutputsParams(json={**PERSON, "additionalProperties": True})
    assert _accepts(own, extra, tok, ll)  # the schema's own word wins
    with pytest.raises(ValueError, match="not both"):
        StructuredOutputsParams(
            json=PERSON, allow_additional_properties=True, disable_additional_properties=True
        )
