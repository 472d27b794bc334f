"""The engine core. ``FEATURES`` are the per-request generation features it runs, in the order
a step applies them; they are plug-ins (``hyloop.features``), which register themselves here and
are loaded with the core, so a ``SamplingParams`` is validated by every one however the core was
imported."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hyloop.features.base import Feature

FEATURES: list[type[Feature]] = []

import hyloop.features  # noqa: E402,F401  (registers the built-in features)
