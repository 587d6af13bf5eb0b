"""Turns a SchedulerOutput into the flat tensors of one forward pass.

Layout: every one-token request (a decode) first, then each multi-token chunk in turn, so
attention can batch the decodes and loop over the prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.backend import AttentionMetadata, PrefillChunk
from kvserve.core.scheduler.output import ScheduledRequest


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # flat row of each sampling request's last token
    sample_requests: list[ScheduledRequest]


def build_inputs(scheduled: list[ScheduledRequest], block_size: int,
                 sliding_window: int | None, device: str) -> ModelInputs:
    decodes = [s for s in scheduled if len(s.token_ids) == 1]
    chunks = [s for s in scheduled if len(s.token_ids) > 1]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sample_requests: list[ScheduledRequest] = []
    prefills: list[PrefillChunk] = []
    for s in decodes + chunks:
        start, num = s.num_computed_tokens, len(s.token_ids)
        row = len(input_ids)
        input_ids.extend(s.token_ids)
        positions.extend(range(start, start + num))
        slots.extend(s.block_ids[p // block_size] * block_size + p % block_size
                     for p in range(start, start + num))
        if num > 1:
            num_blocks = -(-(start + num) // block_size)
            prefills.append(PrefillChunk(
                row, num, start + num,
                torch.tensor(s.block_ids[:num_blocks], dtype=torch.long, device=device)))
        if s.sample:
            sample_rows.append(row + num - 1)
            sample_requests.append(s)
    block_tables, seq_lens = _decode_tables(decodes, block_size, device)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decodes=len(decodes),
        decode_block_tables=block_tables,
        decode_seq_lens=seq_lens,
        prefills=prefills,
        sliding_window=sliding_window,
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        attn_metadata=meta,
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        sample_requests=sample_requests,
    )


def _decode_tables(decodes: list[ScheduledRequest], block_size: int, device: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables padded with block 0, and each sequence's context length."""
    seq_lens = [s.num_computed_tokens + 1 for s in decodes]
    width = -(-max(seq_lens, default=0) // block_size)
    tables = [s.block_ids[:width] + [0] * (width - len(s.block_ids[:width])) for s in decodes]
    return (torch.tensor(tables, dtype=torch.long, device=device).view(len(decodes), width),
            torch.tensor(seq_lens, dtype=torch.long, device=device))
