"""vLLM's ``vllm.distributed`` helpers an offline script calls (hyloop runs one process)."""

import gc

import torch


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Free what a deleted ``LLM`` left behind (there is no process group to tear down)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
