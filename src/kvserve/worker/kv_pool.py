"""The KV block pool of a model: one tensor, each layer's attention bound to its slice."""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.worker.cpu_allocator import advise_huge_pages


def allocate_kv_pool(model: LlamaForCausalLM, cfg: ModelConfig, num_blocks: int,
                     block_size: int, device: str) -> torch.Tensor:
    """[layers, K/V, kv heads, blocks, block_size, head_dim], zero-filled so that padded
    reads are finite (they are masked, and 0 * NaN would not be)."""
    pool = torch.empty(cfg.num_layers, 2, cfg.num_kv_heads, num_blocks, block_size,
                       cfg.head_dim, dtype=cfg.dtype, device=device)
    if pool.device.type == "cpu":
        advise_huge_pages(pool)  # before the first touch, which maps the pages
    pool.zero_()
    for i, layer in enumerate(model.layers):
        layer.self_attn.kv_cache = pool[i]
    return pool
