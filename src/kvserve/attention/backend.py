"""The attention interface: what a backend receives for one step and must compute.

The runner lays out each step's tokens as all decode rows first (one query token per
sequence), then the prefill chunks one after another. Backends write the new keys and values
into the paged pool at `slot_mapping` and read each sequence's context through its block table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillChunk:
    """A run of `num_query_tokens` consecutive query tokens of one sequence.

    Its queries are at positions `context_len - num_query_tokens .. context_len - 1`.
    """

    query_start: int
    num_query_tokens: int
    context_len: int
    block_ids: torch.Tensor  # [ceil(context_len / block_size)]


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat slot index of each new token
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks], padded with block 0
    decode_seq_lens: torch.Tensor  # [num_decodes] context length including the new token
    prefills: list[PrefillChunk]
    sliding_window: int | None


class AttentionBackend(ABC):
    """Computes attention for one layer of one step over the paged KV pool."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [N, Hq, D]; k, v: [N, Hkv, D]; kv_cache: [2, Hkv, num_blocks, block_size, D].

        Writes k and v into kv_cache and returns the attention output [N, Hq * D].
        """
