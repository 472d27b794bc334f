"""Speculative decoding's drafts and the policy that picks them (n-gram prompt lookup)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from hyloop.features.base import Feature
    from hyloop.framework.batches import Batch, Chunk
    from hyloop.framework.config import EngineConfig, SpeculativeSection
    from hyloop.framework.requests import Request
    from hyloop.models.contract import ModelContract

PRIOR_RATIO = 0.3  # a position's cost in plain-step tokens until this batch size is measured
PRIOR = (1.2, 2.0)  # a new request's (kept, verified) drafts: acceptance 0.6 until measured
POOLED = 0.98  # what the engine's earlier drafts weigh against its latest, per verify step
DECAY = 0.8  # what a request's earlier verify steps weigh against its latest
RELAX = 0.9  # a step a request does not draft moves its acceptance this far back to the prior
DRIFT = 0.99  # a plain step moves a position's measured cost this far back to the prior
QUIET = 4  # steps a lookahead loop plans without drafts once drafting did not pay ...
QUIET_MAX = 64  # ... doubling each time it again did not pay, up to this many
REMEASURE = 16  # verify steps between two plain ones of a batch size (contexts grow)
NEAR = 1.5  # an unmeasured batch size drafts on the costs of a measured one within this factor
RESIZED = 0.25  # a batch size's contexts moved this far from its plain step's: measure anew
FIT_DECAY = 0.9  # what a batch size's earlier verify steps weigh in its cost fit, per step


class NgramDrafter:
    """One request's n-gram index: each n-gram of its history -> where the token after its
    latest occurrence lies."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.seen = 0  # history tokens indexed
        self.after: dict[tuple[int, ...], int] = {}
        self.matched = 0  # the length of the n-gram the last proposal followed (0: none)

    def extend(self, history: list[int]) -> None:
        """Index the n-grams that end before each new token of ``history``."""
        for t in range(max(self.seen, 1), len(history)):
            for n in range(self.lo, min(self.hi, t) + 1):
                self.after[tuple(history[t - n : t])] = t
        self.seen = len(history)

    def propose(self, history: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the history's
        trailing n-gram (the longest that occurred before); [] when none did. ``matched`` holds
        that n-gram's length."""
        self.extend(history)
        size = len(history)
        for n in range(min(self.hi, size), self.lo - 1, -1):
            at = self.after.get(tuple(history[size - n :]))
            if at is not None:
                self.matched = n
                return history[at : at + k]
        self.matched = 0
        return []


@dataclass
class DraftState:
    """What the policy keeps of one request: its drafter and its recent acceptance."""

    drafter: NgramDrafter
    kept: float = PRIOR[0]  # decayed count of drafts kept
    verified: float = PRIOR[1]  # decayed count of drafts verified (up to the first miss)
    drafted: int = 0  # draft tokens it proposed, in total
    accepted: int = 0  # of them, those kept

    @property
    def rate(self) -> float:
        """The chance its next draft is kept, given the ones before it were."""
        return self.kept / self.verified


class Speculator:
    """The engine's drafting policy, its cost model and its counters (``stats``)."""

    def __init__(self, section: SpeculativeSection) -> None:
        self.k = section.num_speculative_tokens
        self.adaptive = section.adaptive
        self.lo, self.hi = section.prompt_lookup_min, section.prompt_lookup_max
        self.drafted = 0
        self.accepted = 0
        self.verify_steps = 0
        # by batch size: seconds of a plain step, and of one draft a verify step checks
        self.plain: dict[int, float] = {}
        self.position: dict[int, float] = {}
        self.since_plain: dict[int, int] = {}  # verify steps since a plain one, by batch size
        # by batch size: the summed context of the plain step that measured it (a plain step's
        # time follows its rows' contexts: a new wave of requests, or contexts grown by a
        # quarter, make the average stale)
        self.context: dict[int, int] = {}
        # by batch size: decayed sums (n, x, y, xx, xy) of verify steps' drafts x and their time
        # over the plain step's y, whose slope is a draft's cost without the step's fixed part
        self.fits: dict[int, list[float]] = {}
        # by batch size: seconds a verify step costs over a plain one whatever its drafts (the
        # fit's intercept: the drain it makes under lookahead, the acceptance pass); a step's
        # drafts must win that back together
        self.fixed: dict[int, float] = {}
        self.quiet = 0  # planned steps left without drafts (lookahead)
        self.quiet_next = QUIET  # the next stretch of them
        # every request's decayed (kept, verified) drafts: where an untried request's own
        # acceptance drifts back to (a request with a miss behind it retries where drafts
        # mostly pay, and does not where they mostly do not)
        self.pooled = PRIOR
        # by the length of the n-gram a proposal followed: the engine's decayed (kept, verified)
        # drafts of such proposals. A long match is mostly a passage being copied, a short one
        # mostly chance: a row's chance blends its own acceptance with its match length's
        self.by_match: dict[int, tuple[float, float]] = {}

    def state(self, req: Request) -> DraftState:
        if req.draft is None:  # a new request starts at the pooled acceptance
            req.draft = DraftState(NgramDrafter(self.lo, self.hi), *self._prior())
            # and is a new chance: lookahead drains for it at once, whatever stretch without
            # drafts the requests before it (their last steps had no room to draft) left
            self.quiet, self.quiet_next = 0, QUIET
        state: DraftState = req.draft
        return state

    def chance(self, state: DraftState) -> float:
        """The chance a row's next draft is kept, given the ones before it were: the geometric
        mean of its request's acceptance and that of proposals from as long a match (a request
        whose drafts keep failing stops, whatever the match)."""
        kept, verified = self.by_match.get(state.drafter.matched, self._prior())
        return math.sqrt(state.rate * kept / verified)

    def _prior(self) -> tuple[float, float]:
        """Where an untried request or match length starts: the pooled acceptance."""
        return PRIOR[1] * self.pooled[0] / self.pooled[1], PRIOR[1]

    def measured(self, rows: int) -> int | None:
        """The batch size whose costs a step of ``rows`` rows drafts on: its own once a plain
        and a verify step measured it, else the nearest size within ``NEAR`` of it that they
        did (a wave's last requests end a few at a time: each smaller batch would otherwise
        run a plain step first), else None."""
        if rows in self.plain and rows in self.position:
            return rows
        near = [s for s in self.position if s in self.plain and max(s, rows) <= NEAR * min(s, rows)]
        return min(near, key=lambda s: (abs(s - rows), -s), default=None)

    def ratio(self, rows: int) -> float:
        """What one verified draft costs, in tokens of a plain step of ``rows`` rows."""
        size = self.measured(rows)
        if size is None:
            return PRIOR_RATIO
        return self.position[size] / (self.plain[size] / size)

    def timed(self, batch: Batch, seconds: float) -> None:
        """A decode step's wall time, into the cost model (moving averages per batch size)."""
        rows = len(batch.chunks)
        if not batch.verify:
            context = _context(batch.chunks)
            if _moved(self.context.get(rows), context):  # other contexts: this step alone
                plain = self.plain[rows] = seconds
            else:
                plain = self.plain[rows] = _average(self.plain.get(rows), seconds)
            self.context[rows] = context
            self.since_plain[rows] = 0
            if rows in self.position:  # unverified lately, the cost drifts back to the prior:
                prior = PRIOR_RATIO * plain / rows  # drafting that stopped is tried again
                self.position[rows] = DRIFT * self.position[rows] + (1 - DRIFT) * prior
            return
        self.since_plain[rows] = self.since_plain.get(rows, 0) + 1
        plain = self.plain.get(rows)
        extra = sum(len(c.drafts) for c in batch.chunks)
        if plain is not None and extra:
            y = max(0.0, seconds - plain)
            fit = self.fits.setdefault(rows, [0.0] * 5)
            for i, v in enumerate((1.0, extra, y, extra * extra, extra * y)):
                fit[i] = FIT_DECAY * fit[i] + v
            cost = _slope(fit, plain / rows)
            self.position[rows] = _average(
                self.position.get(rows), y / extra if cost is None else cost
            )
            # without a slope each draft carries the whole step: nothing is left over
            self.fixed[rows] = 0.0 if cost is None else max(0.0, (fit[2] - cost * fit[1]) / fit[0])

    def overhead(self, rows: int) -> float:
        """What a verify step costs whatever its drafts, in tokens of a plain step of ``rows``
        rows (0 until measured)."""
        size = self.measured(rows)
        if size is None or size not in self.fixed:
            return 0.0
        return self.fixed[size] / (self.plain[size] / size)

    def skips(self) -> bool:
        """Whether a lookahead loop may plan the next step without drafts (drafting did not
        pay at a recent step); each planned step counts. Each stretch of them ends in a drained
        step that asks again; while drafting keeps not paying, the stretches double (fewer
        drains where drafts rarely match)."""
        if self.quiet <= 0:
            return False
        self.quiet -= 1
        return True

    def propose(self, req: Request) -> list[int]:
        """``req``'s drafts for its next step: within its output budget (the drafts and the
        token after them), [] when its history has no earlier match."""
        room = min(self.k, req.max_new - len(req.output_ids) - 1)
        if room <= 0:
            return []
        return self.state(req).drafter.propose(req.prompt_ids + req.output_ids, room)

    def draft(self, chunks: list[Chunk], features: list[Feature]) -> bool:
        """Each decode chunk takes its request's drafts, as many per row as the cost model says
        pay (none where a feature the request uses is fed by the host: its next mask needs the
        token before); whether the step verifies. A batch size runs one plain step first
        where ``stale`` says so."""
        adaptive = self.adaptive
        rows = len(chunks)
        if adaptive and self.stale(rows, chunks):
            return False
        proposals = [
            []
            if any(f.host_fed and f.name in c.req.features for f in features)
            else self.propose(c.req)
            for c in chunks
        ]
        cost = self.ratio(rows)
        drafted, gain = 0, 0.0
        for c, p in zip(chunks, proposals, strict=True):
            state = self.state(c.req)
            # its j-th draft is kept with chance rate ** j: worth a position while that beats
            # what a position costs
            rate = self.chance(state)
            keep = len(p) if not adaptive else _worth(rate, cost, len(p))
            c.drafts = p[:keep]
            c.length = 1 + len(c.drafts)
            drafted += len(c.drafts)
            gain += sum(rate**j - cost for j in range(1, keep + 1))
            if p and not c.drafts:
                self._untried(state)
        if adaptive and drafted and gain <= self.overhead(rows):
            # the drafts' expected gain over their positions does not pay for the verify step
            # itself (a few drafts among many rows): a plain step
            for c in chunks:
                c.drafts, c.length = [], 1
            drafted = 0
        if drafted:
            self.quiet, self.quiet_next = 0, QUIET
        else:
            # whatever the rows: each drain gives up the overlap of one step, and a batch that
            # lookahead runs (8 rows and more) drains every few steps at a cap over the rows
            self.quiet, self.quiet_next = self.quiet_next, min(2 * self.quiet_next, QUIET_MAX)
            return False
        self.verify_steps += 1
        return True

    def stale(self, rows: int, chunks: list[Chunk]) -> bool:
        """Whether a step of ``rows`` rows runs plain to measure them: their plain step was
        measured, but not lately (``REMEASURE`` verify steps, or contexts that moved by
        ``RESIZED`` since); or it never was, and no size near it was either, or the costs it
        borrows carried it ``REMEASURE`` verify steps."""
        if rows not in self.plain:
            return self.measured(rows) is None or self.since_plain.get(rows, 0) >= REMEASURE
        return self.since_plain.get(rows, REMEASURE) >= REMEASURE or _moved(
            self.context.get(rows), _context(chunks)
        )

    def _untried(self, state: DraftState) -> None:
        """A proposal not verified: the acceptances it would have tried drift back to the
        prior (the request's and its match length's, to the pooled one; the pooled one to
        ``PRIOR``), so that drafting that stopped where it did not pay is tried again later,
        and the pooled acceptance cannot settle where no request ever drafts again."""
        prior = self._prior()
        state.kept = RELAX * state.kept + (1 - RELAX) * prior[0]
        state.verified = RELAX * state.verified + (1 - RELAX) * prior[1]
        matched = state.drafter.matched
        kept, verified = self.by_match.get(matched, prior)
        self.by_match[matched] = (
            RELAX * kept + (1 - RELAX) * prior[0],
            RELAX * verified + (1 - RELAX) * prior[1],
        )
        kept, verified = self.pooled
        self.pooled = (POOLED * kept + (1 - POOLED) * PRIOR[0] * verified / PRIOR[1], verified)

    def accept(self, chunks: list[Chunk], taken: torch.Tensor | None) -> None:
        """A resolved verify step: each chunk takes its row's count of kept tokens (its
        accepted drafts and the token after them; the scheduler lowers it to what it appended,
        a stop among them or a request already ended)."""
        assert taken is not None, "a verify step's output counts the tokens each row keeps"
        for c, n in zip(chunks, taken.tolist(), strict=True):
            c.taken = n

    def settle(self, chunks: list[Chunk]) -> None:
        """After the scheduler appended a verify step's tokens: what each row's drafts gave."""
        kept, verified = self.pooled
        for c in chunks:
            accepted = max(0, c.taken - 1)
            self.record(c.req, len(c.drafts), accepted)
            if c.drafts:
                tried = accepted + (accepted < len(c.drafts))
                matched = self.state(c.req).drafter.matched  # what its drafts followed
                k, v = self.by_match.get(matched, self._prior())
                self.by_match[matched] = (POOLED * (k + accepted), POOLED * (v + tried))
                kept += accepted
                verified += tried
        self.pooled = (POOLED * kept, POOLED * verified)

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        """A verify step kept ``accepted`` of ``req``'s ``drafted`` drafts: each kept one, and
        the first rejected one, is a trial of its acceptance."""
        if not drafted:
            return
        state = self.state(req)
        state.drafted += drafted
        state.accepted += accepted
        self.drafted += drafted
        self.accepted += accepted
        state.kept = DECAY * state.kept + accepted
        state.verified = DECAY * state.verified + accepted + (accepted < drafted)

    def stats(self, decode_steps: int, decode_tokens: int) -> dict[str, Any]:
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_draft_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "tokens_per_decode_step": decode_tokens / decode_steps if decode_steps else 0.0,
        }


def _context(chunks: list[Chunk]) -> int:
    """A step's rows' summed context (the positions each attends over)."""
    return sum(c.start + 1 for c in chunks)


def _moved(measured: int | None, context: int) -> bool:
    """Whether ``context`` moved by more than ``RESIZED`` from the ``measured`` one."""
    return measured is not None and abs(context - measured) > RESIZED * measured


def _worth(rate: float, cost: float, most: int) -> int:
    """How many of a row's ``most`` drafts to verify: those whose chance of being kept
    (``rate ** j`` for the j-th) beats ``cost``."""
    n, chance = 0, 1.0
    while n < most and (chance := chance * rate) > cost:
        n += 1
    return n


def _slope(fit: list[float], token: float) -> float | None:
    """What one more draft adds to a verify step, from the fit's decayed sums: the least-squares
    slope of time over drafts, which leaves out what a verify step costs whatever its drafts
    (the drained lookahead, the acceptance pass) and so does not charge it to each draft;
    between 5 % of a plain token and the mean cost a draft. None while the drafts have not
    varied enough (by a fifth of their mean) for a slope."""
    n, sx, sy, sxx, sxy = fit
    spread = n * sxx - sx * sx
    if n < 3 or spread <= 0.04 * sx * sx:
        return None
    return min(max((n * sxy - sx * sy) / spread, 0.05 * token), sy / sx)


def _average(old: float | None, new: float) -> float:
    """The moving average, a sample first clipped to [1/2, 2] x the average: one step slowed by
    something else (a collection, another process) moves it by at most 30 %, not off the
    scale, and drafting does not stop for a stretch of plain steps on its account."""
    if old is None:
        return new
    return 0.7 * old + 0.3 * min(max(new, 0.5 * old), 2.0 * old)


def speculator_for(cfg: EngineConfig, contract: ModelContract, swa_pool: bool) -> Speculator | None:
    """The drafting policy ``speculative`` configures, or None; a model whose state a verify
    step could not roll back past a rejected draft is refused, naming why."""
    if cfg.speculative.method is None:
        return None
    why = None
    if cfg.device != "cpu":  # cuBLAS and SDPA pick kernels by shape: a verify step's rows
        why = "exact on CPU only (a GPU's kernels change with the rows a verify step adds)"
    elif contract.rows is not None:
        why = "a row (TTS) model samples frames, not tokens"
    elif contract.recurrent is not None:
        why = "a hybrid model's recurrent state would advance over rejected drafts"
    elif swa_pool:
        why = "sliding-window pages would advance over rejected drafts; set kv_pool.swa_pool=false"
    if why is not None:
        raise ValueError(f"speculative.method={cfg.speculative.method}: refused: {why}")
    return Speculator(cfg.speculative)
