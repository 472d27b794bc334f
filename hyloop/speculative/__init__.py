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
engine's policy, a cost model measured as it runs: each draft a verify step checks is a
position of its own (the step's rows are padded to the longest, but the decoder stack and the
head compute no padding), worth ``r`` tokens of a plain step (``r``: the measured cost of a
position, the slope of verify-step time over drafts, over the measured time per token of a
plain step of that batch size); row ``i``'s ``j``-th draft is kept with probability
``a_i ** j``. ``a_i`` is the geometric mean of two acceptances: the request's recent one, and
the engine's for proposals that followed as long an n-gram (a long match is mostly a passage
being copied, a short one mostly chance), each starting from the engine's pooled acceptance of
recent drafts. While the policy declines a row's matches, both drift back to that, the pooled
one to a prior of 0.6, and a position's measured cost to a prior with each plain step, so
drafting that stopped is tried again.
Each row verifies the drafts whose
chance of being kept beats ``r``, none when none does: drafts that rarely match, or positions
that cost too much, leave the plain step. The rows' expected kept drafts, less their
positions' cost, must also pay what a verify step costs whatever its drafts (the intercept of
that fit: the drain under lookahead, the acceptance pass), else the step runs plain. A plain
step's time follows its rows' contexts: once they moved by a quarter from the plain step that
measured a batch size (a new wave, contexts grown), a plain step measures it again. A batch
size never measured drafts on the costs of a measured one within half again of it (a wave's
last requests end a few at a time) until it runs its own plain step. Under lookahead, the
steps after one that found no draft worth it are planned ahead without drafts, a stretch that
doubles (up to 64 steps) while drafting keeps not paying and starts over with each new
request. Drafts
stay within the request's output budget, so the KV a verify step writes lies in pages the
request reserved at admission; what it writes for rejected positions lies past
``num_computed`` (which counts accepted tokens): masked from every later step until a later one
writes there, and never committed. Exact on CPU, where every kernel computes a row's bits
whatever the rows beside it; refused on other devices.

The package is a plug-in of the core: ``policy.py`` (``NgramDrafter``, ``Speculator``, and
``speculator_for``, which assembly calls), ``verify.py`` (the verify step ``TokenStep`` runs on a
``verify`` batch) and ``section.py`` (the ``speculative`` config section).
"""

from hyloop.speculative.policy import NgramDrafter, Speculator, speculator_for
from hyloop.speculative.section import SpeculativeSection
from hyloop.speculative.verify import verify

__all__ = ["NgramDrafter", "SpeculativeSection", "Speculator", "speculator_for", "verify"]
