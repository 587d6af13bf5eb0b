"""The adapters loaded onto one model, each in a slot of every layer it targets; a step's
rows go to their request's slot, so one forward mixes adapters and the base model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvserve.layers.linear import Linear
from kvserve.lora.adapter import load_adapter
from kvserve.models.llama import LlamaForCausalLM


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, max_loras: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.slots: dict[str, int] = {}  # adapter name -> slot
        self.linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}

    def add(self, name: str, path: str | Path) -> None:
        """Loads an adapter into a free slot (reloads it in its own slot if loaded)."""
        adapter = load_adapter(name, path, self.model)
        if "lm_head" in adapter.weights:
            raise ValueError(f"lora {name!r}: adapters of lm_head are not supported")
        if name in self.slots:
            self.remove(name)
        if len(self.slots) >= self.max_loras:
            raise ValueError(f"lora {name!r}: max_loras ({self.max_loras}) adapters are "
                             "loaded already")
        slot = min(set(range(self.max_loras)) - set(self.slots.values()))
        device = self.model.embed_tokens.device
        for layer, (a, b) in adapter.weights.items():
            self.linears[layer].lora[slot] = (a.to(device), b.to(device))
        self.slots[name] = slot

    def remove(self, name: str) -> None:
        slot = self.slots.pop(name)
        for linear in self.linears.values():
            linear.lora.pop(slot, None)

    def rows(self, slots: list[int | None], query_start: np.ndarray, device: torch.device
             ) -> dict[int, torch.Tensor]:
        """Slot -> the step's rows of the sequences in it; `slots[i]` is sequence i's, whose
        rows are `query_start[i]` to `query_start[i + 1]`."""
        by_slot: dict[int, list[np.ndarray]] = {}
        for i, slot in enumerate(slots):
            if slot is not None:
                by_slot.setdefault(slot, []).append(np.arange(query_start[i],
                                                              query_start[i + 1]))
        return {slot: torch.from_numpy(np.concatenate(parts)).to(device)
                for slot, parts in by_slot.items()}
