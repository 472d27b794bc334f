"""Weight-only quantized Linears (int4 groups, per-channel int8) on torch's CPU kernels, and the
``model.weights`` policy that decides which Linears of a loaded model use them (``apply``)."""

from __future__ import annotations

from hyloop.models.quant.apply import WEIGHT_MODES, WeightsMode, quantize_linears
from hyloop.models.quant.formats import Int4Groups, Int8Rows, int4_from_dense, int8_from_dense
from hyloop.models.quant.linear import Int4Linear, Int8Linear, WeightOnlyLinear, kernels_available

__all__ = [
    "WEIGHT_MODES",
    "Int4Groups",
    "Int4Linear",
    "Int8Linear",
    "Int8Rows",
    "WeightOnlyLinear",
    "WeightsMode",
    "int4_from_dense",
    "int8_from_dense",
    "kernels_available",
    "quantize_linears",
]
