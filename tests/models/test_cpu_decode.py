"""The CPU decode stack (all layers of a decode step in one C++ call) against the eager
forward it replaces: the same kernels in the same order, so the same logprobs to the bit."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cpp_extension import cpu_kernels
from tests.conftest import ARCHES, random_prompts

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels do not build")


def greedy_with_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                 strict=True)] for o in outputs]


def assert_stack_equals_the_eager_forward(path, dtype: str) -> None:
    """Batches of 1 to 5 decodes with contexts across block and sliding-window edges."""
    if not cpu_kernels().gemm_supports(torch.empty(16, 2, dtype=getattr(torch, dtype))):
        pytest.skip(f"no blocked {dtype} GEMM on this CPU, so no decode stack")
    prompts = random_prompts([5, 17, 70, 3, 40], seed=4)
    stacked = LLM(str(path), dtype=dtype, max_num_batched_tokens=48)
    eager = LLM(str(path), dtype=dtype, max_num_batched_tokens=48, enforce_eager=True)
    assert eager.engine.core.runner.cpu_decode is None
    assert stacked.engine.core.runner.cpu_decode is not None
    assert greedy_with_logprobs(stacked, prompts) == greedy_with_logprobs(eager, prompts)
    assert greedy_with_logprobs(stacked, prompts[:1]) == greedy_with_logprobs(eager, prompts[:1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHES)
def test_decode_stack_equals_the_eager_forward(model_dirs, arch, dtype):
    """Qwen3's q/k norms included."""
    assert_stack_equals_the_eager_forward(model_dirs[arch], dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_decode_stack_equals_the_eager_forward(variant_dirs, arch, dtype):
    """Norms around attention and the MLP, GELU, a local layer within the window (with its
    own rotation in Gemma 3) and a global one past it, Gemma 2's softcapped scores."""
    assert_stack_equals_the_eager_forward(variant_dirs[arch], dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_computes_the_same_bits_alone_and_beside_prefills(llama_dir, dtype):
    """Its decodes run in decode-only steps alone and in steps with others' prefill chunks in
    the batch: both go through the same fused decode kernel."""
    target, *others = random_prompts([20, 5, 90, 300, 41], seed=11)
    llm = LLM(str(llama_dir), dtype=dtype, max_num_batched_tokens=64)
    alone = greedy_with_logprobs(llm, [target])[0]
    assert greedy_with_logprobs(llm, others[:2] + [target] + others[2:])[2] == alone
