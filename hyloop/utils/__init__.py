"""vLLM's ``vllm.utils`` names an offline script imports."""

from hyloop.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
