"""The one deferred-free rule shared by every pool: a free waits for the steps that may read it.

A step gets a generation when launched (or planned) and is retired once known complete. A free
made while a generation is unretired may still be read or written by that step on the device,
so it is parked under the newest unretired generation and returned when that retires. With
nothing unretired a free is immediate, which is all an outside caller of a pool ever sees.

Each pool keeps a ``DeferredFrees``, parks through ``fence.defer_gen`` and registers its release
with ``fence.attach``, so pools, the loops and the tree share the rule without an ambient mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class StepFence:
    """Generations of launched steps: ``issue`` at launch or plan, ``retire`` once complete."""

    def __init__(self) -> None:
        self.issued = 0
        self.retired = 0
        self._release: list[Callable[[int], None]] = []

    def attach(self, release: Callable[[int], None]) -> None:
        """``release(through)`` is called whenever generations up to ``through`` retire."""
        self._release.append(release)

    def issue(self) -> int:
        self.issued += 1
        return self.issued

    def retire(self, generation: int) -> None:
        """Step ``generation`` (and every earlier one) is complete: release what waited on it."""
        if generation > self.issued:
            raise ValueError(f"retire of generation {generation}: only {self.issued} issued")
        self.retired = max(self.retired, generation)
        for release in self._release:
            release(self.retired)

    @property
    def defer_gen(self) -> int | None:
        """The generation a free made now must wait for, or None when no step is unretired."""
        return self.issued if self.issued > self.retired else None

    @property
    def idle(self) -> bool:
        return self.issued == self.retired


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
