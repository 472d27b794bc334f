"""The sampler's candidate cap: sampling among a row's top ``cap`` logits is exact."""

from __future__ import annotations

import pytest
import torch

from hyloop.framework.step_kinds import candidate_cap
from hyloop.graphs.sampler import gumbel_noise, sample, token_hashes

VOCAB = 1000


@pytest.mark.parametrize(
    ("groups", "cap"),
    [
        ([], 0),
        ([(0.0, 5, 0.5)], 0),  # greedy rows never filter
        ([(1.0, -1, 1.0), (0.0, 5, 1.0)], 0),  # nothing filters
        ([(1.0, 5, 1.0)], 8),
        ([(1.0, 8, 1.0)], 8),
        ([(1.0, 9, 0.5), (0.7, 3, 1.0), (0.0, 900, 1.0)], 16),
        ([(1.0, 1, 1.0)], 1),
        ([(1.0, 600, 1.0)], VOCAB),  # the power of two past the vocabulary: all of it
        ([(1.0, -1, 0.9)], VOCAB),  # top-p alone reads the whole distribution
        ([(1.0, 5, 1.0), (1.0, -1, 1.0)], VOCAB),  # an unfiltered sampling row beside a top-k one
        ([(1.0, 2000, 1.0)], 0),  # a top-k past the vocabulary keeps everything
    ],
)
def test_candidate_cap(groups: list[tuple[float, int, float]], cap: int) -> None:
    assert candidate_cap(groups, VOCAB) == cap


def rows(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=g) * 3
    logits[0, :40] = logits[0, 0]  # ties across the top-k boundary
    return dict(
        logits=logits,
        temperature=torch.where(torch.arange(n) % 4 == 3, 0.0, 0.5 + torch.rand(n, generator=g)),
        top_k=torch.randint(1, 60, (n,), generator=g),
        top_p=torch.where(torch.arange(n) % 3 == 0, 1.0, 0.3 + 0.7 * torch.rand(n, generator=g)),
        seeds=torch.randint(0, 2**32, (n,), generator=g),
        out_pos=torch.randint(0, 500, (n,), generator=g),
    )


def draw(r: dict[str, torch.Tensor], cap: int) -> torch.Tensor:
    tok_hash = token_hashes(VOCAB, "cpu")
    return sample(
        r["logits"], r["temperature"], r["top_k"], r["top_p"], r["seeds"], r["out_pos"],
        tok_hash, cap,
    )  # fmt: skip


def reference(r: dict[str, torch.Tensor]) -> torch.Tensor:
    """Top-k, then the nucleus of the renormalised top-k, then Gumbel-max: row by row over a
    full sort, the obvious way."""
    tok_hash = token_hashes(VOCAB, "cpu")
    out = []
    for i in range(r["logits"].shape[0]):
        logits = r["logits"][i]
        temp = float(r["temperature"][i])
        if temp == 0:
            out.append(int(logits.argmax()))
            continue
        values, order = (logits / temp).sort(descending=True)
        k = int(r["top_k"][i])
        probs = values[:k].double().softmax(0)
        before = probs.cumsum(0) - probs
        top_p = float(r["top_p"][i])
        n = int((before < top_p).sum()) if top_p < 1 else k
        noise = gumbel_noise(r["seeds"][i : i + 1], r["out_pos"][i : i + 1], tok_hash)[0]
        kept = order[: max(n, 1)]
        out.append(int(kept[(values[: len(kept)] + noise[kept]).argmax()]))
    return torch.tensor(out)


def test_capped_sampling_is_the_reference() -> None:
    r = rows(64, seed=0)
    cap = candidate_cap(
        zip(r["temperature"].tolist(), r["top_k"].tolist(), r["top_p"].tolist(), strict=True),
        VOCAB,
    )
    assert cap == 64
    assert torch.equal(draw(r, cap), reference(r))


def test_a_row_does_not_depend_on_the_cap() -> None:
    """The cap follows the batch's widest top-k; each row's draw must not."""
    r = rows(64, seed=1)
    base = draw(r, 64)
    for cap in (128, 512, VOCAB):
        assert torch.equal(draw(r, cap), base), cap


def test_unfiltered_cap_is_plain_gumbel_max() -> None:
    r = rows(16, seed=2)
    r["top_k"] = torch.full((16,), VOCAB)
    r["top_p"] = torch.ones(16)
    tok_hash = token_hashes(VOCAB, "cpu")
    temp = torch.where(r["temperature"] > 0, r["temperature"], 1.0)
    noise = gumbel_noise(r["seeds"], r["out_pos"], tok_hash)
    plain = (r["logits"] / temp[:, None] + noise).argmax(-1)
    want = torch.where(r["temperature"] > 0, plain, r["logits"].argmax(-1))
    assert torch.equal(draw(r, 0), want)
    assert torch.equal(draw(r, VOCAB), want)


def test_uniform_stays_inside_the_open_interval() -> None:
    """The extreme hashes map strictly inside (0, 1), so no token's noise is infinite."""
    from hyloop.graphs.sampler import uniform

    h = torch.tensor([0, 1, 0xFF, 0xFFFFFF00, 0xFFFFFFFF], dtype=torch.int64)
    u = uniform(h)
    assert bool(((u > 0) & (u < 1)).all())
    assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())


def test_a_masked_token_is_never_drawn() -> None:
    """-inf logits (min_p, bad words, grammar masks) stay out for every seed and position."""
    vocab = 16384  # 64 rows x 64 positions x 16384 tokens: 2**26 noise draws
    logits = torch.randn(64, vocab)
    logits[:, 1:] = -torch.inf  # only token 0 is allowed
    seeds = torch.arange(64, dtype=torch.int64) * 7919
    for pos in range(64):
        out = sample(
            logits,
            torch.ones(64),
            torch.full((64,), -1),
            torch.ones(64),
            seeds,
            torch.full((64,), pos),
            token_hashes(vocab, "cpu"),
            0,
        )
        assert bool((out == 0).all())
