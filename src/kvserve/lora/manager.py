"""The adapters loaded onto one model, each in a slot; every linear layer an adapter targets
holds all slots' weights packed side by side (see batch.py), so one forward mixes adapters
and the base model in three ops a layer."""

from __future__ import annotations

from pathlib import Path

import torch

from kvserve.layers.linear import Linear
from kvserve.lora.adapter import LoRAAdapter, load_adapter
from kvserve.lora.batch import LoRABatch
from kvserve.models.llama import LlamaForCausalLM


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, max_loras: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.slots: dict[str, int] = {}  # adapter name -> slot
        self.adapters: dict[int, LoRAAdapter] = {}
        self.linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}

    @property
    def num_slots(self) -> int:
        return max(self.adapters, default=-1) + 1

    def add(self, name: str, path: str | Path) -> None:
        """Loads an adapter into a free slot (reloads it in its own slot if loaded)."""
        adapter = load_adapter(name, path, self.model)
        if "lm_head" in adapter.weights:
            raise ValueError(f"lora {name!r}: adapters of lm_head are not supported")
        slot = self.slots.get(name)
        if slot is None:
            if len(self.slots) >= self.max_loras:
                raise ValueError(f"lora {name!r}: max_loras ({self.max_loras}) adapters are "
                                 "loaded already")
            slot = min(set(range(self.max_loras)) - set(self.slots.values()))
        device = self.model.embed_tokens.device
        adapter.weights = {layer: (a.to(device), b.to(device))
                           for layer, (a, b) in adapter.weights.items()}
        self.adapters[slot] = adapter
        self.slots[name] = slot
        self._pack()

    def remove(self, name: str) -> None:
        """Unloads an adapter; its slot is free for the next."""
        del self.adapters[self.slots.pop(name)]
        self._pack()

    def _pack(self) -> None:
        """Lays every slot's weights side by side in each layer, each slot as wide as the
        layer's widest (zeros where an adapter is narrower or does not target the layer)."""
        num_slots = self.num_slots
        for layer, linear in self.linears.items():
            parts = {slot: adapter.weights[layer] for slot, adapter in self.adapters.items()
                     if layer in adapter.weights}
            if not parts:
                linear.set_lora(None, None)
                continue
            width = max(a.shape[1] for a, _ in parts.values())
            any_a, any_b = next(iter(parts.values()))
            a_all = any_a.new_zeros(linear.in_features, num_slots * width)
            b_all = any_b.new_zeros(num_slots * width, linear.out_features)
            for slot, (a, b) in parts.items():
                a_all[:, slot * width:slot * width + a.shape[1]] = a
                b_all[slot * width:slot * width + b.shape[0]] = b
            linear.set_lora(a_all, b_all)

    def batch(self, slot_of_row: torch.Tensor) -> LoRABatch:
        return LoRABatch(slot_of_row, self.num_slots)
