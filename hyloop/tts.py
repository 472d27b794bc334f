"""``from hyloop.tts import TTSEngine, TTSParams``: the TTS front end (see ``framework.tts``)."""

from hyloop.framework.tts import Codec, FrameChunk, TTSEngine, TTSOutput, TTSParams

__all__ = ["Codec", "FrameChunk", "TTSEngine", "TTSOutput", "TTSParams"]
