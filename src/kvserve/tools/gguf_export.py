"""A Llama, Mixtral, Qwen2, Qwen2-MoE, Qwen3 or Qwen3-MoE checkpoint folder as a GGUF file,
llama.cpp's format, written with the `gguf` package's writer: so that llama.cpp runs on the
very same weights as kvserve and transformers in `kvserve bench ... --baseline llamacpp`.
Mixtral is llama.cpp's Llama graph with experts, and the Qwen MoEs its `qwen2moe` and
`qwen3moe` graphs: each layer's router as `ffn_gate_inp`, and its experts' gate, up and down
projections stacked into one tensor each (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`);
Qwen2-MoE's shared expert as `ffn_{gate,up,down}_shexp` and its sigmoid gate as the vector
`ffn_gate_inp_shexp`. Qwen2's q/k/v biases and Qwen3's per-head q/k norms go in as
`attn_{q,k,v}.bias` and `attn_{q,k}_norm`.

Matmul weights and the embedding are written in the requested dtype (float32 or bfloat16),
norms in float32. A quantized checkpoint's layers (GPTQ, AWQ, SqueezeLLM) are dequantized and
written in llama.cpp's type of the same width, Q4_0 for 4 bits and Q8_0 for 8 (blocks of 32
weights with one float16 scale: 4.5 and 8.5 bits per weight), so that llama.cpp runs its own
quantized kernels on the same model; its other tensors keep the requested dtype.

llama.cpp's Llama graph rotates adjacent pairs of q/k dimensions, so their rows are reordered
from the checkpoint's rotate-half order as kvserve's own loader does; its Qwen graphs rotate
halves (NEOX), as the checkpoint is. The tokenizer goes in as GGUF's byte-level BPE (`gpt2`)
vocabulary, padded to the model's vocab.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch

from kvserve.config import ModelConfig
from kvserve.layers.rotary import to_interleaved
from kvserve.models.loader import checkpoint_files, iter_checkpoint
from kvserve.quantization.gptq import QuantizedWeight
from kvserve.quantization.hub_format import QuantConfig, dequantize_checkpoint
from kvserve.quantization.squeezellm import LutWeight

logger = logging.getLogger(__name__)

GGUF_DTYPES = (torch.float32, torch.bfloat16)
# A quantized checkpoint's bit width -> the GGML type its layers are written in.
GGUF_QUANTIZED_TYPES = {4: "Q4_0", 8: "Q8_0"}
# Checkpoint tensor name pieces -> GGUF names (`{}` is the layer).
_LAYER_TENSORS = {
    "input_layernorm.weight": "blk.{}.attn_norm.weight",
    "self_attn.q_proj.weight": "blk.{}.attn_q.weight",
    "self_attn.k_proj.weight": "blk.{}.attn_k.weight",
    "self_attn.v_proj.weight": "blk.{}.attn_v.weight",
    "self_attn.o_proj.weight": "blk.{}.attn_output.weight",
    "post_attention_layernorm.weight": "blk.{}.ffn_norm.weight",
    "mlp.gate_proj.weight": "blk.{}.ffn_gate.weight",
    "mlp.up_proj.weight": "blk.{}.ffn_up.weight",
    "mlp.down_proj.weight": "blk.{}.ffn_down.weight",
    "block_sparse_moe.gate.weight": "blk.{}.ffn_gate_inp.weight",
    "mlp.gate.weight": "blk.{}.ffn_gate_inp.weight",
    "self_attn.q_proj.bias": "blk.{}.attn_q.bias",
    "self_attn.k_proj.bias": "blk.{}.attn_k.bias",
    "self_attn.v_proj.bias": "blk.{}.attn_v.bias",
    "self_attn.q_norm.weight": "blk.{}.attn_q_norm.weight",
    "self_attn.k_norm.weight": "blk.{}.attn_k_norm.weight",
    "mlp.shared_expert.gate_proj.weight": "blk.{}.ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "blk.{}.ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "blk.{}.ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "blk.{}.ffn_gate_inp_shexp.weight",  # [1, h] as [h]
}
# An expert's tensors (Mixtral's, Qwen's) -> the GGUF tensor that stacks them over the experts.
_EXPERT_TENSORS = {
    "w1": "blk.{}.ffn_gate_exps.weight", "w3": "blk.{}.ffn_up_exps.weight",
    "w2": "blk.{}.ffn_down_exps.weight", "gate_proj": "blk.{}.ffn_gate_exps.weight",
    "up_proj": "blk.{}.ffn_up_exps.weight", "down_proj": "blk.{}.ffn_down_exps.weight"}
_EXPERT_PARENTS = ("block_sparse_moe", "mlp")  # Mixtral's, Qwen's
# Architectures -> llama.cpp's graph for them.
_GRAPHS = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "llama",
           "Qwen2ForCausalLM": "qwen2", "Qwen2MoeForCausalLM": "qwen2moe",
           "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe"}
# llama.cpp's MoE graphs of Qwen -> whether they rescale the top-k weights to sum to 1.
_RENORMALIZING_GRAPHS = {"qwen2moe": False, "qwen3moe": True}
# Graphs that load no model without `output.weight`: a tied one gets the embedding's copy.
_UNTIED_GRAPHS = ("qwen2moe",)
_INTERLEAVED_ROPE_GRAPHS = ("llama",)
# GGUF keys (the writer's `add_<key>`) -> ModelConfig fields.
_HYPERPARAMETERS = {
    "context_length": "max_position_embeddings", "embedding_length": "hidden_size",
    "block_count": "num_layers", "feed_forward_length": "intermediate_size",
    "head_count": "num_heads", "head_count_kv": "num_kv_heads", "key_length": "head_dim",
    "value_length": "head_dim", "rope_dimension_count": "head_dim",
    "rope_freq_base": "rope_theta", "layer_norm_rms_eps": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_GLOBAL_TENSORS = {"model.embed_tokens.weight": "token_embd.weight",
                   "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def cached_gguf(model: str | Path, dtype: torch.dtype, cache_dir: Path | None = None
                ) -> Path:
    """The GGUF of `model` in `dtype`, converted on first use and kept under `cache_dir`
    (~/.cache/kvserve/gguf), keyed by the checkpoint files' names, sizes and modification
    times."""
    cache_dir = cache_dir or Path.home() / ".cache" / "kvserve" / "gguf"
    folder = Path(model)
    files = [folder / "config.json", *checkpoint_files(folder)]
    stamp = json.dumps([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files])
    digest = hashlib.sha256(f"{folder.resolve()}{stamp}".encode()).hexdigest()[:16]
    kind = weight_type(ModelConfig.from_pretrained(folder, "float32").quantization, dtype)
    path = cache_dir / f"{folder.name}-{digest}-{kind}.gguf"
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        logger.info("converting %s to GGUF (%s): %s", folder, dtype, path)
        partial = path.with_suffix(".partial")
        export_gguf(folder, dtype, partial)
        partial.rename(path)
    return path


def weight_type(quant: QuantConfig | None, dtype: torch.dtype) -> str:
    """How the GGUF holds a checkpoint's matmul weights: `Q4_0-float32` (quantized layers,
    other tensors in `dtype`), `float32` or `bfloat16`; a ValueError where it cannot."""
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype: GGUF export writes float32 or bfloat16, got {dtype}")
    name = str(dtype).removeprefix("torch.")
    if quant is None:
        return name
    if quant.bits not in GGUF_QUANTIZED_TYPES:
        raise ValueError(f"model: GGUF export writes 4- and 8-bit quantized checkpoints (as "
                         f"{' and '.join(GGUF_QUANTIZED_TYPES.values())}), not "
                         f"{quant.bits}-bit {quant.method}")
    return f"{GGUF_QUANTIZED_TYPES[quant.bits]}-{name}"


def export_gguf(model: str | Path, dtype: torch.dtype, out: Path) -> None:
    import gguf

    folder = Path(model)
    cfg = ModelConfig.from_pretrained(folder, "float32")
    weight_type(cfg.quantization, dtype)  # refuses what cannot be written
    if cfg.architecture not in _GRAPHS:
        raise ValueError(f"model: GGUF export supports {', '.join(_GRAPHS)} checkpoints, not "
                         f"{cfg.architecture}")
    graph = _GRAPHS[cfg.architecture]
    rope_type = (cfg.rope_scaling or {}).get("rope_type")
    if rope_type in ("yarn", "longrope"):
        raise ValueError(f"model: GGUF export does not write {rope_type} rope scaling")
    if cfg.sliding_window:
        raise ValueError(f"model: llama.cpp's {graph} graph attends without a window; this "
                         f"checkpoint's sliding_window is {cfg.sliding_window}")
    if graph in _RENORMALIZING_GRAPHS and (
            cfg.moe.renormalize != _RENORMALIZING_GRAPHS[graph]
            or len(cfg.moe.sparse_layers) != cfg.num_layers):
        raise ValueError(f"model: llama.cpp's {graph} graph has experts in every layer and "
                         f"{'' if _RENORMALIZING_GRAPHS[graph] else 'never '}renormalizes "
                         f"their top-k weights; this checkpoint's norm_topk_prob is "
                         f"{str(cfg.moe.renormalize).lower()}, or mlp_only_layers or "
                         f"decoder_sparse_step leave layers dense")
    quantized_type = None if cfg.quantization is None else gguf.GGMLQuantizationType[
        GGUF_QUANTIZED_TYPES[cfg.quantization.bits]]
    writer = gguf.GGUFWriter(str(out), graph)
    writer.add_name(folder.name)
    for key, field in _HYPERPARAMETERS.items():
        getattr(writer, f"add_{key}")(getattr(cfg, field))
    writer.add_file_type(
        gguf.LlamaFileType[f"MOSTLY_{quantized_type.name}"] if quantized_type is not None
        else gguf.LlamaFileType.MOSTLY_BF16 if dtype == torch.bfloat16
        else gguf.LlamaFileType.ALL_F32)
    if cfg.moe is not None:
        writer.add_expert_count(cfg.moe.num_experts)
        writer.add_expert_used_count(cfg.moe.top_k)
        writer.add_expert_feed_forward_length(cfg.moe.intermediate_size)
        if cfg.moe.shared_expert_intermediate_size:
            writer.add_expert_shared_feed_forward_length(
                cfg.moe.shared_expert_intermediate_size)
    _add_tokenizer(writer, folder, cfg)
    tensors = dequantize_checkpoint(iter_checkpoint(folder), cfg.quantization,
                                    keep_integers=True)
    experts: dict[str, dict[int, torch.Tensor]] = {}  # stacked tensor -> the experts' so far

    def add(gguf_name: str, data: np.ndarray, quantized: bool) -> None:
        if quantized:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, quantized_type),
                              raw_dtype=quantized_type)
        elif data.ndim >= 2 and dtype == torch.bfloat16:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(gguf_name, data)

    for name, tensor in tensors:
        quantized = isinstance(tensor, QuantizedWeight | LutWeight)
        if quantized:
            tensor = tensor.dequantize()
        if (graph in _INTERLEAVED_ROPE_GRAPHS
                and name.endswith(("q_proj.weight", "k_proj.weight"))):
            tensor = to_interleaved(tensor, cfg.head_dim)
        expert = _expert_part(name)
        if expert is not None and cfg.moe is not None:
            stacked, index = expert
            parts = experts.setdefault(stacked, {})
            parts[index] = tensor
            if len(parts) < cfg.moe.num_experts:
                continue
            name, tensor = stacked, torch.stack([parts[e] for e in sorted(parts)])
            del experts[stacked]
        gguf_name = _gguf_name(name) if expert is None else name
        if gguf_name is None:
            raise ValueError(f"model: no GGUF name for checkpoint tensor {name!r}")
        data = tensor.float().numpy()
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            data = data.reshape(-1)
        add(gguf_name, data, quantized)
        if (gguf_name == "token_embd.weight" and cfg.tie_word_embeddings
                and graph in _UNTIED_GRAPHS):
            add("output.weight", data, quantized)
    if experts:
        raise ValueError(f"model: the checkpoint lacks experts of {sorted(experts)[0]}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_name(name: str) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    parts = name.split(".", 3)  # model.layers.{i}.{rest}
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_TENSORS:
        return _LAYER_TENSORS[parts[3]].format(parts[2])
    return None


def _expert_part(name: str) -> tuple[str, int] | None:
    """(the GGUF tensor that stacks it, the expert) for an expert's tensor."""
    parts = name.split(".")  # model.layers.{i}.{block_sparse_moe|mlp}.experts.{e}.{w}.weight
    if (len(parts) == 8 and parts[:2] == ["model", "layers"] and parts[3] in _EXPERT_PARENTS
            and parts[4] == "experts" and parts[6] in _EXPERT_TENSORS):
        return _EXPERT_TENSORS[parts[6]].format(parts[2]), int(parts[5])
    return None


def _add_tokenizer(writer: object, folder: Path, cfg: ModelConfig) -> None:
    import gguf

    assert isinstance(writer, gguf.GGUFWriter)
    spec = json.loads((folder / "tokenizer.json").read_text())
    if spec["model"]["type"] != "BPE":
        raise ValueError(f"model: GGUF export needs a BPE tokenizer, got {spec['model']['type']}")
    by_id = {i: token for token, i in spec["model"]["vocab"].items()}
    special = {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
    by_id.update(special)
    tokens, types = [], []
    for i in range(cfg.vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    raw = json.loads((folder / "config.json").read_text())
    if raw.get("bos_token_id") is not None:
        writer.add_bos_token_id(int(raw["bos_token_id"]))
    if cfg.eos_token_ids:
        writer.add_eos_token_id(cfg.eos_token_ids[0])
