"""LoRA adapters as the `peft` library saves them: `adapter_config.json` and
`adapter_model.safetensors`, with `lora_A` ([r, in]) and `lora_B` ([out, r]) per targeted
projection. Loading maps each pair onto the engine's linear layers, fused ones included (a
QKV layer whose q, k and v are targeted gets A = [A_q A_k A_v] and a block-diagonal B; one
whose fused checkpoint layer is targeted, as Phi-3's, gets its A once a part), with
the scale `lora_alpha / r` (or `/ sqrt(r)` for rsLoRA) folded into B. Among tensor-parallel
ranks, each keeps the part its layer shard needs: B's outputs of a column-parallel layer, A's
inputs of a row-parallel one (whose partial products the ranks' sum adds up).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvserve.errors import CheckpointError
from kvserve.layers.linear import Linear
from kvserve.models.hub import resolve_model
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import checkpoint_target, fused_parts, language_model_name
from kvserve.models.moe import SparseMoeBlock
from kvserve.worker.tensor_parallel import rank_slice

_PREFIX = "base_model.model."
_PEFT_DEFAULT_ALPHA = 8  # LoraConfig's, for a config that leaves it out


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    # Our linear layer's name -> (A [in, R], B [R, out] scaled), R = rank x targeted shards.
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter(name: str, path: str | Path, model: LlamaForCausalLM) -> LoRAAdapter:
    """Reads a PEFT LoRA folder (or a Hugging Face Hub adapter, by its id) for `model`; a
    CheckpointError names what does not fit."""
    folder = Path(resolve_model(str(path), field=f"lora {name!r}"))
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise CheckpointError(f"lora {name!r}: no adapter_config.json in {str(folder)!r}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise CheckpointError(f"lora {name!r}: cannot read adapter_config.json: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"lora {name!r}: adapter_config.json must hold a JSON object")
    rank, alpha = config.get("r"), config.get("lora_alpha", _PEFT_DEFAULT_ALPHA)
    if not _is_number(rank) or rank != int(rank) or rank < 1:
        raise CheckpointError(f"lora {name!r}: adapter_config.json r must be an integer >= 1, "
                              f"got {rank!r}")
    if not _is_number(alpha) or not math.isfinite(alpha):
        raise CheckpointError(f"lora {name!r}: adapter_config.json lora_alpha must be a "
                              f"number, got {alpha!r}")
    rank = int(rank)
    unsupported = {"use_dora": bool(config.get("use_dora")),
                   "bias": config.get("bias", "none") != "none",
                   "modules_to_save": bool(config.get("modules_to_save")),
                   "fan_in_fan_out": bool(config.get("fan_in_fan_out"))}
    for key, present in unsupported.items():
        if present:
            raise CheckpointError(f"lora {name!r}: adapter_config.json {key} "
                                  f"{config[key]!r} is not supported")
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    try:
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"lora {name!r}: cannot read adapter_model.safetensors: {e}"
                              ) from None
    modules = dict(model.named_modules())
    routed = {f"{block}.{sub}" for block, module in modules.items()
              if isinstance(module, SparseMoeBlock) for sub, _ in module.named_modules() if sub}
    shards: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for key, hf_name, a, b in _lora_pairs(tensors, model):
        target = checkpoint_target(hf_name, model)
        if b is None or target is None or not isinstance(modules.get(target[0]), Linear):
            raise CheckpointError(f"lora {name!r}: tensor {key!r} has no lora_B or targets "
                                  "no linear layer of the model")
        layer, _, shard = target
        linear = modules[layer]
        module = hf_name.removesuffix(".weight")
        if layer in routed:
            raise CheckpointError(f"lora {name!r}: {module}: adapters of a mixture-of-experts "
                                  "layer's router and experts are not supported")
        if not (a.isfinite().all() and b.isfinite().all()):
            raise CheckpointError(f"lora {name!r}: {module}: lora_A or lora_B holds NaN or "
                                  "infinite values")
        b = model.adapt_checkpoint_tensor(hf_name, b.to(linear.weight.dtype) * scale)
        a = a.to(linear.weight.dtype)
        # This rank's part: a column-parallel layer's B outputs, a row-parallel one's A inputs.
        if linear.parallel == "column":
            b = rank_slice(b, 0)
        elif linear.parallel == "row":
            a = rank_slice(a, 1)
        if a.shape != (rank, linear.in_features) or b.shape != (linear.output_sizes[shard], rank):
            raise CheckpointError(f"lora {name!r}: {module}: lora_A {list(a.shape)} and lora_B "
                                  f"{list(b.shape)} do not fit r={rank} and the layer's "
                                  f"[{linear.output_sizes[shard]}, {linear.in_features}]")
        shards.setdefault(layer, {})[shard] = (a, b)
    weights = {}
    for layer, parts in shards.items():
        linear = modules[layer]
        a_cat = torch.cat([parts[s][0] for s in sorted(parts)]).t().contiguous()
        b_full = torch.zeros(a_cat.shape[1], linear.out_features, dtype=a_cat.dtype)
        for i, shard in enumerate(sorted(parts)):
            a, b = parts[shard]
            start = sum(linear.output_sizes[:shard])
            b_full[i * rank:(i + 1) * rank, start:start + b.shape[0]] = b.t()
        weights[layer] = (a_cat, b_full)
    if not weights:
        raise CheckpointError(f"lora {name!r}: adapter_model.safetensors has no lora_A tensor")
    return LoRAAdapter(name, rank, weights)


def _lora_pairs(tensors: dict[str, torch.Tensor], model: LlamaForCausalLM
                ) -> Iterator[tuple[str, str, torch.Tensor, torch.Tensor | None]]:
    """Each lora_A's key, the weight it adapts, A and B (None if missing); a fused target's
    (Phi-3's qkv_proj, gate_up_proj) once a part, with B's rows for that part and all of A."""
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        hf_name = key.removeprefix(_PREFIX).replace(".lora_A", "")
        if model.cfg.multimodal:  # its language model's names (a vision tower's: no target)
            hf_name = language_model_name(hf_name) or hf_name
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        parts = None if b is None else fused_parts(hf_name, model)
        if b is None or parts is None or b.shape[0] != parts[-1][1].stop:
            yield key, hf_name, a, b
            continue
        for part, rows in parts:
            yield key, part, a, b[rows]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
