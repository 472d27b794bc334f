"""Per-request generation features, one file each behind one protocol (``base.Feature``).

``FEATURES`` lists them in the order the step applies them (vLLM's); the core loops over it and
names none of them. A new feature is one file and one ``register`` line.
"""

from __future__ import annotations

from hyloop.framework.features.base import Feature, RequestContext, table_with
from hyloop.framework.features.logits_controls import LogitsControls
from hyloop.framework.features.min_p import MinP
from hyloop.framework.features.penalties import Penalties
from hyloop.framework.features.stop_strings import StopStrings
from hyloop.framework.features.structured_outputs import StructuredOutputs
from hyloop.graphs.step_batch import feature_bit

__all__ = ["FEATURES", "Feature", "RequestContext", "register", "table_with"]

FEATURES: list[type[Feature]] = []


def register(feature: type[Feature]) -> type[Feature]:
    """Add ``feature`` after those registered (a step applies them in this order)."""
    if any(f.name == feature.name for f in FEATURES):
        raise ValueError(f"feature {feature.name!r} is registered already")
    if feature.in_step:
        feature.bit = feature_bit(feature.name, feature.flag)
    FEATURES.append(feature)
    return feature


for _feature in (StructuredOutputs, LogitsControls, Penalties, MinP, StopStrings):
    register(_feature)
