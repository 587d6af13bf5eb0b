"""`kvserve quantize`: every linear layer of the decoder (and, with `lm_head`, the LM head)
quantized by RTN or GPTQ, written in GPTQ's hub format (`packing.py`) so that other tools
read the files too, or by SqueezeLLM (`squeezellm.py`), written in the lookup-table layout
the README documents.

Every projection of the decoder is quantized, each expert's of a mixture of experts
included; routers stay in full precision, as GPTQ's hub files keep them. RTN needs no
model: it rounds the checkpoint's weights as they are read.

GPTQ runs layer by layer: calibration windows from the training split of the local corpus
go through the model, hooks sum each linear layer's input Hessian for one decoder layer at a
time, and that layer's weights are replaced by their quantized values before the next
layer's inputs are collected, so every layer compensates the error of those before it. An
expert's Hessian sums the tokens routed to it (and its down projection's, their gated
activations); an expert no calibration token reached is rounded to nearest. SqueezeLLM
weighs each weight by the Fisher information of the full-precision model, from the
gradients of the language-model loss on the same calibration windows.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from kvserve.config import ModelConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import checkpoint_files, iter_checkpoint
from kvserve.quantization.gptq import QuantizedWeight, gptq, rtn
from kvserve.quantization.hub_format import QuantConfig
from kvserve.quantization.packing import pack_gptq, pack_rows
from kvserve.quantization.squeezellm import LutWeight, squeezellm
from kvserve.tools.checkpoint_files import write_json, write_weights
from kvserve.tools.corpus import corpus_tokens
from kvserve.worker.cpu_allocator import retain_freed_memory

logger = logging.getLogger(__name__)

METHODS = ("rtn", "gptq", "squeezellm")
DEFAULT_GROUP_SIZE = 128  # below 8 bits, where it divides every layer's inputs
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "special_tokens_map.json")


# A decoder layer's projection weights: attention's and the MLP's, and each expert's (Mixtral
# names them w1-w3); not a router (`gate`) or the shared expert's gate.
_PROJECTION = re.compile(r"model\.layers\.\d+\..*\.(\w+_proj|w[123])\.weight$")


Layer = torch.Tensor | QuantizedWeight | LutWeight  # a checkpoint tensor, or a quantized layer
# One expert's projection in the checkpoint: model.layers.{i}.{block}.experts.{e}.{name}.weight
_EXPERT = re.compile(r"model\.layers\.\d+\.\w+\.experts\.(\d+)\.(\w+)\.weight$")


@dataclass(frozen=True)
class _Target:
    """A weight to quantize in the transformers model: a linear layer's, or one expert's
    projection, rows of the experts' stacked [num_experts, out, in] parameter."""

    param: nn.Parameter
    expert: int | None = None
    rows: slice = field(default_factory=lambda: slice(None))  # all of them

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This weight's part of a tensor shaped like `param` (a view)."""
        return (tensor if self.expert is None else tensor[self.expert])[self.rows]

    @property
    def inputs(self) -> tuple[nn.Parameter, int | None]:
        """What the Hessian of its inputs is kept under: an expert's gate and up share it."""
        return self.param, self.expert


class _StopForward(Exception):
    """Raised after the decoder layer being calibrated: later layers need not run."""


def quantize_model(model_dir: str | Path, output: str | Path, method: str, bits: int,
                   group_size: int | None = None, act_order: bool = False, sym: bool = True,
                   num_samples: int = 128, seq_len: int = 256, seed: int = 0,
                   outlier_fraction: float = 0.0045, sensitive_fraction: float = 0.0005,
                   lm_head: bool = False,
                   max_shard_bytes: int = 2 << 30, progress: bool = False) -> Path:
    """`group_size` None: 128 below 8 bits, and at 8 bits -1 (a scale per output channel,
    what the CPU int8 kernel runs). `lm_head` quantizes the LM head too, untied from the
    embedding, as GPTQModel's option of that name does."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"bits must be 2, 3, 4 or 8, got {bits}")
    if num_samples < 1 or seq_len < 2:
        raise ValueError("calibration needs at least 1 sample of at least 2 tokens")
    if group_size is not None and group_size < 1 and group_size != -1:
        raise ValueError(f"group_size must be -1 (one group per row) or >= 1, got {group_size}")
    source, out = Path(model_dir), Path(output)
    # A checkpoint at all? (In the dtype the layers are quantized in: `auto` would log.)
    source_config = ModelConfig.from_pretrained(source, dtype="float32")
    quantization = source_config.quantization
    if quantization is not None:
        raise ValueError(f"model: {str(source)!r} is already quantized ({quantization.method}, "
                         f"{quantization.bits} bits); quantize its full-precision original")
    if out.resolve() == source.resolve():
        raise ValueError("output: the quantized checkpoint needs a folder of its own, not "
                         "the model's")
    tied = source_config.tie_word_embeddings
    if group_size is None:  # SqueezeLLM's lookup tables are per row whatever is given
        group_size = (-1 if bits == 8 or method == "squeezellm"
                      else _default_group_size(source, tied, lm_head))
    config = (QuantConfig("squeezellm", bits, -1, lm_head=lm_head) if method == "squeezellm"
              else QuantConfig("gptq", bits, group_size, act_order and method == "gptq", sym,
                               lm_head=lm_head))
    if method == "rtn":
        for name, (out_features, in_features) in _rounded_shapes(source, tied, config):
            _check_shape(name, in_features, out_features, bits, group_size)
        _write(_quantized_checkpoint(source, tied, config, lambda _, t: _round(t, config)),
               tied and not lm_head, source, out, config, max_shard_bytes, progress)
        return out
    retain_freed_memory()  # each layer's temporaries reuse the last one's pages
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    names = [name for name, _ in _rounded_shapes(source, False, config)]  # the files' own
    stages = [(layer, _targets(layer, f"model.layers.{index}", names))
              for index, layer in enumerate(model.model.layers)]
    if lm_head:
        if tied:
            model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
        stages.append((model.lm_head, {"lm_head": _Target(model.lm_head.weight)}))
    found = {name for _, targets in stages for name in targets}
    if missing := [name for name in names if _layer_name(name) not in found]:
        raise ValueError(f"model: {method} found no layer in transformers' "
                         f"{type(model).__name__} for {missing[0]}")
    group_size = config.group_size  # SqueezeLLM's: -1, a lookup table per row
    for name, target in [*stages[0][1].items(), *stages[-1][1].items()]:
        out_features, in_features = target.of(target.param).shape
        _check_shape(name, in_features, out_features, bits, group_size)
    for name, fraction in (("outlier_fraction", outlier_fraction),
                           ("sensitive_fraction", sensitive_fraction)):
        if not 0 <= fraction < 1:
            raise ValueError(f"{name} must be in [0, 1), got {fraction}")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    calibration = _calibration(tokenizer, num_samples, seq_len, seed)
    fisher = _fisher(model, {t.param for _, targets in stages for t in targets.values()},
                     calibration, progress) if method == "squeezellm" else {}
    quantized: dict[str, QuantizedWeight | LutWeight] = {}
    unreached = 0
    for module, targets in tqdm(stages, desc=f"{method} {bits}-bit", unit=" layers",
                                disable=not progress):
        hessians = _hessians(model, module, targets, calibration) if method == "gptq" else {}
        for name, target in targets.items():
            weight = target.of(target.param.data)
            group = weight.shape[1] if group_size == -1 else group_size
            if method == "squeezellm":
                q: QuantizedWeight | LutWeight = squeezellm(
                    weight, target.of(fisher[target.param]), bits, outlier_fraction,
                    sensitive_fraction)
            elif target.inputs in hessians:
                q = gptq(weight, hessians[target.inputs], bits, group, sym, act_order)
            else:  # an expert that no calibration token was routed to
                q = _round(weight, config)
                unreached += 1
            weight.copy_(q.dequantize())  # later layers see the quantized layer
            quantized[name] = q
    if unreached:
        logger.info("%d expert projections saw no calibration token and were rounded to "
                    "nearest; more --calibration-samples reach more experts", unreached)
    _write(_quantized_checkpoint(source, tied, config,
                                 lambda name, _: quantized[_layer_name(name)]),
           tied and not lm_head, source, out, config, max_shard_bytes, progress=False)
    return out


def _quantized_checkpoint(source: Path, tied: bool, config: QuantConfig,
                          quantize: Callable[[str, torch.Tensor], Layer]
                          ) -> Iterator[tuple[str, Layer]]:
    """The checkpoint's tensors as they are read, its decoder projections (and LM head) as
    `quantize(name, tensor)` gives them; with `lm_head`, a tied LM head as weights of its own,
    quantized, after the embedding (a tied one's copy in the files is left out)."""
    for name, tensor in iter_checkpoint(source):
        if tied and name == "lm_head.weight":
            continue  # the embedding's copy: tied again on load, or quantized after it
        yield name, quantize(name, tensor) if _rounds(name, config) else tensor
        if _heads_tied_lm_head(name, tied, config):
            yield "lm_head.weight", quantize("lm_head.weight", tensor)


def _rounds(name: str, config: QuantConfig) -> bool:
    return bool(_PROJECTION.match(name)) or (config.lm_head and name == "lm_head.weight")


def _heads_tied_lm_head(name: str, tied: bool, config: QuantConfig) -> bool:
    """Whether `name` is the embedding that a quantized LM head is made from."""
    return config.lm_head and tied and name == "model.embed_tokens.weight"


def _round(weight: torch.Tensor, config: QuantConfig) -> QuantizedWeight:
    group = weight.shape[1] if config.group_size == -1 else config.group_size
    return rtn(weight, config.bits, group, config.sym)


def _layer_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight")


def _targets(layer: nn.Module, prefix: str, names: list[str]) -> dict[str, _Target]:
    """The weights of decoder layer `prefix` to quantize, by their checkpoint layer names:
    its linear projections, and each expert's projection among `names` (transformers stacks
    the experts' gate and up projections as [num_experts, 2 * size, hidden], and their down
    projections)."""
    targets = {f"{prefix}.{name}": _Target(m.weight) for name, m in layer.named_modules()
               if isinstance(m, nn.Linear) and _PROJECTION.match(f"{prefix}.{name}.weight")}
    experts = next((m for m in layer.modules() if _stacks_experts(m)), None)
    if experts is None:
        return targets
    size = experts.gate_up_proj.shape[1] // 2
    for name in names:
        match = name.startswith(f"{prefix}.") and _EXPERT.match(name)
        if match:
            fused, shard = LlamaForCausalLM.packed_modules.get(match[2], (match[2], 0))
            expert = int(match[1])
            targets[_layer_name(name)] = (
                _Target(experts.gate_up_proj, expert, slice(shard * size, (shard + 1) * size))
                if fused == "gate_up_proj" else _Target(experts.down_proj, expert))
    return targets


def _stacks_experts(module: nn.Module) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    return isinstance(gate_up, nn.Parameter) and gate_up.dim() == 3


def _rounded_shapes(source: Path, tied: bool, config: QuantConfig
                    ) -> Iterator[tuple[str, tuple[int, int]]]:
    """The shapes of the weights `_quantized_checkpoint` quantizes, from the files' headers
    (no tensor read)."""
    for file in checkpoint_files(source):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if _rounds(name, config) or _heads_tied_lm_head(name, tied, config):
                    yield name, tuple(f.get_slice(name).get_shape())


def _default_group_size(source: Path, tied: bool, lm_head: bool) -> int:
    """128 (the hub's usual group), or the largest power of two below it that divides every
    quantized layer's inputs (64 for a model 576 wide); one group per row below 32."""
    probe = QuantConfig("gptq", 4, DEFAULT_GROUP_SIZE, lm_head=lm_head)
    group = DEFAULT_GROUP_SIZE
    for _, (_, in_features) in _rounded_shapes(source, tied, probe):
        group = math.gcd(group, in_features)
    group = group if group >= 32 else -1
    if group != DEFAULT_GROUP_SIZE:
        logger.info("group_size %d: the default %d does not divide every layer's inputs",
                    group, DEFAULT_GROUP_SIZE)
    return group


def _check_shape(name: str, in_features: int, out_features: int, bits: int,
                 group_size: int) -> None:
    if group_size != -1 and in_features % group_size:
        fitting = math.gcd(in_features, 1 << (group_size.bit_length() - 1))
        raise ValueError(f"group_size {group_size} does not divide {name}'s "
                         f"{in_features} input features (--group-size {fitting} does; -1 is "
                         "one group per row)")
    if (in_features * bits) % 32 or (out_features * bits) % 32:
        raise ValueError(f"{name} ({in_features} -> {out_features}) does not pack "
                         f"into 32-bit words at {bits} bits")


def _calibration(tokenizer: object, num_samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """`num_samples` windows drawn (seeded) from the training split."""
    data = corpus_tokens(tokenizer, "train", max(4 * num_samples * seq_len, 1 << 20))
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq_len, (num_samples,), generator=gen).tolist()
    return torch.stack([data[s:s + seq_len] for s in starts])


@torch.inference_mode()
def _hessians(model: nn.Module, stage: nn.Module, targets: dict[str, _Target],
              calibration: torch.Tensor, batch_size: int = 8
              ) -> dict[tuple[nn.Parameter, int | None], torch.Tensor]:
    """2 X^T X / N of the inputs X of each of `targets` over all calibration tokens (an
    expert's: the tokens routed to it), running the model up to `stage` (a decoder layer, or
    the LM head itself). An expert that no token reached has none."""
    wanted = {target.inputs for target in targets.values()}
    sums: dict[tuple[nn.Parameter, int | None], torch.Tensor] = {}
    counts: dict[tuple[nn.Parameter, int | None], int] = {}

    def add(key: tuple[nn.Parameter, int | None], x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        if key not in sums:
            sums[key], counts[key] = x.new_zeros(x.shape[1], x.shape[1]), 0
        sums[key] += x.t() @ x
        counts[key] += x.shape[0]

    def linear_inputs(module: nn.Linear, inputs: tuple[torch.Tensor, ...], _out: object
                      ) -> None:
        add((module.weight, None), inputs[0])

    def expert_inputs(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        hidden, top_k_index = inputs[0], inputs[1]
        for expert in range(module.gate_up_proj.shape[0]):
            x = hidden[(top_k_index == expert).any(dim=-1)]
            if len(x):
                add((module.gate_up_proj, expert), x)
                gate, up = F.linear(x, module.gate_up_proj[expert]).chunk(2, dim=-1)
                add((module.down_proj, expert), module.act_fn(gate) * up)

    def stop(*_: object) -> None:
        raise _StopForward

    handles = [m.register_forward_hook(linear_inputs) for m in stage.modules()
               if isinstance(m, nn.Linear) and (m.weight, None) in wanted]
    handles += [m.register_forward_pre_hook(expert_inputs) for m in stage.modules()
                if _stacks_experts(m)]
    handles.append(stage.register_forward_hook(stop))
    try:
        for start in range(0, len(calibration), batch_size):
            with contextlib.suppress(_StopForward):
                model(input_ids=calibration[start:start + batch_size])
    finally:
        for handle in handles:
            handle.remove()
    return {key: 2 * total / counts[key] for key, total in sums.items()}


def _fisher(model: nn.Module, params: set[nn.Parameter], calibration: torch.Tensor,
            progress: bool) -> dict[nn.Parameter, torch.Tensor]:
    """The empirical Fisher diagonal of each of `params`: the mean over calibration windows
    of each window's squared loss gradient. (Squaring the gradient of a batch instead lets
    the windows' gradients cancel, and measured worse.)"""
    sums = {p: torch.zeros_like(p) for p in params}
    for window in tqdm(calibration, desc="fisher", unit=" windows", disable=not progress):
        model.zero_grad(set_to_none=True)
        model(input_ids=window[None], labels=window[None]).loss.backward()
        for p, total in sums.items():
            if p.grad is not None:  # an expert block that no token reached has none
                total += p.grad.float() ** 2
    model.zero_grad(set_to_none=True)
    return {p: total / len(calibration) for p, total in sums.items()}


def _hub_tensors(named: Iterable[tuple[str, Layer]], config: QuantConfig
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named:
        layer = name.removesuffix(".weight")
        if isinstance(tensor, LutWeight):
            yield from {f"{layer}.qweight": pack_rows(tensor.indices.t(), config.bits),
                        f"{layer}.lookup_table": tensor.lookup_table.to(torch.float16),
                        f"{layer}.sparse_rows": tensor.sparse_rows.to(torch.int32),
                        f"{layer}.sparse_cols": tensor.sparse_cols.to(torch.int32),
                        f"{layer}.sparse_values": tensor.sparse_values.to(torch.float16)
                        }.items()
        elif isinstance(tensor, QuantizedWeight):
            qweight, qzeros = pack_gptq(tensor.intweight, tensor.zeros, config.bits)
            yield from {f"{layer}.qweight": qweight, f"{layer}.qzeros": qzeros,
                        f"{layer}.scales": tensor.scales.to(torch.float16),
                        f"{layer}.g_idx": tensor.g_idx.to(torch.int32)}.items()
        else:
            yield name, tensor


def _write(named: Iterable[tuple[str, Layer]], tied: bool, source: Path, out: Path,
           config: QuantConfig, max_shard_bytes: int, progress: bool) -> None:
    """Writes the checkpoint's tensors, each quantized layer as its parts in the hub's format,
    shard by shard as they come: only a shard's worth is held at a time."""
    out.mkdir(parents=True, exist_ok=True)
    write_weights(out, _hub_tensors(named, config), None, max_shard_bytes, progress)
    raw = json.loads((source / "config.json").read_text())
    raw["quantization_config"] = config.to_hf()
    raw["tie_word_embeddings"] = tied
    write_json(out / "config.json", raw)
    for name in COPIED_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
