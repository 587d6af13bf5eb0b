"""The KV block pool of a model: one tensor, each layer's attention bound to its slice, and
on a GPU its size, from the memory the weights leave."""

from __future__ import annotations

import logging

import torch

from kvserve.config import EngineConfig, GiB, ModelConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.worker.cpu_allocator import advise_huge_pages
from kvserve.worker.prompt_logprobs import MAX_ROWS as PROMPT_LOGPROB_ROWS

logger = logging.getLogger(__name__)

# Kept beside a step's activations: the decode CUDA graphs' pool (170-215 MiB for llama3-8b
# and qwen3-0.6b at 128-264 rows), cuBLAS workspaces and the caching allocator's slack.
DEVICE_HEADROOM = 512 << 20


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


def step_activation_bytes(config: EngineConfig) -> int:
    """A bound on what the largest step allocates beside the weights and the pool: each
    token's activations, and float32 rows of logits and their log-softmax. Those are the
    sampled rows (a row per sequence and draft) or a slice of prompt rows at a time, not
    every token: prefill_first runs a prompt of up to max_model_len tokens in one step."""
    sched = config.scheduler
    vocab_size = config.model.shard(config.tensor_parallel_size).vocab_size
    logits_rows = min(sched.max_num_tokens_per_step,
                      max(PROMPT_LOGPROB_ROWS,
                          sched.max_num_seqs * (1 + config.num_speculative_tokens)))
    return (sched.max_num_tokens_per_step * _activation_bytes_per_token(config)
            + logits_rows * 2 * 4 * vocab_size)


def graph_pool_bytes(config: EngineConfig) -> int:
    """What the CUDA graphs of steps with chunks keep for themselves: the largest one's
    activations (logits are computed outside the graphs). The decode graphs' pool is small
    beside it, within DEVICE_HEADROOM."""
    return config.graph_tokens * _activation_bytes_per_token(config)


def reserved_bytes(config: EngineConfig) -> int:
    """Device memory that neither the weights nor the pool take."""
    return step_activation_bytes(config) + graph_pool_bytes(config) + DEVICE_HEADROOM


def _activation_bytes_per_token(config: EngineConfig) -> int:
    """A token's hidden states and attention and MLP intermediates, in the model's dtype."""
    mc = config.model.shard(config.tensor_parallel_size)
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return mc.dtype.itemsize * (3 * mc.hidden_size + 2 * q + 2 * kv + 3 * mc.intermediate_size)


def blocks_in_device_memory(config: EngineConfig, free: int, total: int) -> int:
    """The pool's blocks where `config.sized_by_device_memory`: what gpu_memory_utilization
    of the device's `total` bytes leaves once the memory in use now (`total - free`: the
    weights, and anything else on the device) and a step's activations are set aside, up
    to `EngineConfig.most_blocks_used`."""
    utilization = config.cache.gpu_memory_utilization
    in_use = total - free
    reserve = reserved_bytes(config)
    budget = int(utilization * total) - in_use - reserve
    per_block = config.pool_bytes_per_block
    if budget < per_block:
        raise ValueError(
            f"gpu_memory_utilization {utilization} of the device's {total / GiB:.1f} GiB leaves "
            f"no room for the KV cache: {in_use / GiB:.1f} GiB are in use with the weights "
            f"loaded and {reserve / GiB:.1f} GiB are kept for a step's activations and CUDA "
            f"graphs; raise gpu_memory_utilization, or give kv_cache_memory")
    num_blocks = min(budget // per_block, config.most_blocks_used)
    logger.info("KV cache: %.1f GiB of %.1f GiB (gpu_memory_utilization %.2f) once %.1f GiB "
                "in use and %.1f GiB for activations and CUDA graphs are set aside",
                num_blocks * per_block / GiB, total / GiB, utilization, in_use / GiB,
                reserve / GiB)
    return int(num_blocks)
