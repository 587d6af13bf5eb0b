"""Layouts beyond the plain Llama one, equal to transformers in float32: YaRN (whose
attention factor scales cos and sin), Phi-3's checkpoints (q/k/v and gate/up fused in the
files, three quarters of each head rotated, LongRoPE's short and long factors, a sliding
window) and Gemma 3's (norms around attention and the MLP, GELU, scaled embeddings, local
layers with a window and a rotary embedding of their own beside global ones), through
chunked prefill, tensor parallelism, LoRA adapters, quantized files, and attention sinks' and
CacheBlend's key turns."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.config import ModelConfig
from kvserve.quantization.quantize import quantize_model
from kvserve.tools.make_lora import make_lora
from kvserve.tools.make_model import make_model
from tests.conftest import PHI3_ORIGINAL_CONTEXT, SLIDING_WINDOW, random_prompts
from tests.models.test_blend import (
    assert_copied_keys_are_moved,
    assert_full_recompute_matches_transformers,
)
from tests.models.test_hf_equivalence import (
    MAX_TOKENS,
    assert_like_hf_greedy,
    assert_prompt_logprobs_like_hf,
    hf_greedy,
    run_greedy,
)
from tests.models.test_lora import merged_greedy
from tests.models.test_quantized import dequantized_copy
from tests.models.test_streaming import (
    assert_shifts_keys_exactly,
    assert_streams_in_constant_blocks,
    assert_unslid_window_matches_transformers,
)
from tests.models.test_tensor_parallel import greedy

# With MAX_TOKENS, these fit Phi-3's original context, those go past it from the prompt on.
SHORT_PROMPTS = [1, 7, 33, 120, 230]
LONG_PROMPTS = [260, 300, 500]


@pytest.mark.parametrize("budget", [2048, 48])
@pytest.mark.parametrize("variant", ["llama-yarn", "qwen3-yarn"])
def test_yarn_matches_transformers(variant_dirs, variant, budget):
    path = variant_dirs[variant]
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.max_positions == 2048 > cfg.max_position_embeddings  # 256 positions x 8
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(0.1 * 2.0794 + 1, abs=1e-4)
    llm = LLM(str(path), max_num_batched_tokens=budget)
    assert llm.engine.config.scheduler.max_model_len == 2048
    prompts = random_prompts([3, 150, 300], seed=budget)
    for prompt, tokens in zip(prompts, run_greedy(llm, prompts), strict=True):
        assert_like_hf_greedy(path, prompt, tokens)


@pytest.mark.parametrize("context", ["short", "long"])
def test_phi3_matches_transformers(variant_dirs, context):
    """Where max_model_len fits the original context, LongRoPE's short factors, as
    transformers takes them for a sequence that fits it; beyond it, the long factors at
    every position, as transformers takes them for a prompt longer than it."""
    path = variant_dirs["phi3"]
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.rotary_dim, cfg.head_dim, cfg.sliding_window) == (12, 16, SLIDING_WINDOW)
    assert cfg.rope_scaling["original_max_position_embeddings"] == PHI3_ORIGINAL_CONTEXT
    short = context == "short"
    llm = LLM(str(path), max_num_batched_tokens=64,
              max_model_len=PHI3_ORIGINAL_CONTEXT if short else None)
    prompts = random_prompts(SHORT_PROMPTS if short else LONG_PROMPTS, seed=2)
    for prompt, tokens in zip(prompts, run_greedy(llm, prompts), strict=True):
        assert_like_hf_greedy(path, prompt, tokens)


def test_phi3_fused_adapters_match_the_merged_model_on_one_rank_and_two(variant_dirs, tmp_path):
    """A PEFT adapter of Phi-3's fused qkv_proj and gate_up_proj: B's rows split like the
    weights', on one rank and across two."""
    path = variant_dirs["phi3"]
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


def test_a_quantized_phi3_checkpoint_serves_like_its_dequantized_weights(variant_dirs, tmp_path,
                                                                        monkeypatch):
    """GPTQ quantizes the fused layers whole; the loader splits their packed rows."""
    monkeypatch.setenv("KVSERVE_QUANTIZED_KERNEL", "dequantized")
    out = quantize_model(variant_dirs["phi3"], tmp_path / "q", "gptq", 4, group_size=32,
                         act_order=False, num_samples=8, seq_len=64)
    reference = dequantized_copy(out, tmp_path / "dequantized")
    prompts = random_prompts([6, 70], seed=8)
    llm = LLM(str(out), max_num_batched_tokens=32, max_model_len=PHI3_ORIGINAL_CONTEXT)
    assert run_greedy(llm, prompts) == [hf_greedy(reference, tuple(p), MAX_TOKENS)
                                        for p in prompts]


@pytest.mark.parametrize("variant", ["llama-yarn", "phi3"])
def test_shifted_keys_keep_the_attention_factor_once(variant_dirs, variant):
    """Attention sinks turn cached keys back by whole rotations: a key scaled by YaRN's or
    LongRoPE's attention factor keeps that factor, not its square."""
    assert_shifts_keys_exactly(Path(variant_dirs[variant]))


@pytest.mark.parametrize("budget", [2048, 48])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_matches_transformers(variant_dirs, arch, budget):
    """Greedy tokens, and every prompt token's logprob across the local layer's window;
    Gemma 2's softcapped attention scores and logits too."""
    path = variant_dirs[arch]
    cfg = ModelConfig.from_pretrained(path)
    gemma3 = arch == "gemma3"
    assert (cfg.full_attention_layers, cfg.sliding_window, cfg.local_rope_theta) == (
        (1,), SLIDING_WINDOW, 10000.0 if gemma3 else None)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (
        (None, None) if gemma3 else (50.0, 30.0))
    llm = LLM(str(path), max_num_batched_tokens=budget)
    prompts = random_prompts([1, 7, 33, 120, 300], seed=budget)
    for prompt, tokens in zip(prompts, run_greedy(llm, prompts), strict=True):
        assert_like_hf_greedy(path, prompt, tokens)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[3:]], params,
                           use_tqdm=False)
    assert_prompt_logprobs_like_hf(path, prompts[3:], outputs)


def test_gemma3_on_two_ranks_matches_one(variant_dirs):
    path = variant_dirs["gemma3"]
    assert greedy(path, tensor_parallel_size=2) == greedy(path)


def test_gemma3_streams_with_each_layers_keys_shifted(variant_dirs):
    """Attention sinks turn each layer's cached keys back by that layer's rotary embedding
    (the local one or the global one)."""
    path = Path(variant_dirs["gemma3"])
    assert_shifts_keys_exactly(path)
    assert_unslid_window_matches_transformers(path)
    assert_streams_in_constant_blocks(path, budget=1, num_tokens=160)


def test_gemma3_blends_chunks_with_each_layers_keys_turned(tmp_path):
    """CacheBlend moves each layer's copied keys by that layer's rotary embedding, and its
    recompute from the second layer on carries both rotations. Three layers: two local, so
    that the second layer, where the recompute starts, is local."""
    path = make_model("tiny", tmp_path / "gemma3", arch="gemma3", num_layers=3,
                      sliding_window=SLIDING_WINDOW)
    assert ModelConfig.from_pretrained(path).full_attention_layers == (2,)
    assert_copied_keys_are_moved(path)
    assert_copied_keys_are_moved(path, layer=1, ratio=0.5)
    assert_full_recompute_matches_transformers(path)


def gemma3_variant(source: Path, folder: Path, **changes: object) -> Path:
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    for key in [k for k, v in changes.items() if v is None]:
        config.pop(key, None)
        del changes[key]
    (folder / "config.json").write_text(json.dumps(config | changes))
    return folder


def test_gemma3_reads_transformers_5_rope_parameters(variant_dirs, tmp_path):
    """transformers 5 writes the local and global layers' rotary parameters nested."""
    path = gemma3_variant(variant_dirs["gemma3"], tmp_path / "nested", rope_theta=None,
                          rope_local_base_freq=None, rope_scaling=None, rope_parameters={
                              "full_attention": {"rope_type": "default", "rope_theta": 5e5},
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": 2e4}})
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (5e5, 2e4, None)


def test_gemma3_scales_its_global_layers_only(variant_dirs, tmp_path):
    """Gemma 3 4B and up stretch the global layers' rotary embedding 8x (linear)."""
    path = gemma3_variant(variant_dirs["gemma3"], tmp_path / "linear",
                          rope_scaling={"rope_type": "linear", "factor": 8.0})
    llm = LLM(str(path))
    model = llm.engine.core.runner.model
    assert model.rotary.freqs_cis[7, 1] != model.local_rotary.freqs_cis[7, 1]
    prompts = random_prompts([150, 300], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_prompt_logprobs_like_hf(path, prompts, outputs)


def gemma3_multimodal(text_model: Path, folder: Path) -> Path:
    """A Gemma3ForConditionalGeneration checkpoint (a tiny vision tower and projector) whose
    language model is `text_model`'s, saved by transformers."""
    from transformers import (
        AutoModelForCausalLM,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        SiglipVisionConfig,
    )

    text = AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.config.to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, eos_token_id=2, boi_token_index=2997,
                          eoi_token_index=2998, image_token_index=2999)
    model = Gemma3ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(text_model / name, folder / name)
    return folder


def test_gemma3_multimodal_checkpoints_serve_their_language_model(variant_dirs, tmp_path):
    """Gemma 3 4B and up: the text config's defaults from transformers, the language
    model's tensors under either naming, the vision tower's left out."""
    text_path = variant_dirs["gemma3"]
    path = gemma3_multimodal(text_path, tmp_path / "multimodal")
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.multimodal and cfg == replace(ModelConfig.from_pretrained(text_path),
                                             path=str(path), multimodal=True)
    prompts = random_prompts([5, 100, 300], seed=2)
    expected = run_greedy(LLM(str(text_path)), prompts)
    assert run_greedy(LLM(str(path)), prompts) == expected
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert_like_hf_greedy(path, prompt, tokens)  # Gemma3ForConditionalGeneration's
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {re.sub(r"^language_model\.model\.|^(vision_tower|multi_modal_projector)\.",
                      lambda m: f"model.{m[1] or 'language_model'}.", name): tensor
               for name, tensor in tensors.items()}
    assert any(name.startswith("model.vision_tower.") for name in renamed)
    save_file(renamed, str(path / "model.safetensors"))
    assert run_greedy(LLM(str(path)), prompts) == expected
    # An adapter of the language model, named as PEFT names it in the multimodal model
    make_lora(text_path, tmp_path / "plain", rank=4, seed=1, std=0.2)
    shutil.copytree(tmp_path / "plain", tmp_path / "named")
    adapter = load_file(str(tmp_path / "plain" / "adapter_model.safetensors"))
    save_file({name.replace("base_model.model.model.",
                            "base_model.model.model.language_model."): tensor
               for name, tensor in adapter.items()},
              str(tmp_path / "named" / "adapter_model.safetensors"))
    batch = [{"prompt_token_ids": p, "lora_name": "a"} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = [[o.outputs[0].token_ids for o in LLM(str(model), lora_modules={
        "a": str(tmp_path / adapter_dir)}).generate(batch, params, use_tqdm=False)]
        for model, adapter_dir in ((text_path, "plain"), (path, "named"))]
    assert outputs[0] == outputs[1] != expected
