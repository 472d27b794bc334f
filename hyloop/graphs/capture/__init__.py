"""Capture: buckets, the per-bucket runner, its backends and the policy of what to capture."""

from hyloop.graphs.capture.auto_plan import Estimates, Outlook, Plan
from hyloop.graphs.capture.backends import GUARD_EVERY, Backend, RecompileError, resolve_backend
from hyloop.graphs.capture.bucket_runner import BACKENDS, BucketRunner, CapturedKind
from hyloop.graphs.capture.buckets import ArtifactKey, kv_len_buckets, pick_bucket, usable_buckets
from hyloop.graphs.capture.policy import Graphs, StepHistory, history_key

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
