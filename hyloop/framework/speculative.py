"""Exact speculative decoding: n-gram drafts (prompt lookup) that a verify step keeps or drops.

Sampling is counter-based (``graphs.sampler``): the token at output position ``t`` is a
function of that position's logits and the request's seed alone. A verify step computes each
row's last token and its drafts in one forward, samples every position as a plain decode step
would (every feature applied with the tokens before it counted) and keeps a draft exactly when
the sample at its position equals it: the accepted drafts plus the first sample that differs
(or follows the last draft) are the tokens decoding without speculation gives, greedy and
seeded sampled requests alike.

``NgramDrafter`` proposes a request's drafts from its own history: the tokens that followed
the latest earlier occurrence of its trailing n-gram (longest first, ``prompt_lookup_max`` down
to ``prompt_lookup_min``), from an index updated as tokens arrive. ``Speculator`` is the
engine's policy: drafting adapts per request (a request whose drafts fail backs off for a
doubling number of steps and drafts as many tokens as it last accepted plus one), and drafts
stay within the request's output budget, so the KV a verify step writes lies in pages the
request reserved at admission; what it writes for rejected positions is overwritten by the
next step and never committed (commits read ``num_computed``, which counts accepted tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from hyloop.features.base import Feature
    from hyloop.framework.batches import Batch, Chunk
    from hyloop.framework.config import EngineConfig, SpeculativeSection
    from hyloop.framework.requests import Request
    from hyloop.models.contract import ModelContract

MAX_BACKOFF = 32  # most steps a request whose drafts keep failing waits before drafting again
MAX_PAUSE = 512  # most steps drafting pauses while verify steps pay less than plain ones


class NgramDrafter:
    """One request's n-gram index: each n-gram of its history -> where the token after its
    latest occurrence lies."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.seen = 0  # history tokens indexed
        self.after: dict[tuple[int, ...], int] = {}

    def extend(self, history: list[int]) -> None:
        """Index the n-grams that end before each new token of ``history``."""
        for t in range(max(self.seen, 1), len(history)):
            for n in range(self.lo, min(self.hi, t) + 1):
                self.after[tuple(history[t - n : t])] = t
        self.seen = len(history)

    def propose(self, history: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the history's
        trailing n-gram (the longest that occurred before); [] when none did."""
        self.extend(history)
        size = len(history)
        for n in range(min(self.hi, size), self.lo - 1, -1):
            at = self.after.get(tuple(history[size - n :]))
            if at is not None:
                return history[at : at + k]
        return []


@dataclass
class DraftState:
    """What the policy keeps of one request."""

    drafter: NgramDrafter
    length: int  # drafts it proposes next (adapts to what it accepted)
    wait: int = 0  # steps left before it drafts again
    misses: int = 0  # verify steps in a row that accepted none of its drafts
    drafted: int = 0  # draft tokens it proposed, in total
    accepted: int = 0  # of them, those kept


class Speculator:
    """The engine's drafting policy and its counters (``stats``)."""

    def __init__(self, section: SpeculativeSection) -> None:
        self.k = section.num_speculative_tokens
        self.lo, self.hi = section.prompt_lookup_min, section.prompt_lookup_max
        self.drafted = 0
        self.accepted = 0
        self.verify_steps = 0
        # decode tokens a second of plain and of verify steps (moving averages), and the steps
        # left that run without drafts because verify steps made fewer
        self.rate = {False: 0.0, True: 0.0}
        self.pause = 0
        self.losses = 0

    def timed(self, batch: Batch, seconds: float) -> None:
        """A decode step's wall time: while verify steps give fewer tokens a second than plain
        ones (drafts that rarely match, a step whose cost grows with its rows), drafting pauses
        for a doubling number of steps, then tries again."""
        if seconds <= 0:
            return
        rate = sum(c.taken for c in batch.chunks) / seconds
        old = self.rate[batch.verify]
        self.rate[batch.verify] = rate if old == 0 else (old + rate) / 2
        if batch.verify and self.rate[False] > 0:
            if self.rate[True] < self.rate[False]:
                self.losses += 1
                self.pause = min(MAX_PAUSE, 4 << self.losses)
            else:
                self.losses = 0

    def state(self, req: Request) -> DraftState:
        if req.draft is None:
            req.draft = DraftState(NgramDrafter(self.lo, self.hi), self.k)
        state: DraftState = req.draft
        return state

    def skips(self, reqs: list[Request]) -> bool:
        """Whether every request of ``reqs`` backs off at the next step, which then runs
        without drafts (planned under lookahead: each one's wait counts the step)."""
        if self.pause > 0:
            self.pause -= 1
            return True
        if not all(r.draft is not None and r.draft.wait > 0 for r in reqs):
            return False
        for r in reqs:
            r.draft.wait -= 1
        return True

    def propose(self, req: Request) -> list[int]:
        """``req``'s drafts for its next step: within its output budget (the drafts and the
        token after them), [] while it backs off or its history has no earlier match."""
        room = req.max_new - len(req.output_ids) - 1
        state = self.state(req)
        if state.wait > 0:
            state.wait -= 1
            return []
        if room <= 0:
            return []
        return state.drafter.propose(req.prompt_ids + req.output_ids, min(state.length, room))

    def draft(self, chunks: list[Chunk], features: list[Feature]) -> bool:
        """Each decode chunk takes its request's drafts (none where a feature the request uses
        is fed by the host: its next mask needs the token before); whether any did."""
        if self.pause > 0:
            self.pause -= 1
            return False
        for c in chunks:
            if not any(f.host_fed and f.name in c.req.features for f in features):
                c.drafts = self.propose(c.req)
                c.length = 1 + len(c.drafts)
        verify = any(c.drafts for c in chunks)
        self.verify_steps += verify
        return verify

    def accept(self, chunks: list[Chunk], taken: torch.Tensor | None) -> None:
        """A resolved verify step: each chunk takes its row's count of kept tokens (its
        accepted drafts and the token after them)."""
        assert taken is not None, "a verify step's output counts the tokens each row keeps"
        for c, n in zip(chunks, taken.tolist(), strict=True):
            c.taken = n
            self.record(c.req, len(c.drafts), n - 1)

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        """A verify step kept ``accepted`` of ``req``'s ``drafted`` drafts."""
        if not drafted:
            return
        state = self.state(req)
        state.drafted += drafted
        state.accepted += accepted
        self.drafted += drafted
        self.accepted += accepted
        if accepted:
            state.misses = 0
            state.length = min(self.k, accepted + 1)
        else:
            state.misses += 1
            state.length = 1
            state.wait = min(MAX_BACKOFF, 1 << (state.misses - 1))

    def stats(self, decode_steps: int, decode_tokens: int) -> dict[str, Any]:
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_draft_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "tokens_per_decode_step": decode_tokens / decode_steps if decode_steps else 0.0,
        }


def speculator_for(cfg: EngineConfig, contract: ModelContract, swa_pool: bool) -> Speculator | None:
    """The drafting policy ``speculative`` configures, or None; a model whose state a verify
    step could not roll back past a rejected draft is refused, naming why."""
    if cfg.speculative.method is None:
        return None
    why = None
    if contract.rows is not None:
        why = "a row (TTS) model samples frames, not tokens"
    elif contract.recurrent is not None:
        why = "a hybrid model's recurrent state would advance over rejected drafts"
    elif swa_pool:
        why = "sliding-window pages would advance over rejected drafts; set kv_pool.swa_pool=false"
    if why is not None:
        raise ValueError(f"speculative.method={cfg.speculative.method}: refused: {why}")
    return Speculator(cfg.speculative)
