"""Importing hyloop chooses OpenMP's passive wait policy before torch loads libgomp, and only
then: a policy the environment already names, or a torch imported first, is left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = (
    "import os, sys\n"
    "{first}\n"
    "import hyloop\n"
    "from hyloop import omp_policy\n"
    "print(os.environ.get('OMP_WAIT_POLICY'), '|', omp_policy.status(), '|',"
    " omp_policy.shares_cores_well())\n"
)


def _probe(first: str = "", **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [part.strip() for part in out.split("|")]


def test_hyloop_first_sets_the_passive_policy() -> None:
    assert _probe() == ["PASSIVE", "OMP_WAIT_POLICY=PASSIVE (set by hyloop)", "True"]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OMP_WAIT_POLICY": "ACTIVE"}, ["ACTIVE", "OMP_WAIT_POLICY=ACTIVE", "False"]),
        ({"GOMP_SPINCOUNT": "0"}, ["None", "GOMP_SPINCOUNT=0", "True"]),
    ],
)
def test_a_policy_already_chosen_is_kept(env: dict[str, str], expected: list[str]) -> None:
    assert _probe(**env) == expected


def test_torch_first_is_too_late_and_said_so() -> None:
    policy, status, shares = _probe(first="import torch")
    assert policy == "None" and shares == "False"
    assert "torch was imported before hyloop" in status
