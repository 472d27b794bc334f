"""The OpenMP wait policy CPU steps run under, set before torch loads OpenMP.

torch's CPU builds run every parallel region (ATen's ``parallel_for``, the MKL / oneDNN GEMMs, the
weight-only int4 / int8 kernels and every kernel inductor compiles) on GNU OpenMP (libgomp). A
libgomp thread that finishes its share of a region spins (``GOMP_SPINCOUNT``, 300,000 turns by
default) before it sleeps. Where another process holds a core, the spinning threads take the time
slices the late thread needs, and every region waits for it: a compiled decode step (one parallel
region per fused kernel, hundreds a step, where eager ATen keeps decode-sized ops serial) waited a
scheduler tick at each and fell several-fold more than eager (``bench/peers.py --load``). With
``OMP_WAIT_POLICY=PASSIVE`` a waiting thread sleeps at once and the late one gets the core.

libgomp reads its environment once, when it loads (``import torch``). So importing hyloop sets
``OMP_WAIT_POLICY=PASSIVE``, unless the environment already chooses (``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT`` set, e.g. ``OMP_WAIT_POLICY=ACTIVE`` for a machine that is never shared) or
torch was imported first (then nothing can change it: ``status`` says so, and the CPU kernels
log it once). No torch import here: this module runs before torch loads.
"""

from __future__ import annotations

import os
import sys

POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
DEFAULT_POLICY = "PASSIVE"

_set_by_hyloop = False
_torch_first = False


def apply_default() -> None:
    """Choose the passive wait policy for this process and its children, if nobody did."""
    global _set_by_hyloop, _torch_first
    if any(v in os.environ for v in POLICY_VARS):
        return
    if "torch" in sys.modules:
        _torch_first = True  # libgomp already read its environment: too late to choose
        return
    os.environ["OMP_WAIT_POLICY"] = DEFAULT_POLICY
    _set_by_hyloop = True


def status() -> str:
    """What this process's OpenMP waits under, in words (the run summary's line)."""
    chosen = {v: os.environ[v] for v in POLICY_VARS if v in os.environ}
    if _torch_first and not chosen:
        return "libgomp default (spinning waits): torch was imported before hyloop"
    if not chosen:
        return "libgomp default (spinning waits)"
    text = ", ".join(f"{k}={v}" for k, v in chosen.items())
    return f"{text} (set by hyloop)" if _set_by_hyloop else text


def shares_cores_well() -> bool:
    """Whether waiting threads give their core away at once (passive, or no spin at all)."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").upper()
    return policy == "PASSIVE" or os.environ.get("GOMP_SPINCOUNT") == "0"
