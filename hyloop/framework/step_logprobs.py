"""A resolved step's logprobs in vLLM's shape: the sampled token's entry and a prompt chunk's."""

from __future__ import annotations

from hyloop.framework.batches import Chunk
from hyloop.framework.outputs import Logprob
from hyloop.graphs.step_batch import StepOutput


def sampled_entry(
    out: StepOutput, i: int | tuple[int, int], tok: int, k: int
) -> dict[int, Logprob]:
    """The sampled token's ``Logprob`` (its rank among all tokens) and the top ``k``; ``i``:
    its row, or (row, position) of a verify step."""
    assert out.chosen_lp is not None and out.chosen_rank is not None
    entry = {tok: Logprob(float(out.chosen_lp[i]), int(out.chosen_rank[i]))}
    if k > 0:
        assert out.top_lp is not None and out.top_ids is not None
        top = zip(out.top_lp[i][:k].tolist(), out.top_ids[i][:k].tolist(), strict=True)
        for rank, (lp, tid) in enumerate(top, 1):
            entry.setdefault(int(tid), Logprob(float(lp), rank))
    return entry


def prompt_entries(
    out: StepOutput, i: int, chunk: Chunk, k: int | None
) -> list[dict[int, Logprob]]:
    """The chunk's prompt logprobs: at each position, the next prompt token's and the top k."""
    assert out.prompt_lp is not None and out.prompt_rank is not None and k is not None
    assert out.prompt_top_lp is not None and out.prompt_top_ids is not None
    n = min(chunk.length, len(chunk.req.prompt_ids) - chunk.start - 1)
    targets = chunk.req.prompt_ids[chunk.start + 1 : chunk.start + 1 + n]
    lps, ranks = out.prompt_lp[i, :n].tolist(), out.prompt_rank[i, :n].tolist()
    top_lp, top_ids = out.prompt_top_lp[i, :n, :k].tolist(), out.prompt_top_ids[i, :n, :k].tolist()
    entries = []
    for t, tok in enumerate(targets):
        entry = {tok: Logprob(lps[t], ranks[t])}
        for rank, (lp, tid) in enumerate(zip(top_lp[t], top_ids[t], strict=True), 1):
            entry.setdefault(tid, Logprob(lp, rank))
        entries.append(entry)
    return entries
