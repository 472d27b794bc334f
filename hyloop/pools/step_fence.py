"""The one deferred-free rule shared by every pool: a free waits for the steps that may read it.

A step gets a generation when launched (or planned) and is retired once known complete. A free
made while a generation is unretired may still be read or written by that step on the device,
so it is parked under the newest unretired generation and returned when that retires. With
nothing unretired a free is immediate, which is all an outside caller of a pool ever sees.

Each pool keeps a ``DeferredFrees``, parks through ``fence.defer_gen`` and registers its release
with ``fence.attach``, so pools, the loops and the tree share the rule without an ambient mode;
a release is called only while its pool has something parked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class StepFence:
    """Generations of launched steps: ``issue`` at launch or plan, ``retire`` once complete."""

    def __init__(self) -> None:
        self.issued = 0
        self.retired = 0
        self._release: list[tuple[Callable[[int], None], DeferredFrees[Any] | None]] = []
        self._settle()

    def attach(
        self, release: Callable[[int], None], parked: DeferredFrees[Any] | None = None
    ) -> None:
        """``release(through)`` is called whenever generations up to ``through`` retire (only
        while ``parked`` holds something, when given)."""
        self._release.append((release, parked))

    def issue(self) -> int:
        self.issued += 1
        self._settle()
        return self.issued

    def retire(self, generation: int) -> None:
        """Step ``generation`` (and every earlier one) is complete: release what waited on it."""
        if generation > self.issued:
            raise ValueError(f"retire of generation {generation}: only {self.issued} issued")
        self.retired = max(self.retired, generation)
        self._settle()
        for release, parked in self._release:
            if parked is None or len(parked):
                release(self.retired)

    def _settle(self) -> None:
        # ``idle``: no step unretired; ``defer_gen``: the generation a free made now must wait
        # for (None when idle). Plain attributes: every free reads them.
        self.idle = self.issued == self.retired
        self.defer_gen: int | None = None if self.idle else self.issued


class DeferredFrees(Generic[T]):
    """Items freed under a generation, in order; ``take_through(g)`` hands back those ``<= g``."""

    def __init__(self) -> None:
        self._items: list[tuple[int, T]] = []

    def park(self, generation: int, item: T) -> None:
        self._items.append((generation, item))

    def take_through(self, generation: int | None = None) -> list[T]:
        """Remove and return the items of generations ``<= generation`` (all when None)."""
        if generation is None:
            done, self._items = [item for _, item in self._items], []
            return done
        done = [item for g, item in self._items if g <= generation]
        if done:
            self._items = [(g, item) for g, item in self._items if g > generation]
        return done

    def items(self) -> list[T]:
        return [item for _, item in self._items]

    def __len__(self) -> int:
        return len(self._items)
