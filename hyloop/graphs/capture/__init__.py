"""Capture: buckets, the per-bucket runner, its backends and the policy of what to capture."""

from hyloop.graphs.capture.auto_plan import Estimates, Outlook, Plan
from hyloop.graphs.capture.backends import GUARD_EVERY, RecompileError
from hyloop.graphs.capture.bucket_runner import BACKENDS, BucketRunner, CapturedKind
from hyloop.graphs.capture.buckets import ArtifactKey, kv_len_buckets, pick_bucket, usable_buckets
from hyloop.graphs.capture.history import StepHistory, history_key
from hyloop.graphs.capture.policy import Backend, Graphs, resolve_backend

__all__ = [
    "BACKENDS",
    "GUARD_EVERY",
    "ArtifactKey",
    "Backend",
    "BucketRunner",
    "CapturedKind",
    "Estimates",
    "Graphs",
    "Outlook",
    "Plan",
    "RecompileError",
    "StepHistory",
    "history_key",
    "kv_len_buckets",
    "pick_bucket",
    "resolve_backend",
    "usable_buckets",
]
