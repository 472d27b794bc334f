"""hyloop as an lm-eval-harness model: ``--model hyloop``.

``--model_args pretrained=PATH`` (an HF directory or a ``.gguf`` file, read directly) and
optionally ``tokenizer``, ``max_length``, ``max_gen_toks``, ``add_bos_token``,
``prefix_token_id``, ``truncation_side``, ``seed``, ``config`` (hyloop YAML), any of vLLM's
engine arguments (``dtype=float32``, ``enforce_eager=True``...) and any hyloop config key by its
dotted name (``model.weights=dequantize``, ``graphs.backend=eager``). Log-likelihoods come from
the prompt's logprobs (``prompt_logprobs=1``); generations are greedy unless the task samples.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import lm_eval.models  # noqa: F401  NOTE: fills lm-eval's registry before "hyloop" joins it
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    _add_special_kwargs,
    handle_stop_sequences,
    has_bos_prefix,
    maybe_truncate,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from hyloop.api.llm import LLM
from hyloop.framework.outputs import RequestOutput
from hyloop.framework.prompts import TokensPrompt
from hyloop.framework.sampling_params import SamplingParams
from hyloop.transformers_utils.tokenizer import get_tokenizer

log = logging.getLogger(__name__)

_Pair = tuple[tuple[str, str] | None, list[int], list[int]]


@register_model("hyloop")
class HyloopLM(TemplateLM):
    """lm-eval's ``TemplateLM`` over one hyloop ``LLM``."""

    def __init__(
        self,
        pretrained: str,
        tokenizer: str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        batch_size: int | str = "auto",
        max_batch_size: int | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        truncation_side: str = "left",
        seed: int = 1234,
        config: str | None = None,
        device: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        overrides = [f"{k}={v}" for k, v in kwargs.items() if "." in k]
        engine_args = {k: v for k, v in kwargs.items() if "." not in k}
        if device is not None:  # lm-eval's default names cuda:0 whatever the machine has
            log.info("device=%r ignored: hyloop's config places the model (device=auto)", device)
        self.llm = LLM(
            str(pretrained),
            config=config,
            overrides=overrides,
            tokenizer=tokenizer,
            max_model_len=max_length,
            seed=int(seed),
            **engine_args,
        )
        bos = {} if add_bos_token is None else {"add_bos_token": add_bos_token}
        self.tokenizer = get_tokenizer(tokenizer or pretrained, **bos)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._max_length = self.llm.llm_engine.model_config.max_model_len
        self._max_gen_toks = int(max_gen_toks)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else None
        self.truncation_side = truncation_side

    # -- what lm-eval reads ----------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise ValueError(f"{self.tokenizer.name_or_path}: the tokenizer names no EOS token")
        return eos

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )
        assert isinstance(text, str)
        return text

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """As lm-eval's HF model encodes: the checkpoint's BOS rule unless told, and no second
        BOS before a text that starts with one."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        bos_text = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and has_bos_prefix(string, bos_text):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    # -- requests ---------------------------------------------------------------------------------
    def _run(
        self, prompts: list[list[int]], params: list[SamplingParams], desc: str, quiet: bool
    ) -> list[RequestOutput]:
        """One output per prompt, in order; ``batch_size`` (an int) submits that many at a time
        (hyloop batches whatever is queued)."""
        step = self.batch_size or max(len(prompts), 1)
        out: list[RequestOutput] = []
        bar = tqdm(total=len(prompts), desc=desc, disable=quiet)
        for i in range(0, len(prompts), step):
            batch = [TokensPrompt(prompt_token_ids=p) for p in prompts[i : i + step]]
            out += self.llm.generate(batch, params[i : i + step], use_tqdm=False)
            bar.update(len(batch))
        bar.close()
        return out

    def _loglikelihood_tokens(
        self, requests: Sequence[_Pair], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        keep = self.max_length - 1  # the prompt and the one token a request generates
        inputs, ctxlens = [], []
        for _, context, continuation in requests:
            whole = (context + continuation)[-keep:]
            inputs.append(whole)
            ctxlens.append(len(whole) - len(continuation))
        score = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
        outs = self._run(inputs, [score] * len(inputs), "loglikelihood", disable_tqdm)
        res = []
        for (key, _, _), tokens, ctxlen, out in zip(requests, inputs, ctxlens, outs, strict=True):
            answer = _score(tokens, ctxlen, out)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            res.append(answer)
        return res

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[_Pair] = []
        owners: list[int] = []
        for i, (text,) in enumerate(req.args for req in requests):
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 2,  # one context token, one generated
                context_len=1,
            )
            for window in map(make_disjoint_window, rolling):
                windows.append((None, *window))
                owners.append(i)
        totals = [0.0] * len(requests)
        scores = self._loglikelihood_tokens(windows, disable_tqdm)
        for owner, (logprob, _) in zip(owners, scores, strict=True):
            totals[owner] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode(self.eot_token_id) or self.tokenizer.eos_token
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            kwargs.pop("do_sample", None)
            toks, max_gen = maybe_truncate(
                self.tok_encode(context),
                max_gen_toks=max_gen,
                max_model_len=self.max_length,
                side=self.truncation_side,  # type: ignore[arg-type]
            )
            extra = {"skip_special_tokens": False, "spaces_between_special_tokens": False}
            params.append(SamplingParams(max_tokens=max_gen, stop=until, **{**extra, **kwargs}))
            prompts.append(toks)
            stops.append(until)
        outs = self._run(prompts, params, "generate_until", disable_tqdm)
        res = []
        for req, until, out in zip(requests, stops, outs, strict=True):
            text = postprocess_generated_text(out.outputs[0].text, until, None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            res.append(text)
        return res


def _score(tokens: list[int], ctxlen: int, out: RequestOutput) -> tuple[float, bool]:
    """The continuation's log-likelihood and whether greedy decoding would produce it, from
    the prompt logprobs (per position: the prompt token's and the top token's)."""
    rows = out.prompt_logprobs or []
    total, greedy = 0.0, True
    for token, row in zip(tokens[ctxlen:], rows[ctxlen:], strict=True):
        if row is None:
            raise ValueError(f"request {out.request_id}: no prompt logprobs at a scored position")
        values = {t: getattr(lp, "logprob", lp) for t, lp in row.items()}
        total += values[token]
        greedy = greedy and max(values, key=values.__getitem__) == token
    return total, greedy
