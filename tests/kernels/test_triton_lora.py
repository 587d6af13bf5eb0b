"""The segmented LoRA kernels against the mask form the CPU path runs (lora/batch.py); without
CUDA, in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve.lora.batch import LoRABatch  # noqa: E402
from kvserve.lora.triton_lora import add_lora  # noqa: E402
from kvserve.triton_splits import split_counters  # noqa: E402
from tests.kernels.test_triton_attention import DEVICE  # noqa: E402


@pytest.mark.parametrize(("in_features", "out_features", "width"),
                         [(64, 96, 16), (80, 40, 8), (600, 40, 8)])
@pytest.mark.parametrize("slots", [[-1, 2, 0, 2, 2, -1, 1, 0], [3] * 20, [-1, -1]])
def test_segmented_lora_matches_the_mask_form(in_features, out_features, width, slots):
    """Mixed adapters and base-model rows in any order, one adapter for a whole batch of
    more rows than a tile, and no adapter at all; widths below a dot's 16, layer sizes off
    the tiles, and a shrink split in two over 600 inputs (the second split ends mid-tile)."""
    gen = torch.Generator().manual_seed(len(slots) + width)
    num_slots = 4
    x = torch.randn(len(slots), in_features, generator=gen)
    a = torch.randn(in_features, num_slots * width, generator=gen)
    b = torch.randn(num_slots * width, out_features, generator=gen)
    out = torch.randn(len(slots), out_features, generator=gen)
    slot_of_row = torch.tensor(slots)
    mask = LoRABatch(slot_of_row, num_slots).mask(width, torch.float32)
    expected = out + ((x @ a) * mask) @ b
    got = out.to(DEVICE)
    add_lora(x.to(DEVICE), got, a.to(DEVICE), b.to(DEVICE),
             LoRABatch(slot_of_row.to(DEVICE), num_slots), num_programs=64)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)
    assert not split_counters(got.device).any()  # each split group re-armed its counter


def test_a_step_groups_its_rows_by_adapter_once_for_every_layer():
    batch = LoRABatch(torch.tensor([1, -1, 0, 1, -1]), num_slots=3)
    order, starts = batch.segments()
    assert order.tolist() == [1, 4, 2, 0, 3]  # base rows, then slot 0's, then slot 1's
    assert starts.tolist() == [2, 3, 5, 5]  # slot s: order[starts[s]:starts[s + 1]]
    assert batch.segments()[0] is order
