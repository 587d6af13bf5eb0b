"""Builds a model from a HF checkpoint folder: safetensors only, never pickle, never remote code.
Quantized checkpoints (GPTQ, AWQ, SqueezeLLM) load through `quantization/hub_format.py`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.attention.backend import AttentionBackend
from kvserve.config import ModelConfig
from kvserve.errors import CheckpointError
from kvserve.layers.linear import Linear
from kvserve.models.llama import LlamaForCausalLM
from kvserve.quantization.gptq import QuantizedWeight
from kvserve.quantization.hub_format import dequantize_checkpoint
from kvserve.quantization.squeezellm import LutWeight
from kvserve.worker.tensor_parallel import tp_group

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def load_model(cfg: ModelConfig, backend: AttentionBackend, device: str = "cpu",
               max_model_len: int | None = None) -> LlamaForCausalLM:
    with torch.device(device):
        model = LlamaForCausalLM(cfg, backend, max_model_len)
    modules = dict(model.named_modules())
    missing = {(name, kind, shard) for name, module in modules.items()
               if isinstance(module, Linear) for kind, shard in module.checkpoint_parts()}
    missing |= {(name, "weight", 0) for name, module in modules.items()
                if hasattr(module, "weight") and not isinstance(module, Linear)}
    missing.add(("embed_tokens", "weight", 0))
    # A linear layer is prepared as soon as its last part arrives, so the checkpoint's
    # tensors (a quantized layer's unpacked integers, 4x its packed bytes) are freed layer by
    # layer rather than all held until the end.
    parts_left = {name: len(module.checkpoint_parts()) for name, module in modules.items()
                  if isinstance(module, Linear)}
    embedding: torch.Tensor | None = None
    tensors = iter_checkpoint(Path(cfg.path))
    if cfg.multimodal:
        tensors = ((name, t) for hf_name, t in tensors
                   if (name := language_model_name(hf_name)) is not None)
    tensors = dequantize_checkpoint(tensors, cfg.quantization, keep_integers=True)
    for hf_name, tensor in _split_fused(tensors, model):
        if _IGNORED.match(hf_name):
            continue
        target = checkpoint_target(hf_name, model)
        if target is None:
            raise CheckpointError(f"model: unexpected tensor {hf_name!r} in the checkpoint")
        name, kind, shard = target
        quantized = isinstance(tensor, QuantizedWeight | LutWeight)
        if quantized and isinstance(modules.get(name), Linear):
            tensor = tensor.map_rows(lambda t, n=hf_name: model.adapt_checkpoint_tensor(n, t))
        else:
            if quantized:
                tensor = tensor.dequantize()
            # A linear layer widens a narrower checkpoint weight as it lays it out (prepare):
            # one pass instead of two, and half the memory held until then.
            keep = (kind == "weight" and isinstance(modules.get(name), Linear)
                    and tensor.element_size() < cfg.dtype.itemsize)
            tensor = tensor.to(device=device, dtype=None if keep else cfg.dtype)
            tensor = model.adapt_checkpoint_tensor(hf_name, tensor)
        try:
            if name == "embed_tokens":
                _copy_exact(model.embed_tokens, tensor)
                embedding = tensor
            elif isinstance(modules[name], Linear):
                modules[name].load(kind, shard, tensor)
            else:
                _copy_exact(getattr(modules[name], kind), tensor)
        except ValueError as e:
            raise CheckpointError(f"model: tensor {hf_name!r}: {e}") from None
        if (name, kind, shard) in missing and name in parts_left:
            parts_left[name] -= 1
            if not parts_left[name]:
                _prepare(name, modules[name])
        missing.discard((name, kind, shard))
    if ("lm_head", "weight", 0) in missing and cfg.tie_word_embeddings and embedding is not None:
        model.lm_head.load("weight", 0, embedding)
        missing.discard(("lm_head", "weight", 0))
        _prepare("lm_head", model.lm_head)
    if cfg.embedding_scale != 1.0:  # Gemma's, kept out of a tied LM head
        model.embed_tokens.mul_(torch.tensor(cfg.embedding_scale, dtype=cfg.dtype))
    if missing:
        names = sorted(f"{n}.{k}" + (f"[shard {s}]" if s else "") for n, k, s in missing)
        raise CheckpointError(f"model: checkpoint {cfg.path!r} lacks tensors: "
                              f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
    return model.eval()


def _prepare(name: str, linear: Linear) -> None:
    try:
        linear.prepare()
    except ValueError as e:
        raise CheckpointError(f"model: layer {name!r}: {e}") from None


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"model: cannot read {file.name}: {e}") from None


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"model: corrupt {index.name}: {e}") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"model: shards listed in {index.name} are missing: {absent}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"model: no *.safetensors weights in {str(folder)!r} "
                              "(pickled .bin checkpoints are not loaded)")
    return files


def checkpoint_target(hf_name: str, model: LlamaForCausalLM) -> tuple[str, str, int] | None:
    """Maps a HF tensor name to (our module name, 'weight'|'bias', shard)."""
    name = hf_name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed_tokens", "weight", 0
    module, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    module = ".".join(model.renamed_modules.get(part, part) for part in module.split("."))
    parent, _, leaf = module.rpartition(".")
    if leaf in model.packed_modules:
        fused, shard = model.packed_modules[leaf]
        return f"{parent}.{fused}", kind, shard
    known = dict(model.named_modules())
    if module in known and module:
        return module, kind, 0
    return None


_LANGUAGE_MODEL = re.compile(r"^(?:language_model\.model|model\.language_model)\.")
_OTHER_TOWERS = re.compile(r"(?:model\.)?(?:vision_tower|multi_modal_projector)\.")


def language_model_name(hf_name: str) -> str | None:
    """A multimodal checkpoint's tensor name as the text model's (Gemma 3's
    `language_model.model.*`, or `model.language_model.*` as transformers 5 names it in
    memory), or None for the vision tower's and the projector's."""
    if _OTHER_TOWERS.match(hf_name):
        return None
    return _LANGUAGE_MODEL.sub("model.", hf_name, count=1).removeprefix("language_model.")


def fused_parts(hf_name: str, model: LlamaForCausalLM) -> list[tuple[str, slice]] | None:
    """Where `hf_name` is a fused tensor (Phi-3's qkv_proj, gate_up_proj), the tensor names
    of its parts and their rows in it; None otherwise."""
    module, _, kind = hf_name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf not in model.fused_modules:
        return None
    target = checkpoint_target(hf_name, model)
    if target is None:
        return None
    linear = dict(model.named_modules())[target[0]]
    ranks = tp_group().size if linear.parallel == "column" else 1
    parts, start = [], 0
    for part, size in zip(model.fused_modules[leaf], linear.output_sizes, strict=True):
        parts.append((f"{module.removesuffix(leaf)}{part}.{kind}",
                      slice(start, start + size * ranks)))
        start += size * ranks
    return parts


def _split_fused(tensors: Iterator[tuple[str, torch.Tensor | QuantizedWeight | LutWeight]],
                 model: LlamaForCausalLM
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight | LutWeight]]:
    """The checkpoint's tensors with each fused one given as its parts, as the other
    checkpoints hold them (a fused tensor of the wrong size passes whole, for the layer to
    report)."""
    for hf_name, tensor in tensors:
        parts = fused_parts(hf_name, model)
        if parts is None or tensor.shape[0] != parts[-1][1].stop:
            yield hf_name, tensor
            continue
        for name, rows in parts:
            if isinstance(tensor, QuantizedWeight | LutWeight):
                yield name, tensor.map_rows(lambda t, rows=rows: t[rows])
            else:
                yield name, tensor[rows]


def _copy_exact(param: torch.Tensor, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"expected shape {list(param.shape)}, got {list(tensor.shape)}")
    param.copy_(tensor)


def load_tokenizer(path: str, chat_template: str | None = None, field: str = "model"
                   ) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer; `chat_template` replaces the template it came with.
    Errors name `field`."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{field}: cannot load the tokenizer from {path!r}: {e}") from None
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
