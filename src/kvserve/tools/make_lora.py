"""Writes a LoRA adapter for a checkpoint in the `peft` library's format, with random A and B
(B nonzero, unlike a fresh PEFT adapter, so that it changes the output): what tests and
`kvserve bench lora` serve, as `make_model` makes the checkpoints themselves."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve.config import ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The projections of checkpoints that fuse q/k/v and gate/up (Phi-3's)
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")


def make_lora(model: str | Path, output: str | Path, rank: int = 16, alpha: float = 32.0,
              targets: tuple[str, ...] | None = None, seed: int = 0, std: float = 0.02
              ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Writes the adapter folder; returns {HF module name: (A [r, in], B [out, r])}.
    `targets` defaults to every projection the checkpoint names."""
    cfg = ModelConfig.from_pretrained(model, "float32")  # shapes only
    fused = cfg.architecture == "Phi3ForCausalLM"
    targets = targets or (FUSED_TARGETS if fused else TARGETS)
    h, mlp = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"o_proj": (q, h), "down_proj": (mlp, h)} | (
        {"qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * mlp)} if fused else
        {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "gate_proj": (h, mlp),
         "up_proj": (h, mlp)})
    unknown = set(targets) - set(shapes)
    if unknown:
        raise ValueError(f"targets must be among {', '.join(shapes)} for this checkpoint, "
                         f"got {sorted(unknown)}")
    narrowest = min(min(shapes[t]) for t in targets)
    if rank > narrowest:  # a low-rank update no lower than the layer itself
        raise ValueError(f"rank must be <= {narrowest}, the narrowest targeted layer's smaller "
                         f"dimension, got {rank}")
    gen = torch.Generator().manual_seed(seed)
    pairs, tensors = {}, {}
    for layer in range(cfg.num_layers):
        for target in targets:
            block = "self_attn" if target in _ATTENTION else "mlp"
            name = f"model.layers.{layer}.{block}.{target}"
            fan_in, fan_out = shapes[target]
            a = torch.randn(rank, fan_in, generator=gen) * std
            b = torch.randn(fan_out, rank, generator=gen) * std
            pairs[name] = (a, b)
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
        "bias": "none", "base_model_name_or_path": str(model)}, indent=2))
    return pairs
