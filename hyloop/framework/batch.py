"""What the scheduler hands the model runner: one batch of request chunks."""

from __future__ import annotations

from dataclasses import dataclass

from hyloop.framework.request import Request


@dataclass
class Chunk:
    """``length`` new tokens of ``req`` starting at absolute position ``start``."""

    req: Request
    start: int
    length: int
    track_slot: int = 0  # recurrent slot to publish the state after this chunk into (0: none)

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length >= len(self.req.prompt_ids)


@dataclass
class Batch:
    chunks: list[Chunk]
    is_decode: bool

    @property
    def size(self) -> int:
        return len(self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)
