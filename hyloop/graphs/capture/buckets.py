"""Bucket lists and the key of one captured artifact.

A captured step is specialised on its batch size, on the number of req->token columns attention
reads (``kv_len``) and on the sampling mode (with its ``features`` bits). Batch sizes and
``kv_len`` are rounded up to configured buckets, so a handful of artifacts serve every step and
a short context does not attend over the whole ``max_context``.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from hyloop.graphs.step_batch import feature_names

__all__ = [
    "ArtifactKey",
    "kv_len_buckets",
    "normalize_buckets",
    "pick_bucket",
    "usable_buckets",
    "verify_buckets",
]


@dataclass(frozen=True, order=True)
class ArtifactKey:
    """What one captured artifact is specialised on."""

    batch: int  # padded batch size (a batch bucket)
    kv_len: int  # req->token columns attention reads (a kv_len bucket)
    top_cap: int = 0  # sampler candidates (0: unfiltered; ``step_kinds.candidate_cap``)
    num_logprobs: int = 0  # top logprobs returned per row
    features: int = 0  # the bits of the features applied (``step_batch.feature_bit``)
    tokens: int = 1  # positions per row: 1 (a decode step) or a verify step's (a bucket)

    def label(self) -> str:
        mode = f", top_cap={self.top_cap}, num_logprobs={self.num_logprobs}"
        mode += f", {'+'.join(feature_names(self.features))}" if self.features else ""
        mode += f", verify tokens={self.tokens}" if self.tokens > 1 else ""
        return f"bucket(batch={self.batch}, kv_len={self.kv_len}{mode})"

    def fields(self) -> tuple[int, ...]:
        """The key as a tuple (a decode step's without its ``tokens``)."""
        t = dataclasses.astuple(self)
        return t if self.tokens > 1 else t[:-1]


def verify_buckets(k: int) -> list[int]:
    """Positions per row of a verify step's artifacts for up to ``k`` drafts: 2, 3, 5, 9...
    (one draft, two, four...) up to ``k + 1``, always ``k + 1``."""
    sizes, t = [], 2
    while t < k + 1:
        sizes.append(t)
        t = 2 * t - 1
    return [*sizes, k + 1]


def normalize_buckets(name: str, buckets: Sequence[int]) -> tuple[int, ...]:
    """Sorted, de-duplicated positive ints; ``name`` appears in the error."""
    values = list(buckets)
    if not values:
        raise ValueError(f"{name}: empty bucket list, expected at least one size")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: bucket {v!r} in {values}, expected ints >= 1")
    return tuple(sorted(set(values)))


def pick_bucket(buckets: Sequence[int], n: int) -> int | None:
    """The smallest bucket ``>= n`` of sorted ``buckets``, or None when ``n`` exceeds them all."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def kv_len_buckets(
    max_context: int, *, multiple: int | None = 256, pow2: bool = False
) -> list[int]:
    """``kv_len`` buckets up to ``max_context`` (always the last bucket).

    ``pow2`` gives 16, 32, 64, ...; otherwise multiples of ``multiple`` (``None``: one bucket,
    ``max_context``). Powers of two keep the artifact count logarithmic in the context; fixed
    multiples bound the wasted attention columns to ``multiple - 1``.
    """
    if max_context < 1:
        raise ValueError(f"kv_len_buckets: max_context {max_context}, expected >= 1")
    if pow2:
        sizes, size = [], 16
        while size < max_context:
            sizes.append(size)
            size *= 2
    elif multiple is None:
        sizes = []
    elif multiple < 1:
        raise ValueError(f"kv_len_buckets: multiple {multiple}, expected >= 1 or None")
    else:
        sizes = list(range(multiple, max_context, multiple))
    return [*sizes, max_context]


def usable_buckets(buckets: Sequence[int], max_requests: int) -> list[int]:
    """The configured batch buckets a step can fill (at most ``max_requests`` rows)."""
    return sorted({b for b in buckets if b <= max_requests}) or [max_requests]
