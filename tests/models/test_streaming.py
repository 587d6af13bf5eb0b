"""Attention sinks with a sliding window on a real checkpoint: exact key shifts, outputs
equal to transformers while nothing slides, and streams past max_model_len whose outputs do
not depend on the step budget, on the prompts beside them or on swapping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM
from kvserve.attention.torch_ref import apply_rotary
from tests.conftest import random_prompts
from tests.models.test_hf_equivalence import (
    MAX_TOKENS,
    hf_greedy,
    kv_bytes_for_blocks,
    run_greedy,
)

STREAM = dict(enable_prefix_caching=False, streaming_window=4, attention_sinks=4,
              max_model_len=128)


def test_shifted_keys_equal_keys_rotated_at_the_lower_position(llama_dir):
    assert_shifts_keys_exactly(llama_dir)


def assert_shifts_keys_exactly(path: Path) -> None:
    llm = LLM(str(path), **STREAM)
    runner = llm.engine.core.runner
    model = runner.model
    cache = runner.kv_cache  # [layers, K/V, kv heads, blocks, block_size, head_dim]
    layers, _, heads, _, size, dim = cache.shape
    raw = torch.randn(layers, heads, 2, size, dim)
    positions = torch.arange(100, 100 + 2 * size)

    def rotated(at: torch.Tensor) -> torch.Tensor:
        """Each layer's keys turned by its own rotary embedding (Gemma 3's local layers)."""
        rotations = [rotary(at) for rotary in model.rotaries]
        keys = raw.permute(2, 3, 0, 1, 4).reshape(-1, layers, heads, dim)
        out = torch.stack([apply_rotary(keys[:, i], rotations[layer.uses_local_rotary])
                           for i, layer in enumerate(model.layers)], dim=1)
        return out.reshape(2, size, layers, heads, dim).permute(2, 3, 0, 1, 4)

    cache[:, 0, :, 5:7] = rotated(positions)
    runner._shift_keys([5, 6], 37)
    torch.testing.assert_close(cache[:, 0, :, 5:7], rotated(positions - 37), atol=1e-5,
                               rtol=1e-5)


def test_a_window_that_never_slides_matches_transformers(llama_dir):
    assert_unslid_window_matches_transformers(llama_dir)


def assert_unslid_window_matches_transformers(path: Path) -> None:
    prompts = random_prompts([7, 40], seed=8)
    llm = LLM(str(path), enable_prefix_caching=False, streaming_window=8)
    assert run_greedy(llm, prompts) == [hf_greedy(path, tuple(p), MAX_TOKENS)
                                        for p in prompts]


@pytest.mark.parametrize("budget", [1, 32])
def test_streams_past_max_model_len_in_constant_blocks(llama_dir, budget):
    assert_streams_in_constant_blocks(llama_dir, budget)


def assert_streams_in_constant_blocks(path: Path, budget: int, num_tokens: int = 300) -> None:
    """Past max_model_len (128), with the same output whatever the step budget."""
    llm = LLM(str(path), max_num_batched_tokens=budget, **STREAM)
    prompts = random_prompts([3, 70], seed=9)
    outputs = run_greedy(llm, prompts, num_tokens)
    assert [len(o) for o in outputs] == [num_tokens, num_tokens]
    stats = llm.get_stats()
    assert stats.kv_blocks_peak <= 2 * (1 + 4)  # a sink block and four window blocks each
    reference = LLM(str(path), **STREAM)
    assert run_greedy(reference, prompts, num_tokens) == outputs


def test_a_stream_is_cut_where_it_would_be_alone(llama_dir):
    """A prompt longer than the sinks and the window slides while it is prefilled, and the
    keys each of its queries sees depend on where its chunk starts: the other prompts that
    share the steps' budget must not move those places. Blocks of 4 tokens keep the window
    (4 + 24 tokens) short enough for that to change the output."""
    options = dict(enable_prefix_caching=False, streaming_window=6, attention_sinks=4,
                   block_size=4, max_num_batched_tokens=16, max_num_seqs=2)
    prompts = random_prompts([10, 68], seed=11)  # the first leaves 6 tokens of budget
    together = run_greedy(LLM(str(llama_dir), **options), prompts, 40)
    alone = run_greedy(LLM(str(llama_dir), **options), prompts[1:], 40)
    assert together[1] == alone[0]


def test_a_swapped_stream_continues_exactly(llama_dir):
    prompts = random_prompts([3, 70, 20], seed=10)
    alone = run_greedy(LLM(str(llama_dir), **STREAM), prompts, 150)
    crowded = LLM(str(llama_dir), preemption_mode="swap",
                  kv_cache_memory=kv_bytes_for_blocks(llama_dir, 11), **STREAM)
    assert run_greedy(crowded, prompts, 150) == alone
    assert crowded.engine.core.scheduler.num_swapped_preemptions > 0
