"""Which adapter each row of a step runs, in the form the linear layers apply it: every
loaded adapter's A side by side ([in, slots x width]) is one matmul for all rows, a mask
keeps each row's own adapter's columns, and every B stacked is a second matmul. Three ops a
layer whatever the mix of adapters, instead of a gather, two matmuls and a scatter per
adapter."""

from __future__ import annotations

import torch


class LoRABatch:
    def __init__(self, slot_of_row: torch.Tensor, num_slots: int) -> None:
        """`slot_of_row`: [rows] adapter slot of each row, -1 for the base model."""
        self.slot_of_row = slot_of_row
        self.num_slots = num_slots
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._segments: tuple[torch.Tensor, torch.Tensor] | None = None

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, slots x width]: 1 where a column belongs to the row's adapter."""
        key = (width, dtype)
        if key not in self._masks:
            column_slot = torch.arange(self.num_slots * width,
                                       device=self.slot_of_row.device) // width
            self._masks[key] = (column_slot == self.slot_of_row.unsqueeze(1)).to(dtype)
        return self._masks[key]

    def segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, starts): the rows grouped by slot, base-model rows (slot -1) first, slot
        s's rows being order[starts[s] : starts[s + 1]] (the segmented kernels' form). Made
        once a step for every layer, and counted by a scatter: bincount reads its input's
        maximum back to the host, which a CUDA graph cannot capture and an eager step waits
        for."""
        if self._segments is None:
            slots = self.slot_of_row
            order = torch.argsort(slots, stable=True)
            counts = torch.zeros(self.num_slots + 1, dtype=torch.long, device=slots.device)
            counts.scatter_add_(0, slots + 1, torch.ones_like(slots))
            self._segments = order, torch.cumsum(counts, 0)
        return self._segments
