"""vLLM's ``vllm.lora.request`` module path: ``LoRARequest``, which clients import at load.

hyloop serves no adapters: the class exists so such clients import, and a request that carries
one is refused where it is passed (``LLM.generate``, ``LLMEngine.add_request``:
``NotSupportedError`` naming ``lora_request``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoRARequest:
    """vLLM's fields: the adapter's name, its positive integer id and its path."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    long_lora_max_len: int | None = None
    base_model_name: str | None = field(default=None)
    tensorizer_config_dict: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id: got {self.lora_int_id!r}; expected >= 1")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
