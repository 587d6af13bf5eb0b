"""`kvserve make-model`: random-weight checkpoints in the exact Hugging Face folder format.

The files (config.json, generation_config.json, safetensors, tokenizer.json,
tokenizer_config.json) load unchanged in `transformers`, which is how kvserve is tested.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.registry import ARCHITECTURES
from kvserve.tools.checkpoint_files import write_json, write_weights
from kvserve.tools.tokenizer import tokenizer_config, train_tokenizer
from kvserve.tools.train import train


@dataclass(frozen=True)
class Preset:
    arch: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = True
    head_dim: int | None = None
    sliding_window: int | None = None
    init_std: float = 0.02
    dtype: str = "float32"
    # Mixture-of-experts arches: their experts (defaults from the dense shape where 0; see
    # `_with_experts`), and Qwen2-MoE's shared expert.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # Phi-3's: the rotated share of each head, and LongRoPE's pretraining context (0: none).
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int = 0


PRESETS = {
    "tiny": Preset("llama", 64, 128, 2, 4, 2, 3000, 1024, init_std=0.08),
    # Small enough to train in minutes on 2 CPU cores (`--train-steps`), with linear layers
    # whose inputs split into 128-wide quantization groups.
    "small": Preset("llama", 256, 768, 4, 4, 2, 4096, 2048),
    # A target for `small` as a speculative draft: the same tokenizer, 25x the weights.
    "medium": Preset("llama", 768, 2048, 12, 12, 4, 4096, 2048),
    "smollm2-135m": Preset("llama", 576, 1536, 30, 9, 3, 49152, 8192, rope_theta=100000.0),
    "qwen2.5-0.5b": Preset("qwen2", 896, 4864, 24, 14, 2, 151936, 32768, rope_theta=1e6),
    # Qwen3-0.6B's shapes: the model of nano-vllm's benchmark.
    "qwen3-0.6b": Preset("qwen3", 1024, 3072, 28, 16, 8, 151936, 40960, rope_theta=1e6,
                         head_dim=128, dtype="bfloat16"),
    # Llama-3.2-1B's shapes: a model people run on laptop CPUs, big enough for weight bytes to
    # dominate a decode step there.
    "llama3.2-1b": Preset("llama", 2048, 8192, 16, 32, 8, 128256, 131072, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192},
                          dtype="bfloat16"),
    "llama3-8b": Preset("llama", 4096, 14336, 32, 32, 8, 128256, 131072, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192},
                        tie_word_embeddings=False, dtype="bfloat16"),
    # Phi-4-mini's shapes: three quarters of each head rotated, LongRoPE from 4k to 128k.
    "phi4-mini": Preset("phi3", 3072, 8192, 32, 24, 8, 200064, 131072, rope_theta=10000.0,
                        partial_rotary_factor=0.75, original_max_position_embeddings=4096,
                        dtype="bfloat16"),
    # Gemma-3-1B's shapes: 5 local layers (512-token window) to 1 global, 256-wide heads.
    "gemma3-1b": Preset("gemma3", 1152, 6912, 26, 4, 1, 262144, 32768, head_dim=256,
                        sliding_window=512, dtype="bfloat16"),
    # Qwen3-30B-A3B's shapes: 128 experts, 8 a token, 3.3B of 30.5B weights active; the
    # mixture-of-experts model people run on laptops (61 GB in bfloat16).
    "qwen3-30b-a3b": Preset("qwen3_moe", 2048, 6144, 48, 32, 4, 151936, 40960, rope_theta=1e6,
                            tie_word_embeddings=False, head_dim=128, dtype="bfloat16",
                            num_experts=128, experts_per_token=8, moe_intermediate_size=768),
    # The same design at a size a 2-core CPU serves: 64 experts of 8 a token, 0.5B weights of
    # which a token multiplies through 0.1B (its experts' share: 113 MB in bfloat16).
    "qwen3-moe-small": Preset("qwen3_moe", 768, 2048, 12, 12, 4, 32000, 8192,
                              rope_theta=1e6, head_dim=64, dtype="bfloat16", num_experts=64,
                              experts_per_token=8, moe_intermediate_size=256),
}

ARCHES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
MOE_ARCHES = tuple(arch for arch, (name, _) in ARCHES.items() if ARCHITECTURES[name].moe)


def make_model(preset: str, output: str | Path, arch: str | None = None, seed: int = 0,
               dtype: str | None = None, max_shard_bytes: int = 2 << 30,
               sliding_window: int | None = None, train_steps: int = 0,
               distill_from: str | Path | None = None, num_layers: int | None = None,
               progress: bool = False) -> Path:
    """Writes a checkpoint folder for `preset` (optionally as another architecture, or with
    `num_layers` decoder layers) and returns its path; with `train_steps`, trains it that
    many steps on local text first, or on the continuations of the checkpoint
    `distill_from` (`train.py`), and writes `training.json` beside it. The same arguments
    always give the same files (on a machine with the same number of threads, when
    training)."""
    if train_steps < 0:
        raise ValueError(f"train_steps must be >= 0, got {train_steps}")
    if distill_from is not None and not train_steps:
        raise ValueError("distill_from needs train_steps > 0")
    if distill_from is not None and not (Path(distill_from) / "config.json").is_file():
        raise ValueError(f"distill_from must be a checkpoint folder, got {str(distill_from)!r}"
                         " (no config.json)")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    spec = PRESETS[preset]
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        spec = replace(spec, num_layers=num_layers)
    if arch is not None:
        if arch not in ARCHES:
            raise ValueError(f"arch must be one of {sorted(ARCHES)}, got {arch!r}")
        spec = replace(spec, arch=arch)
    if spec.arch in ("qwen3", "qwen3_moe", "gemma2", "gemma3") and spec.head_dim is None:
        spec = replace(spec, head_dim=2 * spec.hidden_size // spec.num_heads)
    if spec.arch in MOE_ARCHES:
        spec = _with_experts(spec)
    if spec.arch in ("mistral", "gemma2", "gemma3"):
        spec = replace(spec, sliding_window=sliding_window or spec.sliding_window
                       or spec.max_position_embeddings // 8)
    if spec.arch == "gemma3":  # its global layers' rotary base; the local ones' is 10,000
        spec = replace(spec, rope_theta=1e6)
    elif spec.arch in ("mixtral", "phi3"):  # these attend without a window, unless given one
        spec = replace(spec, sliding_window=sliding_window)
    if spec.arch == "phi3":
        spec = _with_longrope(spec)
    if dtype is not None:
        spec = replace(spec, dtype=dtype)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", hf_config(spec))
    write_json(out / "generation_config.json", {"eos_token_id": 2, "pad_token_id": 0})
    (out / "tokenizer.json").write_text(train_tokenizer(spec.vocab_size))
    write_json(out / "tokenizer_config.json", tokenizer_config(spec.max_position_embeddings))
    dtype_of = getattr(torch, spec.dtype)
    if not train_steps:
        write_weights(out, _tensors(spec, seed), dtype_of, max_shard_bytes, progress)
        return out
    write_weights(out, _tensors(spec, seed), torch.float32, max_shard_bytes, False)
    # Wider models take proportionally smaller steps (as muP scales them), so that every
    # preset trains as stably as `small` does at 3e-3.
    learning_rate = 3e-3 * min(1.0, 256 / spec.hidden_size)
    trained, report = train(out, train_steps, seed, learning_rate=learning_rate,
                            teacher=None if distill_from is None else Path(distill_from),
                            progress=progress)
    write_weights(out, iter(trained.items()), dtype_of, max_shard_bytes, progress)
    write_json(out / "training.json", report.as_dict())
    return out


def _with_experts(spec: Preset) -> Preset:
    """A dense preset made a mixture of experts: 8 experts, 2 a token, each as wide as the
    dense MLP (Mixtral) or half as wide (Qwen, whose shared expert is as wide as it)."""
    spec = replace(spec, num_experts=spec.num_experts or 8,
                   experts_per_token=spec.experts_per_token or 2,
                   moe_intermediate_size=spec.moe_intermediate_size or (
                       spec.intermediate_size if spec.arch == "mixtral"
                       else spec.intermediate_size // 2))
    if spec.arch == "qwen2_moe" and not spec.shared_expert_intermediate_size:
        spec = replace(spec, shared_expert_intermediate_size=spec.intermediate_size)
    return spec


def _with_longrope(spec: Preset) -> Preset:
    """Phi-3.5's and Phi-4-mini's rotary embedding on a preset: three quarters of each head
    rotated (unless the preset says), LongRoPE from a quarter of the context (unless the
    preset says), with made-up factors that grow with the frequencies' wavelengths."""
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    partial = spec.partial_rotary_factor if spec.partial_rotary_factor < 1 else 0.75
    original = spec.original_max_position_embeddings or spec.max_position_embeddings // 4
    pairs = int(head_dim * partial) // 2
    stretch = spec.max_position_embeddings / original
    ramp = [i / max(pairs - 1, 1) for i in range(pairs)]
    return replace(spec, partial_rotary_factor=partial, original_max_position_embeddings=original,
                   rope_scaling={"rope_type": "longrope",
                                 "short_factor": [1.0 + 0.5 * r for r in ramp],
                                 "long_factor": [1.0 + (stretch - 1) * r * r for r in ramp]})


def hf_config(spec: Preset) -> dict[str, Any]:
    architecture, model_type = ARCHES[spec.arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5 if spec.arch in ("llama", "mistral") else 1e-6,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "initializer_range": spec.init_std,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": spec.dtype,
        "use_cache": True,
    }
    if spec.arch in ("llama", "qwen3", "qwen3_moe"):
        config.update(attention_bias=False, mlp_bias=False)
    if spec.head_dim is not None:
        config["head_dim"] = spec.head_dim
    if spec.arch in ("mistral", "mixtral", "phi3"):
        config["sliding_window"] = spec.sliding_window
    if spec.arch in ("gemma2", "gemma3"):
        # As Gemma's files have them: every other layer global (Gemma 2), every sixth (Gemma
        # 3, every other of a few); Gemma 2 caps attention scores at 50 and logits at 30.
        gemma2 = spec.arch == "gemma2"
        pattern = 2 if gemma2 else min(6, spec.num_layers)
        config.update(
            hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=spec.head_dim,
            sliding_window=spec.sliding_window,
            layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                         for i in range(spec.num_layers)],
            final_logit_softcapping=30.0 if gemma2 else None,
            attn_logit_softcapping=50.0 if gemma2 else None)
        if not gemma2:
            config["rope_local_base_freq"] = 10000.0
        del config["hidden_act"]
    if spec.arch == "phi3":
        config.update(partial_rotary_factor=spec.partial_rotary_factor,
                      original_max_position_embeddings=spec.original_max_position_embeddings)
    if spec.arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=0)
    if spec.arch == "mixtral":
        config.update(num_local_experts=spec.num_experts,
                      num_experts_per_tok=spec.experts_per_token,
                      intermediate_size=spec.moe_intermediate_size, router_jitter_noise=0.0)
    elif spec.arch in MOE_ARCHES:
        config.update(num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
                      moe_intermediate_size=spec.moe_intermediate_size,
                      norm_topk_prob=spec.arch == "qwen3_moe", decoder_sparse_step=1,
                      mlp_only_layers=[])
        if spec.shared_expert_intermediate_size:
            config["shared_expert_intermediate_size"] = spec.shared_expert_intermediate_size
    return config


def _tensors(spec: Preset, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors in a fixed order, drawn from one seeded generator; Phi-3's with each
    layer's q/k/v and gate/up in one tensor each, as its hub files hold them."""
    tensors = _separate_tensors(spec, seed)
    if spec.arch != "phi3":
        yield from tensors
        return
    fused_of = {part: fused for fused, parts in LlamaForCausalLM.fused_modules.items()
                for part in parts}
    held: dict[str, list[torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, kind = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf not in fused_of:
            yield name, tensor
            continue
        fused = f"{parent}.{fused_of[leaf]}.{kind}"
        held.setdefault(fused, []).append(tensor)
        if len(held[fused]) == len(LlamaForCausalLM.fused_modules[fused_of[leaf]]):
            yield fused, torch.cat(held.pop(fused))


def _separate_tensors(spec: Preset, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors in a fixed order, drawn from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    arch = ARCHITECTURES[ARCHES[spec.arch][0]]
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    h = spec.hidden_size
    # Gemma's files hold norm weights less 1 (its norms multiply by 1 + w).
    norm_one = 0.0 if arch.gemma else 1.0

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * spec.init_std

    yield "model.embed_tokens.weight", normal(spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm_one + normal(h)
        for name, rows in (("q", spec.num_heads), ("k", spec.num_kv_heads),
                           ("v", spec.num_kv_heads)):
            yield p + f"self_attn.{name}_proj.weight", normal(rows * head_dim, h)
            if arch.qkv_bias:
                yield p + f"self_attn.{name}_proj.bias", normal(rows * head_dim)
        if arch.qk_norm:
            yield p + "self_attn.q_norm.weight", norm_one + normal(head_dim)
            yield p + "self_attn.k_norm.weight", norm_one + normal(head_dim)
        yield p + "self_attn.o_proj.weight", normal(h, spec.num_heads * head_dim)
        yield p + "post_attention_layernorm.weight", norm_one + normal(h)
        if arch.gemma:
            yield p + "pre_feedforward_layernorm.weight", normal(h)
            yield p + "post_feedforward_layernorm.weight", normal(h)
        yield from _mlp_tensors(spec, p, normal)
    yield "model.norm.weight", norm_one + normal(h)
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", normal(spec.vocab_size, h)


def _mlp_tensors(spec: Preset, prefix: str, normal: Callable[..., torch.Tensor]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """A layer's MLP, or its router and experts under the names of the arch's hub files."""
    h = spec.hidden_size
    moe = ARCHITECTURES[ARCHES[spec.arch][0]].moe
    if moe is None:
        yield from _gated_mlp(prefix + "mlp.", spec.intermediate_size, h, normal)
        return
    block = prefix + ("block_sparse_moe." if moe == "mixtral" else "mlp.")
    yield block + "gate.weight", normal(spec.num_experts, h)
    for e in range(spec.num_experts):
        expert = f"{block}experts.{e}."
        if moe == "mixtral":
            size = spec.moe_intermediate_size
            yield expert + "w1.weight", normal(size, h)
            yield expert + "w2.weight", normal(h, size)
            yield expert + "w3.weight", normal(size, h)
        else:
            yield from _gated_mlp(expert, spec.moe_intermediate_size, h, normal)
    if spec.shared_expert_intermediate_size:
        yield from _gated_mlp(block + "shared_expert.", spec.shared_expert_intermediate_size, h,
                              normal)
        yield block + "shared_expert_gate.weight", normal(1, h)


def _gated_mlp(prefix: str, size: int, h: int, normal: Callable[..., torch.Tensor]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    yield prefix + "gate_proj.weight", normal(size, h)
    yield prefix + "up_proj.weight", normal(size, h)
    yield prefix + "down_proj.weight", normal(h, size)
