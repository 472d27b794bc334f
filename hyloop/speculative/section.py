"""The ``speculative`` section of the engine config (``framework.config.EngineConfig``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SpeculativeSection(BaseModel):
    """Speculative decoding with exact outputs (``hyloop.speculative``): each row drafts
    tokens by matching its trailing n-gram in its own prompt and output, and a verify step
    keeps a draft exactly when the row's own counter-based sample at that position equals it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["ngram"] | None = Field(
        None, description="ngram (prompt lookup); null: no speculation"
    )
    num_speculative_tokens: int = Field(4, ge=1, le=15, description="most drafts per row a step")
    prompt_lookup_max: int = Field(4, ge=1, description="longest trailing n-gram matched")
    prompt_lookup_min: int = Field(2, ge=1, description="shortest trailing n-gram matched")
    adaptive: bool = Field(
        True,
        description="draft only what a measured cost model says pays (else every match, up to "
        "num_speculative_tokens)",
    )

    @model_validator(mode="after")
    def _check_lookup(self) -> SpeculativeSection:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} must not exceed "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        return self
