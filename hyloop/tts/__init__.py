"""hyloop's TTS package: ``TTSEngine`` (the front end), ``TTSParams`` and the frame step kind.

``from hyloop.tts import TTSEngine, TTSParams``.
"""

from hyloop.tts.engine import Codec, FrameChunk, TTSEngine, TTSOutput
from hyloop.tts.params import TTSParams

__all__ = ["Codec", "FrameChunk", "TTSEngine", "TTSOutput", "TTSParams"]
