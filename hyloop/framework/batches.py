"""The batches the scheduler forms of requests: chunks of prompt or decode positions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hyloop.framework.requests import Request


@dataclass
class Chunk:
    """``length`` new tokens of ``req`` starting at absolute position ``start``."""

    req: Request
    start: int
    length: int
    track_slot: int = 0  # recurrent slot to publish the state after this chunk into (0: none)
    out_pos: int = -1  # index of the token this chunk samples; -1: len(req.output_ids)
    # a verify step's drafts: the tokens after ``start``'s (``length == 1 + len(drafts)``)
    drafts: list[int] = field(default_factory=list)
    taken: int = 1  # tokens its resolved step appended (a verify step: accepted drafts + 1)
    completes_prompt: bool = field(init=False)  # it reaches the prompt's end: it samples

    def __post_init__(self) -> None:
        self.completes_prompt = self.start + self.length >= len(self.req.prompt_ids)


@dataclass
class Batch:
    chunks: list[Chunk]
    is_decode: bool
    planned: bool = False  # lookahead: its input ids come from the previous step's output
    verify: bool = False  # a decode step whose chunks carry drafts (``hyloop.speculative``)
