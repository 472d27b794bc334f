"""hyloop's TTS package: ``TTSEngine`` (the front end), ``TTSParams``, prompts, codecs.

``from hyloop.tts import TTSEngine, TTSParams``.
"""

from hyloop.tts.chunker import TTSOutput
from hyloop.tts.codec import Codec, CodecStage, ToneCodec, write_wav
from hyloop.tts.engine import TTSEngine
from hyloop.tts.metrics import FrameChunk, TTSMetrics
from hyloop.tts.params import TTSParams
from hyloop.tts.prompts import PromptBuilder, TTSPrompt
from hyloop.tts.streams import RequestStream

__all__ = [
    "Codec",
    "CodecStage",
    "FrameChunk",
    "PromptBuilder",
    "RequestStream",
    "TTSEngine",
    "TTSMetrics",
    "TTSOutput",
    "TTSParams",
    "TTSPrompt",
    "ToneCodec",
    "write_wav",
]
