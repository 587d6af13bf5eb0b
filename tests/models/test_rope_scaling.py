"""Rotary embeddings beyond the plain one, equal to transformers in float32: YaRN (whose
attention factor scales cos and sin) and Phi-3's checkpoints (q/k/v and gate/up fused in the
files, three quarters of each head rotated, LongRoPE's short and long factors, a sliding
window), through chunked prefill, tensor parallelism, LoRA adapters, quantized files and
attention sinks' key shifts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import ModelConfig
from kvserve.quantization.quantize import quantize_model
from kvserve.tools.make_lora import make_lora
from tests.conftest import PHI3_ORIGINAL_CONTEXT, SLIDING_WINDOW, random_prompts
from tests.models.test_hf_equivalence import (
    MAX_TOKENS,
    assert_like_hf_greedy,
    hf_greedy,
    run_greedy,
)
from tests.models.test_lora import merged_greedy
from tests.models.test_quantized import dequantized_copy
from tests.models.test_streaming import assert_shifts_keys_exactly
from tests.models.test_tensor_parallel import greedy

# With MAX_TOKENS, these fit Phi-3's original context, those go past it from the prompt on.
SHORT_PROMPTS = [1, 7, 33, 120, 230]
LONG_PROMPTS = [260, 300, 500]


@pytest.mark.parametrize("budget", [2048, 48])
@pytest.mark.parametrize("variant", ["llama-yarn", "qwen3-yarn"])
def test_yarn_matches_transformers(rope_dirs, variant, budget):
    path = rope_dirs[variant]
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.max_positions == 2048 > cfg.max_position_embeddings  # 256 positions x 8
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(0.1 * 2.0794 + 1, abs=1e-4)
    llm = LLM(str(path), max_num_batched_tokens=budget)
    assert llm.engine.config.scheduler.max_model_len == 2048
    prompts = random_prompts([3, 150, 300], seed=budget)
    for prompt, tokens in zip(prompts, run_greedy(llm, prompts), strict=True):
        assert_like_hf_greedy(path, prompt, tokens)


@pytest.mark.parametrize("context", ["short", "long"])
def test_phi3_matches_transformers(rope_dirs, context):
    """Where max_model_len fits the original context, LongRoPE's short factors, as
    transformers takes them for a sequence that fits it; beyond it, the long factors at
    every position, as transformers takes them for a prompt longer than it."""
    path = rope_dirs["phi3"]
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.rotary_dim, cfg.head_dim, cfg.sliding_window) == (12, 16, SLIDING_WINDOW)
    assert cfg.rope_scaling["original_max_position_embeddings"] == PHI3_ORIGINAL_CONTEXT
    short = context == "short"
    llm = LLM(str(path), max_num_batched_tokens=64,
              max_model_len=PHI3_ORIGINAL_CONTEXT if short else None)
    prompts = random_prompts(SHORT_PROMPTS if short else LONG_PROMPTS, seed=2)
    for prompt, tokens in zip(prompts, run_greedy(llm, prompts), strict=True):
        assert_like_hf_greedy(path, prompt, tokens)


def test_phi3_fused_adapters_match_the_merged_model_on_one_rank_and_two(rope_dirs, tmp_path):
    """A PEFT adapter of Phi-3's fused qkv_proj and gate_up_proj: B's rows split like the
    weights', on one rank and across two."""
    path = rope_dirs["phi3"]
    pairs = make_lora(path, tmp_path / "a", rank=4, alpha=8.0, seed=1, std=0.2)
    assert {name.rsplit(".", 1)[1] for name in pairs} == {"qkv_proj", "o_proj",
                                                           "gate_up_proj", "down_proj"}
    prompts = random_prompts([5, 40, 17], seed=3)
    llm = LLM(str(path), lora_modules={"a": str(tmp_path / "a")},
              max_model_len=PHI3_ORIGINAL_CONTEXT)
    batch = [{"prompt_token_ids": p, "lora_name": "a"} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert got == merged_greedy(path, pairs, 8.0 / 4, prompts)
    adapters = ("a", None)
    one = greedy(path, adapters, lora_modules={"a": str(tmp_path / "a")})
    assert greedy(path, adapters, lora_modules={"a": str(tmp_path / "a")},
                  tensor_parallel_size=2) == one


def test_a_quantized_phi3_checkpoint_serves_like_its_dequantized_weights(rope_dirs, tmp_path,
                                                                        monkeypatch):
    """GPTQ quantizes the fused layers whole; the loader splits their packed rows."""
    monkeypatch.setenv("KVSERVE_QUANTIZED_KERNEL", "dequantized")
    out = quantize_model(rope_dirs["phi3"], tmp_path / "q", "gptq", 4, group_size=32,
                         act_order=False, num_samples=8, seq_len=64)
    reference = dequantized_copy(out, tmp_path / "dequantized")
    prompts = random_prompts([6, 70], seed=8)
    llm = LLM(str(out), max_num_batched_tokens=32, max_model_len=PHI3_ORIGINAL_CONTEXT)
    assert run_greedy(llm, prompts) == [hf_greedy(reference, tuple(p), MAX_TOKENS)
                                        for p in prompts]


@pytest.mark.parametrize("variant", ["llama-yarn", "phi3"])
def test_shifted_keys_keep_the_attention_factor_once(rope_dirs, variant):
    """Attention sinks turn cached keys back by whole rotations: a key scaled by YaRN's or
    LongRoPE's attention factor keeps that factor, not its square."""
    assert_shifts_keys_exactly(Path(rope_dirs[variant]))
