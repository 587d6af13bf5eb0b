"""Tensor parallelism on CPU: two ranks (gloo) give exactly the single-process greedy tokens
on Llama, Qwen2 (QKV bias) and Qwen3 (q/k norms), across chunked prefill and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.models.test_hf_equivalence import kv_bytes_for_blocks

PROMPTS = random_prompts([5, 40, 150, 17, 90], seed=41)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def greedy(path: Path, **options: object) -> list[list[int]]:
    llm = LLM(str(path), max_num_batched_tokens=64, **options)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_match_one(model_dirs: dict[str, Path], arch: str) -> None:
    path = model_dirs[arch]
    # A pool of 24 blocks cannot hold all five requests at once: some are preempted.
    small_pool = kv_bytes_for_blocks(path, 24)
    assert (greedy(path, tensor_parallel_size=2, kv_cache_memory=small_pool // 2)
            == greedy(path, kv_cache_memory=small_pool))


def test_heads_that_do_not_divide_are_refused(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size .3. must divide"):
        LLM(str(model_dirs["llama"]), tensor_parallel_size=3)
