"""CacheBlend's selective recompute: a blended prompt's forward computes only a few of its
reused tokens again in context.

Before the forward, each chunk's KV, computed on its own, has been copied into the prompt's
blocks at its place (keys turned to their new positions). That KV lacks the chunk's
attention to the chunks before it. The first layer runs on every token, which rewrites that
layer's KV in context. At the second layer's input, the KV of every reused token is computed
again and compared with the copied one: the `recompute_ratio` share with the largest
deviation, plus every token not reused (the last segment), go on through the remaining
layers; the others keep their (copied, second layer: refreshed) KV and leave the forward.
The tokens that go on stay a prefill chunk whose queries sit at their own positions
(`AttentionMetadata.query_positions`), over KV that mixes copied and recomputed entries.
With a ratio of 0, the copied KV is used as it is: only the tokens not reused are computed,
from the first layer on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kvserve.attention.backend import AttentionMetadata, PrefillChunk
from kvserve.attention.torch_ref import apply_rotary
from kvserve.lora.batch import LoRABatch
from kvserve.worker.forward_context import forward_context, narrow_rows
from kvserve.worker.tensor_parallel import all_reduce


@dataclass(slots=True)
class BlendedPrompt:
    """A blended prompt's chunk of the step: `num_rows` rows from `first_row`, sequence `seq`
    of the attention metadata. `reused` marks the rows whose KV was copied in from chunks."""

    seq: int
    first_row: int
    num_rows: int
    reused: np.ndarray  # bool [num_rows]


class SelectiveRecompute:
    """Narrows a step's rows at layer `layer` to those that go on (see the module doc)."""

    def __init__(self, blends: list[BlendedPrompt], meta: AttentionMetadata,
                 positions: torch.Tensor, lora: LoRABatch | None,
                 recompute_ratio: float) -> None:
        self.blends = blends
        self.meta = meta
        self.positions = positions
        self.lora = lora
        self.ratio = recompute_ratio
        self.layer = 1 if recompute_ratio > 0 else 0
        self.num_rows = positions.shape[0]
        self.kept: torch.Tensor | None = None  # the rows that went on, in their new order

    def select(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
               rotations: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The rows that go on through `layer` and after: their hidden state (residual
        folded in) and rotations (each rotary embedding's, as the model indexes them). The
        forward context narrows to them too."""
        if residual is not None:
            x = x + residual
        meta = self.meta
        freqs_cis = rotations[layer.uses_local_rotary]
        going_on = {b.seq: self._rows_going_on(layer, x, freqs_cis, b) for b in self.blends}
        kept, prefills, num_kept = [np.arange(meta.num_decodes)], [], meta.num_decodes
        for chunk in meta.prefills:
            rows = going_on.get(chunk.seq, np.arange(chunk.num_query_tokens))
            kept.append(chunk.query_start + rows)
            prefills.append(PrefillChunk(chunk.seq, num_kept, len(rows), chunk.context_len))
            num_kept += len(rows)
        self.kept = torch.from_numpy(np.concatenate(kept)).to(x.device)
        lora = self.lora
        if lora is not None:
            lora = LoRABatch(lora.slot_of_row[self.kept], lora.num_slots)
        query_start = np.array([c.query_start for c in prefills] + [num_kept], dtype=np.int64)
        narrow_rows(AttentionMetadata(
            slot_mapping=meta.slot_mapping[self.kept],
            query_start_loc=torch.cat([meta.query_start_loc[:meta.num_decodes],
                                       torch.from_numpy(query_start).to(x.device)]),
            seq_lens=meta.seq_lens,
            block_tables=meta.block_tables,
            num_decodes=meta.num_decodes,
            seq_lens_host=meta.seq_lens_host,
            prefills=prefills,
            sliding_window=meta.sliding_window,
            decode_rows_share_sequences=meta.decode_rows_share_sequences,
            query_positions=self.positions[self.kept],
        ), lora)
        return x[self.kept], [rotation[self.kept] for rotation in rotations]

    def restore(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final hidden states back in the step's row order (rows that left: zeros)."""
        if self.kept is None:
            return hidden
        full = hidden.new_zeros(self.num_rows, hidden.shape[1])
        return full.index_copy_(0, self.kept, hidden)

    def _rows_going_on(self, layer: nn.Module, x: torch.Tensor, freqs_cis: torch.Tensor,
                       blend: BlendedPrompt) -> np.ndarray:
        """The blended prompt's rows (from its first) that go on: every row not reused, and
        the reused rows whose refreshed KV deviates most from the copied; and the last row
        always, so that no chunk of a step is left without one."""
        reused = blend.reused.copy()
        reused[-1] = False
        candidates = np.flatnonzero(reused)
        forced = np.flatnonzero(~reused)
        num_kept = math.ceil(self.ratio * len(candidates))
        if not num_kept:
            return forced
        rows = slice(blend.first_row, blend.first_row + blend.num_rows)
        with forward_context(self.meta):  # the blended rows run the base model
            deviation = _refresh_kv(layer, x[rows], freqs_cis[rows],
                                    self.meta.slot_mapping[rows])
        all_reduce(deviation)  # over every rank's KV heads: all ranks keep the same rows
        index = torch.from_numpy(candidates).to(x.device)
        top = torch.topk(deviation[index], num_kept).indices.cpu().numpy()
        return np.sort(np.concatenate([forced, candidates[top]]))


def _refresh_kv(layer: nn.Module, x: torch.Tensor, freqs_cis: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
    """Computes the layer's keys and values of hidden states `x` (residual folded in) at
    their cache `slots`, writes them there and returns each row's squared deviation from
    what the slots held, over this rank's KV heads."""
    attn = layer.self_attn
    qk, v = attn.project(layer.input_layernorm(x))
    k = apply_rotary(qk[:, attn.num_heads:], freqs_cis).transpose(0, 1)
    v = v.transpose(0, 1)
    cache = attn.kv_cache.view(2, attn.num_kv_heads, -1, attn.head_dim)
    deviation = ((k.float() - cache[0][:, slots].float()).square().sum((0, 2))
                 + (v.float() - cache[1][:, slots].float()).square().sum((0, 2)))
    cache[0].index_copy_(1, slots, k)
    cache[1].index_copy_(1, slots, v)
    return deviation
