"""`kvserve quantize`: every linear layer of the decoder (and, with `lm_head`, the LM head)
quantized by RTN or GPTQ, written in GPTQ's hub format (`packing.py`) so that other tools
read the files too, or by SqueezeLLM (`squeezellm.py`), written in the lookup-table layout
the README documents.

RTN needs no model: it rounds the checkpoint's projection weights as they are read, for
any architecture the engine loads (the experts of a mixture of experts included; routers
stay in full precision, as GPTQ's hub files keep them).

GPTQ runs layer by layer: calibration windows from the training split of the local corpus
go through the model, hooks sum each linear layer's input Hessian for one decoder layer at a
time, and that layer's weights are replaced by their quantized values before the next
layer's inputs are collected, so every layer compensates the error of those before it.
SqueezeLLM weighs each weight by the Fisher information of the full-precision model, from
the gradients of the language-model loss on the same calibration windows.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from kvserve.config import ModelConfig
from kvserve.models.loader import checkpoint_files, iter_checkpoint
from kvserve.quantization.gptq import QuantizedWeight, gptq, rtn
from kvserve.quantization.hub_format import QuantConfig
from kvserve.quantization.packing import pack_gptq, pack_rows
from kvserve.quantization.squeezellm import LutWeight, squeezellm
from kvserve.tools.checkpoint_files import write_json, write_weights
from kvserve.tools.corpus import corpus_tokens
from kvserve.worker.cpu_allocator import retain_freed_memory

METHODS = ("rtn", "gptq", "squeezellm")
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "special_tokens_map.json")


# A decoder layer's projection weights: attention's and the MLP's, and each expert's (Mixtral
# names them w1-w3); not a router (`gate`) or the shared expert's gate.
_PROJECTION = re.compile(r"model\.layers\.\d+\..*\.(\w+_proj|w[123])\.weight$")


Layer = torch.Tensor | QuantizedWeight | LutWeight  # a checkpoint tensor, or a quantized layer


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
    if group_size is None:
        group_size = -1 if bits == 8 else 128
    if group_size < 1 and group_size != -1:
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
    if method == "rtn":
        config = QuantConfig("gptq", bits, group_size, False, sym, lm_head=lm_head)
        tied = source_config.tie_word_embeddings
        for name, (out_features, in_features) in _rounded_shapes(source, tied, config):
            _check_shape(name, in_features, out_features, bits, group_size)
        _write(_rtn(source, tied, config), tied and not lm_head, source, out, config,
               max_shard_bytes, progress)
        return out
    if source_config.moe is not None:
        raise ValueError(f"method: {method} calibrates through transformers' dense linear "
                         f"layers; a mixture-of-experts model ({source_config.architecture}) "
                         f"quantizes with rtn")
    retain_freed_memory()  # each layer's temporaries reuse the last one's pages
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    stages = [(f"model.layers.{index}", layer, {name: m for name, m in layer.named_modules()
                                                  if isinstance(m, nn.Linear)})
              for index, layer in enumerate(model.model.layers)]
    if lm_head:
        if model.config.tie_word_embeddings:
            model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
            model.config.tie_word_embeddings = False
        stages.append(("", model.lm_head, {"lm_head": model.lm_head}))
    if method == "squeezellm":
        group_size = -1  # a lookup table per row: no groups
    for name, m in [*stages[0][2].items(), *stages[-1][2].items()]:
        _check_shape(name, m.in_features, m.out_features, bits, group_size)
    for name, fraction in (("outlier_fraction", outlier_fraction),
                           ("sensitive_fraction", sensitive_fraction)):
        if not 0 <= fraction < 1:
            raise ValueError(f"{name} must be in [0, 1), got {fraction}")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    calibration = _calibration(tokenizer, num_samples, seq_len, seed)
    fisher = _fisher(model, [m for *_, linears in stages for m in linears.values()],
                     calibration, progress) if method == "squeezellm" else {}
    quantized: dict[str, QuantizedWeight | LutWeight] = {}
    for prefix, module, linears in tqdm(stages, desc=f"{method} {bits}-bit", unit=" layers",
                                        disable=not progress):
        hessians = _hessians(model, module, linears, calibration) if method == "gptq" else {}
        for name, linear in linears.items():
            group = linear.in_features if group_size == -1 else group_size
            weight = linear.weight.data
            if method == "squeezellm":
                q: QuantizedWeight | LutWeight = squeezellm(
                    weight, fisher[linear], bits, outlier_fraction, sensitive_fraction)
            else:
                q = gptq(weight, hessians[name], bits, group, sym, act_order)
            linear.weight.data.copy_(q.dequantize())  # later layers see the quantized layer
            quantized[f"{prefix}.{name}".lstrip(".")] = q
    config = (QuantConfig("squeezellm", bits, -1, lm_head=lm_head) if method == "squeezellm"
              else QuantConfig("gptq", bits, group_size, act_order, sym, lm_head=lm_head))
    tied = model.config.tie_word_embeddings
    _write(((name, quantized.get(name.removesuffix(".weight"), tensor))
            for name, tensor in model.state_dict().items()
            if not (tied and name == "lm_head.weight")),
           tied, source, out, config, max_shard_bytes, progress=False)
    return out


def _rtn(source: Path, tied: bool, config: QuantConfig) -> Iterator[tuple[str, Layer]]:
    """The checkpoint's tensors as they are read, its decoder projections (and LM head)
    rounded to nearest; with `lm_head`, a tied LM head as weights of its own, quantized, after
    the embedding (a tied one's copy in the files is left out, as the transformers path
    leaves it)."""
    for name, tensor in iter_checkpoint(source):
        if tied and name == "lm_head.weight":
            continue  # the embedding's copy: tied again on load, or quantized after it
        yield name, _round(tensor, config) if _rounds(name, config) else tensor
        if _heads_tied_lm_head(name, tied, config):
            yield "lm_head.weight", _round(tensor, config)


def _rounds(name: str, config: QuantConfig) -> bool:
    return bool(_PROJECTION.match(name)) or (config.lm_head and name == "lm_head.weight")


def _heads_tied_lm_head(name: str, tied: bool, config: QuantConfig) -> bool:
    """Whether `name` is the embedding that a quantized LM head is made from."""
    return config.lm_head and tied and name == "model.embed_tokens.weight"


def _round(weight: torch.Tensor, config: QuantConfig) -> QuantizedWeight:
    group = weight.shape[1] if config.group_size == -1 else config.group_size
    return rtn(weight, config.bits, group, config.sym)


def _rounded_shapes(source: Path, tied: bool, config: QuantConfig
                    ) -> Iterator[tuple[str, tuple[int, int]]]:
    """The shapes of the weights `_rtn` rounds, from the files' headers (no tensor read)."""
    for file in checkpoint_files(source):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if _rounds(name, config) or _heads_tied_lm_head(name, tied, config):
                    yield name, tuple(f.get_slice(name).get_shape())


def _check_shape(name: str, in_features: int, out_features: int, bits: int,
                 group_size: int) -> None:
    if group_size != -1 and in_features % group_size:
        raise ValueError(f"group_size {group_size} does not divide {name}'s "
                         f"{in_features} input features")
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
def _hessians(model: nn.Module, stage: nn.Module, linears: dict[str, nn.Linear],
              calibration: torch.Tensor, batch_size: int = 8) -> dict[str, torch.Tensor]:
    """2 X^T X / N of each linear layer's inputs X over all calibration tokens, running
    the model up to `stage` (a decoder layer, or the LM head itself)."""
    sums = {name: torch.zeros(m.in_features, m.in_features) for name, m in linears.items()}
    counts = dict.fromkeys(linears, 0)

    def record(name: str):  # noqa: ANN202
        def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...], _out: object) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            sums[name] += x.t() @ x
            counts[name] += x.shape[0]
        return hook

    def stop(*_: object) -> None:
        raise _StopForward

    handles = [m.register_forward_hook(record(name)) for name, m in linears.items()]
    handles.append(stage.register_forward_hook(stop))
    try:
        for start in range(0, len(calibration), batch_size):
            with contextlib.suppress(_StopForward):
                model(input_ids=calibration[start:start + batch_size])
    finally:
        for handle in handles:
            handle.remove()
    return {name: 2 * sums[name] / counts[name] for name in linears}


def _fisher(model: nn.Module, linears: list[nn.Linear], calibration: torch.Tensor,
            progress: bool) -> dict[nn.Module, torch.Tensor]:
    """The empirical Fisher diagonal of each of `linears`: the mean over calibration windows
    of each window's squared loss gradient. (Squaring the gradient of a batch instead lets
    the windows' gradients cancel, and measured worse.)"""
    sums = {m: torch.zeros_like(m.weight) for m in linears}
    for window in tqdm(calibration, desc="fisher", unit=" windows", disable=not progress):
        model.zero_grad(set_to_none=True)
        model(input_ids=window[None], labels=window[None]).loss.backward()
        for m in linears:
            sums[m] += m.weight.grad.float() ** 2
    model.zero_grad(set_to_none=True)
    return {m: total / len(calibration) for m, total in sums.items()}


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
