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


def make_lora(model: str | Path, output: str | Path, rank: int = 16, alpha: float = 32.0,
              targets: tuple[str, ...] = TARGETS, seed: int = 0, std: float = 0.02
              ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Writes the adapter folder; returns {HF module name: (A [r, in], B [out, r])}."""
    cfg = ModelConfig.from_pretrained(model, "float32")  # shapes only
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (cfg.hidden_size, q), "k_proj": (cfg.hidden_size, kv),
              "v_proj": (cfg.hidden_size, kv), "o_proj": (q, cfg.hidden_size),
              "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
              "up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    unknown = set(targets) - set(shapes)
    if unknown:
        raise ValueError(f"targets must be among {', '.join(TARGETS)}, got {sorted(unknown)}")
    gen = torch.Generator().manual_seed(seed)
    pairs, tensors = {}, {}
    for layer in range(cfg.num_layers):
        for target in targets:
            block = "self_attn" if target in TARGETS[:4] else "mlp"
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
