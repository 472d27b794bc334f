"""Compatibility routes for programs written for other engines (``compat.vllm``) and the
harnesses that measure them (``compat.lm_eval``)."""
