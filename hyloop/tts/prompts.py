"""MOSS-TTS-Local prompts: text and an optional voice reference -> prompt rows ``[N, 1 + n_vq]``.

The rows follow the v1.5 release's request format (its processor's generation / voice-clone
path, which sglang-omni's request builder calls):

    [im_start] "user\\n" "<user_inst>\\n- Reference(s):\\n"
    per reference: [audio_start] (its codes, channel 0 = audio_user_slot) [audio_end]
      (no reference: "None")
    "\\n- Instruction:\\n{instruction}\\n- Tokens:\\n{tokens}\\n- Quality:\\n{quality}
     \\n- Sound Event:\\n{sound_event}\\n- Ambient Sound:\\n{ambient_sound}
     \\n- Language:\\n{language}\\n- Text:\\n"  {text}
    "\\n</user_inst>" [im_end] "\\n" [im_start] "assistant\\n" [audio_start]

Each quoted piece is tokenized on its own (``add_special_tokens=False``), as the release does; a
missing or blank field reads ``None``. Text rows carry the pad code in every code channel, so
they embed as their text id alone. The engine keys these rows exactly as it keys generated ones
(``graphs.ops.row_keys``), and the reference comes right after a fixed preamble, so requests
sharing a voice share a cached prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

USER_PREFIX = "user\n"
REFERENCE_HEADER = "<user_inst>\n- Reference(s):\n"
NO_REFERENCE = "None"
FIELD_ORDER = (
    ("instruction", "Instruction"),
    ("tokens", "Tokens"),
    ("quality", "Quality"),
    ("sound_event", "Sound Event"),
    ("ambient_sound", "Ambient Sound"),
    ("language", "Language"),
)
TEXT_HEADER = "\n- Text:\n"
USER_SUFFIX = "\n</user_inst>"
TURN_BREAK = "\n"
ASSISTANT_PREFIX = "assistant\n"


@dataclass(frozen=True, kw_only=True)
class TTSPrompt:
    """What to say (``text``), whose voice (``voice``: one reference's codes ``[n, n_vq]`` or a
    list of them) and the template's optional fields."""

    text: str
    voice: Any = None
    instruction: str | None = None
    tokens: int | None = None
    quality: str | None = None
    sound_event: str | None = None
    ambient_sound: str | None = None
    language: str | None = None

    @classmethod
    def from_fields(cls, values: dict[str, Any], where: str = "prompt") -> TTSPrompt:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {unknown}; expected some of {sorted(names)}"
            )
        if not isinstance(values.get("text"), str):
            raise ValueError(f"{where}.text: got {values.get('text')!r}; expected a string")
        return cls(**values)


def _field(value: Any) -> str:
    text = "" if value is None else str(value).strip()
    return text or "None"


class PromptBuilder:
    """``PromptBuilder(tokenizer, model_config)``: ``build(prompt) -> int64 rows [N, C]``.

    ``tokenizer`` is the checkpoint's own (``encode(text, add_special_tokens=False)``);
    ``model_config`` is the model's ``MossTTSLocalConfig``."""

    def __init__(self, tokenizer: Any, model_config: Any) -> None:
        if tokenizer is None:
            raise ValueError(
                "text prompts need the checkpoint's tokenizer (tokenizer.json beside "
                "config.json); this checkpoint has none, so pass prompt rows instead"
            )
        self.tokenizer = tokenizer
        cfg = model_config
        self.n_vq: int = cfg.n_vq
        self.audio_vocab: int = cfg.audio_vocab_size
        self.pad_code: int = cfg.audio_pad_code
        ids = dict(cfg.prompt_ids, audio_end_token_id=cfg.end_id)
        vocab = len(tokenizer)
        for key, value in ids.items():
            if not 0 <= value < vocab:
                raise ValueError(
                    f"moss_tts_local config: {key}={value} outside the tokenizer's vocab "
                    f"[0, {vocab}); text prompts need the template's special ids"
                )
        self.im_start = ids["im_start_token_id"]
        self.im_end = ids["im_end_token_id"]
        self.audio_start = ids["audio_start_token_id"]
        self.audio_end = ids["audio_end_token_id"]
        self.user_slot = ids["audio_user_slot_token_id"]
        self._preamble = [
            self.im_start,
            *self._encode(USER_PREFIX),
            *self._encode(REFERENCE_HEADER),
        ]
        self._closing = [
            *self._encode(USER_SUFFIX),
            self.im_end,
            *self._encode(TURN_BREAK),
            self.im_start,
            *self._encode(ASSISTANT_PREFIX),
            self.audio_start,
        ]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def text_rows(self, ids: Sequence[int]) -> np.ndarray:
        rows = np.full((len(ids), self.n_vq + 1), self.pad_code, dtype=np.int64)
        rows[:, 0] = np.asarray(ids, dtype=np.int64)
        return rows

    def voice_rows(self, codes: Any, where: str = "voice") -> np.ndarray:
        """A reference's codes ``[n, n_vq]`` as rows whose channel 0 is the user audio slot."""
        arr = np.asarray(codes)
        if arr.ndim != 2 or arr.shape[1] != self.n_vq or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"{where}: got shape {arr.shape} of {arr.dtype}; expected integer codes "
                f"[frames, n_vq={self.n_vq}]"
            )
        if arr.size and (arr.min() < 0 or arr.max() >= self.audio_vocab):
            raise ValueError(
                f"{where}: codes in [{arr.min()}, {arr.max()}]; expected [0, {self.audio_vocab})"
            )
        rows = np.empty((len(arr), self.n_vq + 1), dtype=np.int64)
        rows[:, 0] = self.user_slot
        rows[:, 1:] = arr
        return rows

    def build(self, prompt: TTSPrompt) -> np.ndarray:
        voices = _voices(prompt.voice)
        after = "".join(f"\n- {label}:\n{_field(getattr(prompt, k))}" for k, label in FIELD_ORDER)
        tail = self._encode(after + TEXT_HEADER) + self._encode(prompt.text) + self._closing
        if not voices:
            return self.text_rows(self._preamble + self._encode(NO_REFERENCE) + tail)
        parts = [self.text_rows(self._preamble)]
        for i, codes in enumerate(voices):
            where = "voice" if len(voices) == 1 else f"voice[{i}]"
            parts += [
                self.text_rows([self.audio_start]),
                self.voice_rows(codes, where),
                self.text_rows([self.audio_end]),
            ]
        parts.append(self.text_rows(tail))
        return np.concatenate(parts)


def _voices(voice: Any) -> list[Any]:
    """None, one reference ``[n, n_vq]``, or a list of references."""
    if voice is None:
        return []
    if isinstance(voice, (list, tuple)) and voice and np.asarray(voice[0]).ndim == 2:
        return list(voice)
    return [voice]
