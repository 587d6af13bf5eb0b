"""vLLM's `LoRARequest`: the adapter an offline `LLM.generate` or `LLM.chat` call runs its
prompts with, loaded on first use."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter (a PEFT folder or Hub id) under `lora_name`: a name not loaded yet is loaded
    from `lora_path`, one loaded already is used as it is. `lora_int_id` keeps vLLM's
    signature; kvserve knows adapters by name."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
