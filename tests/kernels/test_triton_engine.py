"""The whole engine on the Triton attention backend, against transformers: on CUDA as it
runs there, and on the CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve import LLM  # noqa: E402
from kvserve.attention.triton.backend import TritonPagedAttention  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402
from tests.models.test_hf_equivalence import MAX_TOKENS, hf_greedy, run_greedy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_everywhere(monkeypatch):
    """The runner takes the Triton backend on any device."""
    monkeypatch.setattr("kvserve.worker.model_runner.get_attention_backend",
                        lambda device, head_dim: TritonPagedAttention(num_programs=8))


@pytest.mark.parametrize("arch,budget", [("llama", 16), ("qwen3", 2048), ("mistral", 48)])
def test_greedy_matches_transformers_on_triton_attention(model_dirs, triton_everywhere, arch,
                                                          budget):
    """Chunks after cached context, decodes beside chunks, a sliding window (Mistral), and a
    prefix-cache hit on the second run of the same prompts."""
    path = model_dirs[arch]
    llm = LLM(str(path), device=DEVICE, dtype="float32", max_num_batched_tokens=budget)
    assert isinstance(llm.engine.core.runner.model.layers[0].self_attn.backend,
                      TritonPagedAttention)
    prompts = random_prompts([5, 40, 97], seed=4)
    expected = [hf_greedy(path, tuple(p), MAX_TOKENS) for p in prompts]
    assert run_greedy(llm, prompts) == expected
    assert run_greedy(llm, prompts) == expected
    assert llm.get_stats().prefix_cache_hits > 0
