"""Model architectures; importing this package registers them."""

import contextlib

from hyloop.models.arch import llama  # noqa: F401

# Hybrid architectures register themselves when their module is present.
with contextlib.suppress(ImportError):
    from hyloop.models.arch import qwen3_next  # noqa: F401
