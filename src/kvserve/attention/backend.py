"""The attention interface: what a backend receives for one step and must compute.

The runner lays out each step's tokens as all decode rows first (one query token per
sequence), then the prefill chunks one after another. Backends write the new keys and values
into the paged pool at `slot_mapping` and read each sequence's context through its block table.
The tensors are views of the runner's persistent buffers on the device; what a backend needs
for shapes is also given on the host, so no backend reads a device tensor back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class PrefillChunk:
    """Sequence `seq` of the step, which has `num_query_tokens` > 1 query rows from
    `query_start`, at positions `context_len - num_query_tokens .. context_len - 1` (or, with
    the metadata's `query_positions`, at those ascending positions below `context_len`)."""

    seq: int
    query_start: int
    num_query_tokens: int
    context_len: int


@dataclass(slots=True)
class AttentionMetadata:
    """One step's sequences, decodes first. Sequence i's new tokens are the rows
    `query_start_loc[i] .. query_start_loc[i + 1] - 1`; its context, new tokens included, is
    `seq_lens[i]` tokens long and lies in the blocks of `block_tables[i]`. Table entries past
    a sequence's last block are never read. Decode rows may be successive tokens of one
    sequence (speculative decoding's drafts, each a row with its own length): then
    `decode_rows_share_sequences`, and every decode row's key and value must be cached before
    any decode row attends."""

    slot_mapping: torch.Tensor  # [num_tokens] flat pool slot of each new token; -1: none
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    seq_lens: torch.Tensor  # [num_seqs]
    block_tables: torch.Tensor  # [num_seqs, at least the longest sequence's blocks]
    num_decodes: int
    seq_lens_host: np.ndarray  # seq_lens on the host, for shapes: no device sync
    prefills: list[PrefillChunk]  # the multi-token sequences, described on the host
    sliding_window: int | None
    decode_rows_share_sequences: bool = False
    # [num_tokens] each row's position, given when a chunk's queries are only some of its
    # context's last positions (a blended prompt's recomputed tokens)
    query_positions: torch.Tensor | None = None
    # [1] on the device, for a step with chunks at a CUDA graph's fixed shape: how many of
    # its leading sequences are decodes, which `num_decodes` (0 there) does not say. Its
    # sequences past the real ones have no rows, and rows past `query_start_loc[-1]` are
    # padding that writes no KV and whose output nothing reads. Only a backend that
    # `takes_padding_rows` gets one.
    decode_count: torch.Tensor | None = None

    def decode_tables(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode rows' block tables, cut to the longest decode's blocks, and their
        context lengths."""
        width = -(-int(self.seq_lens_host[:self.num_decodes].max(initial=0)) // block_size)
        return (self.block_tables[:self.num_decodes, :width],
                self.seq_lens[:self.num_decodes])


@dataclass(frozen=True, slots=True)
class QKNorm:
    """RMSNorm of each query head and each key head (Qwen3), weights in the heads'
    interleaved rotary order."""

    q_weight: torch.Tensor  # [D]
    k_weight: torch.Tensor  # [D]
    eps: float


class AttentionBackend(ABC):
    """Computes attention for one layer of one step over the paged KV pool."""

    # Whether rows with slot -1 and length 0 pass through harmlessly (no KV write, a finite
    # output): what replaying a CUDA graph padded to a larger batch needs.
    takes_padding_rows = False
    # Whether the backend norms query and key heads itself, in its rotary pass (`qk_norm`).
    fuses_qk_norm = False

    @abstractmethod
    def forward(self, qk: torch.Tensor, v: torch.Tensor, freqs_cis: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                qk_norm: QKNorm | None = None) -> torch.Tensor:
        """qk: [N, Hq + Hkv, D], the queries then the keys, each head's dimensions in
        interleaved rotary pairs, not yet rotated; v: [N, Hkv, D]; freqs_cis: [N, 1, D / 2]
        complex rotations; kv_cache: [2, Hkv, num_blocks, block_size, D]. `qk_norm` comes
        only to a backend that `fuses_qk_norm`: then qk is not yet normed either.

        Rotates queries and keys (a backend may do so in place), writes the keys and values
        into kv_cache at meta.slot_mapping and returns the attention output [N, Hq * D].
        """
