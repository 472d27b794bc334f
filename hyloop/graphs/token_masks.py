"""Token masks a step reads at sampling time, which the host may still be writing at launch.

A structured-output request's allowed tokens for step N+1 depend on the token step N sampled.
Under lookahead, step N+1 is launched before step N is resolved, so its mask is not ready when
its forward starts; it is needed only at sampling. ``await_token_masks`` is the one point in
the step that reads the mask table: it waits on the step kind's ``MaskGate`` (armed by the
pipeline when it launches such a step, released once the previous step's tokens have advanced
the grammars and their rows are written) and then gathers the rows. On CPU the step runs on
the launching thread, so the grammar work on the resolve thread overlaps the step's forward.

NOTE: a CUDA graph replays device work only, never this wait; on CUDA the pipeline does not
launch a masked step before its masks are written (it drains instead), and the gate stays open.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

_GATES: weakref.WeakValueDictionary[int, MaskGate] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)
WAIT_LIMIT_S = 120.0  # a gate armed this long means its release path was lost


class MaskGate:
    """Open unless armed: ``arm()`` before launching a step whose masks are still being
    written, ``release()`` once they are."""

    def __init__(self) -> None:
        self.id = next(_IDS)
        self._open = threading.Event()
        self._open.set()
        _GATES[self.id] = self

    def arm(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    @property
    def armed(self) -> bool:
        return not self._open.is_set()

    def wait(self) -> None:
        if not self._open.wait(WAIT_LIMIT_S):
            raise RuntimeError(
                f"token masks: a step waited {WAIT_LIMIT_S:.0f} s for its masks and they "
                "were never released (a resolve that raised, or a gate armed without one)"
            )


@torch.library.custom_op("hyloop::await_token_masks", mutates_args=())
def _await_token_masks(table: torch.Tensor, rows: torch.Tensor, gate: int) -> torch.Tensor:
    owner = _GATES.get(gate)
    if owner is not None:
        owner.wait()
    return table.index_select(0, rows)


@_await_token_masks.register_fake
def _(table: torch.Tensor, rows: torch.Tensor, gate: int) -> torch.Tensor:
    return table.new_empty((rows.shape[0], *table.shape[1:]))


def await_token_masks(table: torch.Tensor, rows: torch.Tensor, gate: MaskGate) -> torch.Tensor:
    """Rows ``rows`` of the mask ``table``, read once ``gate`` is open."""
    return _await_token_masks(table, rows, gate.id)
