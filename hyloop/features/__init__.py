"""Per-request generation features, one file each behind one protocol (``base.Feature``).

``register`` adds one to the core's ``FEATURES`` (``hyloop.framework``), in the order the step
applies them (vLLM's); the core loops over them and names none. A new feature is one file and
one ``register`` line.
"""

from __future__ import annotations

from hyloop.features.base import Feature, RequestContext, table_with
from hyloop.features.logits_controls import LogitsControls
from hyloop.features.min_p import MinP
from hyloop.features.penalties import Penalties
from hyloop.features.stop_strings import StopStrings
from hyloop.features.structured_outputs import StructuredOutputs
from hyloop.framework import FEATURES
from hyloop.graphs.step_batch import feature_bit

__all__ = ["FEATURES", "Feature", "RequestContext", "register", "table_with"]


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
