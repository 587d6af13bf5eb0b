"""Engine configuration: plain dataclasses, validated on construction."""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jinja2
import torch

from kvserve.devices import check_device, check_device_name
from kvserve.errors import CheckpointError
from kvserve.layers.rotary import ROPE_TYPES
from kvserve.models.hub import resolve_model
from kvserve.models.registry import MULTIMODAL_LANGUAGE_MODELS, resolve_architecture
from kvserve.quantization.hub_format import QuantConfig
from kvserve.sampling_params import SamplingParams
from kvserve.vllm_flags import take_vllm_options

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_KV_CACHE_MEMORY = 2 * GiB  # at most, where kv_cache_memory is not given
SCHEDULER_POLICIES = ("chunked", "prefill_first")
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
PREEMPTION_MODES = ("auto", "swap", "recompute")
DEFAULT_MAX_WAITING_REQUESTS = 1024  # server: queued requests beyond this get 503
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # server: larger request bodies get 413
# generation_config.json's sampling fields, each the default of a SamplingParams field
GENERATION_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                              "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                              "max_new_tokens": "max_tokens"}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP's shape: in `sparse_layers`, each token's MLP is the sum of its
    `top_k` experts' outputs, weighted by the router's softmax over `num_experts`."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights are scaled to sum to 1 (Mixtral; Qwen's norm_topk_prob)
    sparse_layers: tuple[int, ...]  # the others have a dense MLP of ModelConfig's size
    # Qwen2-MoE's expert that every token goes through, its output gated by a sigmoid: 0 if none.
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, raw: dict[str, Any], flavor: str, num_layers: int) -> MoEConfig:
        """Mixtral spells the experts `num_local_experts` of `intermediate_size`, every layer
        sparse; Qwen `num_experts` of `moe_intermediate_size`, the layers set by
        `decoder_sparse_step` and `mlp_only_layers`."""
        mixtral = flavor == "mixtral"
        fields = {"num_experts_per_tok": raw.get("num_experts_per_tok"),
                  "num_local_experts" if mixtral else "num_experts":
                      raw.get("num_local_experts" if mixtral else "num_experts"),
                  "intermediate_size" if mixtral else "moe_intermediate_size":
                      raw.get("intermediate_size" if mixtral else "moe_intermediate_size"),
                  "decoder_sparse_step": 1 if mixtral else raw.get("decoder_sparse_step", 1)}
        for name, value in fields.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointError(f"model: config.json field {name!r} must be a positive "
                                      f"integer, got {value!r}")
        top_k, num_experts, size, step = fields.values()
        if top_k > num_experts:
            raise CheckpointError(f"model: num_experts_per_tok ({top_k}) exceeds the "
                                  f"{num_experts} experts")
        dense = set() if mixtral else set(raw.get("mlp_only_layers") or ())
        shared = 0 if mixtral else int(raw.get("shared_expert_intermediate_size") or 0)
        return cls(num_experts=num_experts, top_k=top_k, intermediate_size=size,
                   renormalize=mixtral or bool(raw.get("norm_topk_prob", False)),
                   sparse_layers=tuple(i for i in range(num_layers)
                                       if i not in dense and (i + 1) % step == 0),
                   shared_expert_intermediate_size=shared)

    def shard(self, num_ranks: int) -> MoEConfig:
        """One tensor-parallel rank's share: every expert's columns split as a dense MLP's."""
        for name in ("intermediate_size", "shared_expert_intermediate_size"):
            if getattr(self, name) % num_ranks:
                raise ValueError(f"tensor_parallel_size ({num_ranks}) must divide the model's "
                                 f"expert {name} ({getattr(self, name)})")
        return replace(self, intermediate_size=self.intermediate_size // num_ranks,
                       shared_expert_intermediate_size=(self.shared_expert_intermediate_size
                                                        // num_ranks))


@dataclass(frozen=True)
class ModelConfig:
    """The shapes and options of a decoder-only transformer, read from a HF `config.json`."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    # The frequency scaling's parameters, resolved (see `_rope_parameters`); None if unscaled.
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()
    rotary_dim: int = 0  # the leading dimensions of a head that rotate; 0 = all of them
    # Gemma's departures from Llama (the defaults are Llama's):
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_pytorch_tanh
    norm_offset: float = 0.0  # the files hold RMSNorm weights less this (Gemma: 1)
    embedding_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    sandwich_norms: bool = False  # attention's and the MLP's outputs are normed too
    attention_scale: float | None = None  # of q.k; None: head_dim ** -0.5
    # With a sliding window, the layers that attend without it; the others use
    # `local_rope_theta` where it is given (Gemma 3's local layers).
    full_attention_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # the same, of attention scores (Gemma 2)
    # The language model of a multimodal checkpoint, served alone (its other towers skipped).
    multimodal: bool = False
    quantization: QuantConfig | None = None  # a quantized checkpoint's format
    moe: MoEConfig | None = None  # a mixture-of-experts model's experts

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: str = "auto",
                        device: str = "cpu") -> ModelConfig:
        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"model: no config.json in {str(folder)!r}")
        try:
            raw = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"model: config.json in {str(folder)!r} is not valid JSON: {e}") from None
        language_model = next((MULTIMODAL_LANGUAGE_MODELS[name] for name in
                               raw.get("architectures") or []
                               if name in MULTIMODAL_LANGUAGE_MODELS), None)
        if language_model is not None:
            raw = _language_model_config(folder, raw, language_model)
        arch = resolve_architecture(raw.get("architectures"))
        for name in _REQUIRED:
            if not isinstance(raw.get(name), int) or raw[name] < 1:
                raise CheckpointError(f"model: config.json field {name!r} must be a positive "
                                      f"integer, got {raw.get(name)!r}")
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise CheckpointError(
                f"model: num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})")
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        max_positions = int(raw.get("max_position_embeddings", 2048))
        num_layers = int(raw["num_hidden_layers"])
        gemma = _gemma_fields(raw, hidden, num_layers, arch.gemma) if arch.gemma else {}
        hidden_act = _activation(raw, bool(arch.gemma), arch.moe is not None)
        rope = _rope_parameters(gemma.pop("rope", raw), dict(arch.rope_aliases), head_dim,
                                max_positions)
        rotary_dim = rope.pop("rotary_dim")
        sliding_window = raw.get("sliding_window") if arch.uses_sliding_window(raw) else None
        moe = MoEConfig.from_hf(raw, arch.moe, num_layers) if arch.moe else None
        quantization = (QuantConfig.from_hf(raw["quantization_config"])
                        if raw.get("quantization_config") else None)
        return cls(
            path=str(folder),
            architecture=arch.name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.pop("rope_theta", 10000.0)),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch.qkv_bias or bool(raw.get("attention_bias", False)),
            qk_norm=arch.qk_norm,
            sliding_window=int(sliding_window) if sliding_window else None,
            dtype=resolve_dtype(dtype, raw, device),
            eos_token_ids=_eos_ids(raw, folder),
            rotary_dim=rotary_dim,
            hidden_act=hidden_act,
            quantization=quantization,
            moe=moe,
            multimodal=language_model is not None,
            **gemma,
        )

    def shard(self, num_ranks: int) -> ModelConfig:
        """One tensor-parallel rank's share: its attention heads, KV heads and MLP columns."""
        if num_ranks == 1:
            return self
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) % num_ranks:
                raise ValueError(f"tensor_parallel_size ({num_ranks}) must divide the model's "
                                 f"{name} ({getattr(self, name)})")
        return replace(self, num_heads=self.num_heads // num_ranks,
                       num_kv_heads=self.num_kv_heads // num_ranks,
                       intermediate_size=self.intermediate_size // num_ranks,
                       moe=self.moe.shard(num_ranks) if self.moe else None)

    @property
    def mlp_columns_per_token(self) -> int:
        """The MLP columns one token multiplies through, summed over the layers: a dense
        layer's intermediate size, a sparse one's top-k experts' and shared expert's."""
        moe = self.moe
        if moe is None:
            return self.num_layers * self.intermediate_size
        sparse = len(moe.sparse_layers)
        return ((self.num_layers - sparse) * self.intermediate_size + sparse * (
            moe.top_k * moe.intermediate_size + moe.shared_expert_intermediate_size))

    @property
    def max_positions(self) -> int:
        """The longest sequence the model takes: max_position_embeddings, stretched by a
        linear or YaRN scaling's factor (as vLLM reads them; llama3's and LongRoPE's
        max_position_embeddings already count theirs)."""
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type")
        if kind == "linear":
            return int(self.max_position_embeddings * scaling["factor"])
        if kind == "yarn":
            return max(self.max_position_embeddings,
                       int(scaling["original_max_position_embeddings"] * scaling["factor"]))
        return self.max_position_embeddings

    @property
    def kv_bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


# The options that tune speculative decoding: only meaningful with a speculative model.
SPECULATIVE_TUNING = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def _speculative_config(model: str | None, num_speculative_tokens: int | None,
                        prompt_lookup_min: int | None, prompt_lookup_max: int | None,
                        dtype: str, device: str) -> SpeculativeConfig | None:
    """`model`: None (off), "ngram", or a draft model's checkpoint folder. The other options
    tune it, so giving one without it is an error rather than a silent no-op."""
    tuning = {name: value for name, value in zip(
        SPECULATIVE_TUNING, (num_speculative_tokens, prompt_lookup_min, prompt_lookup_max),
        strict=True) if value is not None}
    if model is None:
        if tuning:
            raise ValueError(f"{', '.join(tuning)}: speculative decoding is off; set "
                             f"speculative_model ('ngram' or a draft model's folder) too")
        return None
    if model != "ngram" and not Path(model).is_dir():
        raise ValueError(f"speculative_model must be 'ngram', a draft model's checkpoint "
                         f"folder or its Hugging Face Hub id, got {model!r}")
    draft = None if model == "ngram" else ModelConfig.from_pretrained(model, dtype, device)
    return SpeculativeConfig(**tuning, draft=draft)


def resolve_dtype(dtype: str | torch.dtype, raw: dict[str, Any], device: str = "cpu"
                  ) -> torch.dtype:
    """`auto` is the checkpoint's dtype, except:
    - on CUDA, float32 checkpoints run in bfloat16: tensor cores have no float32 rate worth
      serving at;
    - on CPU, every checkpoint runs in bfloat16 where the CPU multiplies it natively
      (AVX512-BF16 or AMX: half the bytes per decode step, and faster GEMMs) and in float32
      where it does not (bfloat16 is then emulated, several times slower than float32)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if dtype == "auto":
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
        if device.startswith("cuda") and _DTYPES.get(dtype) == torch.float32:
            dtype = "bfloat16"
        elif device == "cpu" and dtype in _DTYPES:
            native = cpu_has_native_bf16()
            dtype = "bfloat16" if native else "float32"
            logger.info("dtype auto: %s (%s)", dtype, "the CPU multiplies bfloat16 natively"
                        if native else "no AVX512-BF16 or AMX on this CPU")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return _DTYPES[dtype]


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """Environment variable `name`, which must be one of `choices` (the first, when unset)."""
    choice = os.environ.get(name, choices[0])
    if choice not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {choice!r}")
    return choice


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bfloat16 matmul instructions (AVX512-BF16 or AMX-BF16), from
    /proc/cpuinfo's flags (False where there is none). `KVSERVE_CPU_BF16=0` or `1` overrides
    it, to reproduce float32 results on any machine."""
    forced = os.environ.get("KVSERVE_CPU_BF16")
    if forced is not None:
        return forced == "1"
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_flags() -> set[str]:
    """The CPU's feature flags, as /proc/cpuinfo lists them (none where it does not)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in cpuinfo.splitlines()
                 if line.startswith("flags")), set())


def _language_model_config(folder: Path, raw: dict[str, Any], architecture: str
                           ) -> dict[str, Any]:
    """A multimodal checkpoint's text config, with the defaults transformers fills in (hub
    files list only the fields that differ from them), as the config of `architecture`."""
    from transformers import AutoConfig

    try:
        text = AutoConfig.from_pretrained(folder).get_text_config().to_dict()
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"model: cannot read the text config of {str(folder)!r}: "
                              f"{e}") from None
    for key in ("eos_token_id", "tie_word_embeddings", "quantization_config", "dtype",
                "torch_dtype"):
        if key in raw:
            text[key] = raw[key]
    return text | {"architectures": [architecture]}


def _activation(raw: dict[str, Any], gemma: bool, moe: bool) -> str:
    """The MLP's activation: SiLU, or (dense MLPs only) the tanh GELU Gemma uses."""
    act = raw.get("hidden_activation" if gemma else "hidden_act") or (
        "gelu_pytorch_tanh" if gemma else "silu")
    act = {"swish": "silu", "gelu_new": "gelu_pytorch_tanh"}.get(act, act)
    supported = ("silu",) if moe else ("silu", "gelu_pytorch_tanh")
    if act not in supported:
        raise CheckpointError(f"model: config.json hidden_act {act!r} is not supported "
                              f"(supported: {', '.join(supported)})")
    return act


def _gemma_fields(raw: dict[str, Any], hidden: int, num_layers: int, version: int
                  ) -> dict[str, Any]:
    """Gemma 2's or 3's ModelConfig fields, with transformers' defaults for each version,
    and under "rope" the config with its full-attention layers' rotary parameters where a
    Llama config has them."""
    if raw.get("use_bidirectional_attention"):
        raise CheckpointError("model: use_bidirectional_attention is not supported")
    layer_types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % raw.get("sliding_window_pattern",
                                              6 if version == 3 else 2) == 0
        else "sliding_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or not set(layer_types) <= {"full_attention",
                                                                  "sliding_attention"}:
        raise CheckpointError(f"model: layer_types must give each of the {num_layers} layers "
                              "full_attention or sliding_attention")
    params = raw.get("rope_parameters") or {}
    nested = "full_attention" in params or "sliding_attention" in params
    full = dict((params.get("full_attention") or {}) if nested else params)
    local = dict(params.get("sliding_attention") or {}) if nested else {}
    full.setdefault("rope_theta", raw.get("rope_theta", 1e6 if version == 3 else 1e4))
    if local.get("rope_type", "default") != "default":
        raise CheckpointError("model: the sliding layers' rope_type must be default")
    rope = {key: value for key, value in raw.items() if key != "rope_parameters"}
    rope["rope_scaling"] = full | (raw.get("rope_scaling") or {})
    # Gemma 2 caps logits unless its config says null; Gemma 3 never by default.
    caps = {name: raw.get(name, default if version == 2 else None) for name, default in
            (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0))}
    return {"norm_offset": 1.0, "embedding_scale": hidden ** 0.5, "sandwich_norms": True,
            "attention_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
            "full_attention_layers": tuple(i for i, kind in enumerate(layer_types)
                                           if kind == "full_attention"),
            "local_rope_theta": float(local.get("rope_theta",
                                                raw.get("rope_local_base_freq", 10_000.0)))
            if version == 3 else None,
            **{name: float(cap) if cap else None for name, cap in caps.items()},
            "rope": rope}


def _rope_parameters(raw: dict[str, Any], aliases: dict[str, str], head_dim: int,
                     max_positions: int) -> dict[str, Any]:
    """The rotary embedding's parameters as transformers resolves them: the pre-5.0
    (`rope_theta` + `rope_scaling`) and 5.0 (`rope_parameters`) spellings merged, the
    original context and the attention factor filled in, and `rotary_dim` from
    `partial_rotary_factor`."""
    params = dict(raw.get("rope_parameters") or {})
    params.update(raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.pop("type", None)
    kind = params.setdefault("rope_type", kind or "default")
    kind = params["rope_type"] = aliases.get(kind, kind)
    if kind not in ROPE_TYPES:
        raise CheckpointError(f"model: rope_scaling type {kind!r} is not supported "
                              f"(supported: {', '.join(ROPE_TYPES)})")
    partial = params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise CheckpointError(f"model: partial_rotary_factor {partial!r} of head_dim "
                              f"{head_dim} must give an even number of rotated dimensions")
    params["rotary_dim"] = rotary_dim
    if kind in ("default", "linear"):
        return params
    # Phi-3 keeps its pretraining context beside max_position_embeddings; that one counts.
    original = int(raw.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings") or max_positions)
    params["original_max_position_embeddings"] = original
    if kind in ("yarn", "longrope"):
        factor = params.get("factor") or max_positions / original
        if not isinstance(factor, int | float) or factor <= 0:
            raise CheckpointError(f"model: rope_scaling factor must be a positive number, "
                                  f"got {factor!r}")
        params["factor"] = float(factor)
        if params.get("attention_factor") is None:
            params["attention_factor"] = _attention_factor(kind, params, factor, original)
    if kind == "longrope":
        for name in ("short_factor", "long_factor"):
            factors = params.get(name)
            if not isinstance(factors, list) or len(factors) != rotary_dim // 2:
                raise CheckpointError(f"model: rope_scaling {name} must be a list of "
                                      f"{rotary_dim // 2} numbers (one a rotated pair)")
    return params


def _attention_factor(kind: str, params: dict[str, Any], factor: float, original: int
                      ) -> float:
    """How much YaRN and LongRoPE scale cos and sin, where the config does not say."""
    if kind == "longrope":
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    return mscale(factor)


def _read_generation_config(folder: Path) -> dict[str, Any]:
    """A checkpoint folder's generation_config.json; {} where it has none."""
    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"model: {file.name} in {str(folder)!r} is not valid JSON: "
                              f"{e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"model: {file.name} in {str(folder)!r} must hold a JSON object, "
                              f"got {type(raw).__name__}")
    return raw


def _eos_ids(raw: dict[str, Any], folder: Path) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (_read_generation_config(folder), raw):
        eos = src.get("eos_token_id")
        for t in eos if isinstance(eos, list) else [eos]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return tuple(ids)


def sampling_defaults(model: str, generation_config: str = "auto",
                      overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The values a request that leaves a sampling field out gets (vLLM's
    `--generation-config`): the model author's, from the checkpoint's generation_config.json
    ("auto"); those of another folder's file; or none ("vllm": SamplingParams' own). Then
    `overrides`, in the file's names. Each is checked as a request's would be."""
    raw: dict[str, Any] = {}
    source = "generation_config"
    if generation_config != "vllm":
        folder = Path(model if generation_config == "auto" else generation_config)
        if generation_config != "auto" and not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config must be auto, vllm or a folder holding a "
                             f"generation_config.json, got {generation_config!r}")
        raw, source = _read_generation_config(folder), str(folder / "generation_config.json")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(GENERATION_SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: {', '.join(unknown)} not among "
                         f"{', '.join(GENERATION_SAMPLING_FIELDS)}")
    raw.update(overrides)
    defaults: dict[str, Any] = {}
    for key, name in GENERATION_SAMPLING_FIELDS.items():
        if raw.get(key) is None:
            continue
        where, error = (("override_generation_config", ValueError) if key in overrides
                        else (source, CheckpointError))
        value = raw[key]
        kind = int if name in ("top_k", "max_tokens") else int | float
        if isinstance(value, bool) or not isinstance(value, kind):
            raise error(f"{where}: {key} must be {'an integer' if kind is int else 'a number'}, "
                        f"got {value!r}")
        try:
            defaults[name] = getattr(SamplingParams(**{name: value}), name)
        except ValueError as e:
            raise error(f"{where}: {key}: {e}") from None
    return defaults


def resolve_chat_template(chat_template: str | None) -> str | None:
    """vLLM's `--chat-template`: a Jinja template given inline (it holds a `{`), or the file
    that holds one; checked for syntax here, at start-up, not at the first chat request."""
    if chat_template is None:
        return None
    text = chat_template
    if "{" not in chat_template:
        try:
            text = Path(chat_template).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template: neither a Jinja template nor a readable file: "
                             f"{e}") from None
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a valid Jinja template (line {e.lineno}: "
                         f"{e.message})") from None
    return text


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # None: EngineConfig.num_kv_blocks picks the size
    # CUDA, where kv_cache_memory is not given: the share of the device's memory that the
    # weights, a step's activations and the KV pool may take together; the pool gets the rest.
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    swap_space: int = 4 * GiB  # host memory that holds the KV of requests preempted by swap
    kv_offload_host: int = 0  # host memory for prefix-cache blocks evicted from the pool
    kv_offload_dir: str | None = None  # a disk tier below that host tier
    kv_offload_disk: int = 16 * GiB  # the disk tier's size
    # StreamingLLM: every request keeps the blocks of its first `attention_sinks` tokens
    # and its newest `streaming_window` blocks, so a stream can run without end.
    streaming_window: int = 0  # blocks; 0: off
    attention_sinks: int | None = None  # tokens (whole blocks kept); default 4 with a window
    # CacheBlend: the share of a segmented prompt's reused chunk tokens whose KV is computed
    # again in context (those whose KV deviates most), to restore cross-chunk attention.
    blend_recompute_ratio: float = 0.15

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], "
                             f"got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        for name in ("swap_space", "kv_offload_host", "kv_offload_disk"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 bytes, got {getattr(self, name)}")
        if self.kv_offload_dir is not None and not self.kv_offload_host:
            raise ValueError("kv_offload_dir needs kv_offload_host > 0: the disk tier is "
                             "filled from, and read back through, the host tier")
        if not 0.0 <= self.blend_recompute_ratio <= 1.0:
            raise ValueError(f"blend_recompute_ratio must be in [0, 1], "
                             f"got {self.blend_recompute_ratio}")
        if self.streaming_window < 0 or self.streaming_window == 1:
            raise ValueError(f"streaming_window must be 0 (off) or >= 2 blocks, "
                             f"got {self.streaming_window}")
        if self.attention_sinks is not None:
            if not self.streaming_window:
                raise ValueError("attention_sinks needs a streaming_window")
            if self.attention_sinks < 0:
                raise ValueError(f"attention_sinks must be >= 0 tokens, "
                                 f"got {self.attention_sinks}")
        if self.streaming_window and self.enable_prefix_caching:
            raise ValueError("streaming_window rotates cached keys in place as the window "
                             "slides, so they cannot be shared: it needs "
                             "enable_prefix_caching=False (--no-enable-prefix-caching)")
        if (self.kv_offload_host or self.kv_offload_dir) and not self.enable_prefix_caching:
            raise ValueError("kv_offload_host and kv_offload_dir keep prefix-cache blocks: "
                             "they need enable_prefix_caching")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    policy: str = "chunked"  # or "prefill_first" (see core/scheduler/scheduler.py)
    scheduling_policy: str = "fcfs"  # who goes first (see core/scheduler/policy.py)
    preemption_mode: str = "auto"  # what happens to a preempted request's KV
    # A disaggregated cluster's prefill replica: a request stops after its first token, its
    # KV held until it moves to a decode replica.
    prefill_only: bool = False
    # With a draft model: the tokens after each sampling chunk whose slots are allocated too,
    # where the draft model writes its KV as it drafts.
    draft_lookahead: int = 0

    def __post_init__(self) -> None:
        for name, choices in (("policy", SCHEDULER_POLICIES),
                              ("scheduling_policy", SCHEDULING_POLICIES),
                              ("preemption_mode", PREEMPTION_MODES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, "
                                 f"got {getattr(self, name)!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, "
                             f"got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")

    @property
    def max_num_tokens_per_step(self) -> int:
        """The most tokens one step can schedule: the budget, except that prefill_first
        runs a prompt whole whatever its length."""
        if self.policy == "prefill_first":
            return max(self.max_num_batched_tokens, self.max_model_len)
        return self.max_num_batched_tokens


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a decode step also verifies up to `num_speculative_tokens`
    drafted tokens, and keeps those the model agrees with. `ngram` (prompt lookup) drafts the
    tokens that followed the sequence's last `prompt_lookup_max` ... `prompt_lookup_min`
    tokens where they occurred before; a `draft` model drafts its greedy tokens."""

    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft: ModelConfig | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) and "
                             f"prompt_lookup_max ({self.prompt_lookup_max}) must satisfy "
                             "1 <= min <= max")

    @property
    def method(self) -> str:
        return "ngram" if self.draft is None else "draft_model"


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    device: str = "cpu"
    enforce_eager: bool = False  # no CUDA graphs, no CPU decode stack: every layer from Python
    max_graph_tokens: int = 1024  # the largest step with prefill chunks that replays a graph
    tensor_parallel_size: int = 1  # ranks, each with 1/T of the heads and MLP columns
    speculative: SpeculativeConfig | None = None
    lora_modules: dict[str, str] = field(default_factory=dict)  # LoRA name -> PEFT folder
    max_loras: int = 8  # adapters loaded at once
    # Schedule step N+1 while the device runs step N (see EngineCore). None: on where it
    # pays and runs, a single CUDA device.
    async_scheduling: bool | None = None
    # What requests that leave a sampling field out get (see `sampling_defaults`).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # in place of the tokenizer's own
    tokenizer: str | None = None  # a folder holding the tokenizer, in place of the model's

    def __post_init__(self) -> None:
        check_device_name(self.device)
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_graph_tokens < 0:
            raise ValueError(f"max_graph_tokens must be >= 0, got {self.max_graph_tokens}")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(f"lora_modules names {len(self.lora_modules)} adapters, more than "
                             f"max_loras ({self.max_loras})")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        self.model.shard(self.tensor_parallel_size)  # raises if the heads do not divide
        for name in ("swap_space", "kv_offload_host", "kv_offload_disk"):
            size = getattr(self.cache, name)
            if 0 < size < self.kv_bytes_per_block:  # vLLM's swap_space=4 means 4 GiB
                raise ValueError(f"{name} ({size} bytes) holds no KV block, of "
                                 f"{self.kv_bytes_per_block} bytes: it is a size in bytes "
                                 f"(4 GiB: 4 << 30); 0 turns it off")
        limit = self.model.max_positions
        if self.scheduler.max_model_len == 0 or self.scheduler.max_model_len > limit:
            if self.scheduler.max_model_len > limit:
                raise ValueError(f"max_model_len must be <= the model's context ({limit}: "
                                 f"max_position_embeddings, times a linear or YaRN rope "
                                 f"scaling's factor), got {self.scheduler.max_model_len}")
            self.scheduler.max_model_len = limit
        cache_len = (self.sink_blocks + self.cache.streaming_window) * self.cache.block_size
        if cache_len > self.scheduler.max_model_len:
            raise ValueError(f"attention sinks and streaming_window keep up to {cache_len} "
                             f"tokens in the cache, beyond max_model_len "
                             f"({self.scheduler.max_model_len}), the positions a request's "
                             "cache may span")
        if self.speculative is not None:
            self._check_speculative(self.speculative)
        self._resolve_async_scheduling()

    def check_device(self) -> None:
        """Kept out of `__post_init__` so that configs for CUDA can be built anywhere."""
        check_device(self.device, self.tensor_parallel_size)

    def _resolve_async_scheduling(self) -> None:
        blocker = ("tensor_parallel_size > 1" if self.tensor_parallel_size > 1
                   else "speculative decoding" if self.speculative is not None
                   else "a streaming_window" if self.cache.streaming_window else None)
        if self.async_scheduling is None:
            self.async_scheduling = blocker is None and self.device.startswith("cuda")
        elif self.async_scheduling and blocker is not None:
            raise ValueError(f"async_scheduling does not run with {blocker}")

    def _check_speculative(self, spec: SpeculativeConfig) -> None:
        if self.cache.streaming_window:
            raise ValueError("speculative decoding does not run with a streaming_window")
        draft = spec.draft
        if draft is None:
            return
        try:
            draft.shard(self.tensor_parallel_size)
        except ValueError as e:
            raise ValueError(f"speculative_model: {e}") from None
        if draft.vocab_size != self.model.vocab_size:
            raise ValueError(f"speculative_model: the draft's vocab_size ({draft.vocab_size}) "
                             f"must equal the model's ({self.model.vocab_size})")
        if draft.sliding_window != self.model.sliding_window:
            raise ValueError(f"speculative_model: the draft's sliding_window "
                             f"({draft.sliding_window}) must equal the model's "
                             f"({self.model.sliding_window})")
        if draft.max_positions < self.scheduler.max_model_len:
            raise ValueError(f"speculative_model: the draft's context "
                             f"({draft.max_positions} positions) must be >= max_model_len "
                             f"({self.scheduler.max_model_len})")
        self.scheduler.draft_lookahead = spec.num_speculative_tokens

    @classmethod
    def from_options(cls, model: str, options: dict[str, Any]) -> EngineConfig:
        """`create`, from the keywords a caller gave `LLM(...)` or `AsyncLLM(...)`: vLLM's
        taken as kvserve's where their meaning holds (`take_vllm_options`), and one neither
        takes named with the nearest it does (rather than create's bare TypeError)."""
        options = take_vllm_options(options)
        known = [name for name in inspect.signature(cls.create).parameters
                 if name not in ("cls", "model")]
        for name in options:
            if name not in known:
                near = difflib.get_close_matches(name, known, n=1)
                raise ValueError(f"{name} is not an engine option"
                                 + (f" (did you mean {near[0]}?)" if near else "")
                                 + "; see 'Engine options' in the README")
        return cls.create(model, **options)

    @classmethod
    def create(cls, model: str, dtype: str = "auto", max_num_batched_tokens: int = 2048,
               max_num_seqs: int = 128, block_size: int = 16,
               kv_cache_memory: int | None = None, gpu_memory_utilization: float = 0.9,
               max_model_len: int | None = None,
               seed: int = 0, device: str = "cpu", scheduler_policy: str = "chunked",
               enable_prefix_caching: bool = True, enforce_eager: bool = False,
               max_graph_tokens: int = 1024, scheduling_policy: str = "fcfs",
               preemption_mode: str = "auto",
               swap_space: int = 4 * GiB, kv_offload_host: int = 0,
               kv_offload_dir: str | None = None, kv_offload_disk: int = 16 * GiB,
               streaming_window: int = 0, attention_sinks: int | None = None,
               prefill_only: bool = False, tensor_parallel_size: int = 1,
               speculative_model: str | None = None,
               num_speculative_tokens: int | None = None,
               prompt_lookup_min: int | None = None, prompt_lookup_max: int | None = None,
               lora_modules: dict[str, str] | None = None, max_loras: int = 8,
               blend_recompute_ratio: float = 0.15,
               async_scheduling: bool | None = None, generation_config: str = "auto",
               override_generation_config: dict[str, Any] | None = None,
               chat_template: str | None = None, revision: str | None = None,
               download_dir: str | None = None, tokenizer: str | None = None
               ) -> EngineConfig:
        """The engine options of the offline and server APIs, with their defaults. `model`
        (and `speculative_model` and `tokenizer`) is a checkpoint folder or a Hugging Face
        Hub model id, the model's at `revision`, downloaded to `download_dir` (default: the
        Hub's cache)."""
        model = resolve_model(model, revision, download_dir)
        if tokenizer is not None:
            tokenizer = resolve_model(tokenizer, None, download_dir, "tokenizer")
        if speculative_model not in (None, "ngram"):
            speculative_model = resolve_model(speculative_model, None, download_dir,
                                              "speculative_model")
        return cls(
            model=ModelConfig.from_pretrained(model, dtype, device),
            cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                              gpu_memory_utilization=gpu_memory_utilization,
                              enable_prefix_caching=enable_prefix_caching,
                              swap_space=swap_space, kv_offload_host=kv_offload_host,
                              kv_offload_dir=kv_offload_dir,
                              kv_offload_disk=kv_offload_disk,
                              streaming_window=streaming_window,
                              attention_sinks=attention_sinks,
                              blend_recompute_ratio=blend_recompute_ratio),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                      max_num_seqs=max_num_seqs,
                                      max_model_len=max_model_len or 0,
                                      policy=scheduler_policy,
                                      scheduling_policy=scheduling_policy,
                                      preemption_mode=preemption_mode,
                                      prefill_only=prefill_only),
            seed=seed,
            device=device,
            enforce_eager=enforce_eager,
            max_graph_tokens=max_graph_tokens,
            tensor_parallel_size=tensor_parallel_size,
            speculative=_speculative_config(speculative_model, num_speculative_tokens,
                                            prompt_lookup_min, prompt_lookup_max, dtype,
                                            device),
            lora_modules=dict(lora_modules or {}),
            max_loras=max_loras,
            async_scheduling=async_scheduling,
            sampling_defaults=sampling_defaults(model, generation_config,
                                                override_generation_config),
            chat_template=resolve_chat_template(chat_template),
            tokenizer=tokenizer,
        )

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model.path

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative is not None else 0

    @property
    def sink_blocks(self) -> int:
        """Blocks holding the attention sinks, kept while the window slides."""
        if not self.cache.streaming_window:
            return 0
        sinks = 4 if self.cache.attention_sinks is None else self.cache.attention_sinks
        return -(-sinks // self.cache.block_size)

    @property
    def kv_bytes_per_block(self) -> int:
        """Of one rank's share of a block (its KV heads), which the host and disk tiers'
        sizes count in."""
        return self.model.kv_bytes_per_token * self.cache.block_size // self.tensor_parallel_size

    @property
    def pool_bytes_per_block(self) -> int:
        """What a block takes of `kv_cache_memory`: its KV, and a draft model's. (The tiers
        keep the model's KV only: a draft model recomputes its own after a swap or a hit
        there.)"""
        per_block = self.kv_bytes_per_block
        if self.speculative is not None and self.speculative.draft is not None:
            per_block += (self.speculative.draft.kv_bytes_per_token * self.cache.block_size
                          // self.tensor_parallel_size)
        return per_block

    @property
    def num_host_kv_blocks(self) -> int:
        """Blocks of swap space; none when preemption always recomputes."""
        if self.scheduler.preemption_mode == "recompute":
            return 0
        return self.cache.swap_space // self.kv_bytes_per_block

    @property
    def num_offload_kv_blocks(self) -> int:
        """Blocks of the host tier for evicted prefix-cache blocks."""
        return self.cache.kv_offload_host // self.kv_bytes_per_block

    @property
    def num_disk_kv_blocks(self) -> int:
        if self.cache.kv_offload_dir is None:
            return 0
        return self.cache.kv_offload_disk // self.kv_bytes_per_block

    @property
    def replays_graphs(self) -> bool:
        """Whether steps may replay CUDA graphs: not under enforce_eager or tensor
        parallelism, nor for a mixture-of-experts model, whose forward reads its experts'
        row counts back from the device."""
        return not self.enforce_eager and self.tensor_parallel_size == 1 and not self.model.moe

    @property
    def graph_tokens(self) -> int:
        """The largest step with prefill chunks that replays a CUDA graph, where graphs run
        (`replays_graphs`): 0 when none does."""
        if not self.replays_graphs:
            return 0
        return min(self.max_graph_tokens, self.scheduler.max_num_tokens_per_step)

    @property
    def sized_by_device_memory(self) -> bool:
        """Whether the model runner sizes the pool from the GPU's free memory once the weights
        are loaded (`kv_pool.blocks_in_device_memory`), rather than `num_kv_blocks`."""
        return self.cache.kv_cache_memory is None and self.device.startswith("cuda")

    @property
    def most_blocks_used(self) -> int:
        """What max_num_seqs requests of max_model_len tokens fill at once: a default pool
        is no larger, so that a small model's is megabytes, which a start zero-fills in
        milliseconds where 2 GiB took 0.3-1.8 s."""
        per_request = -(-(self.scheduler.max_model_len + self.scheduler.draft_lookahead)
                        // self.cache.block_size)
        return self.scheduler.max_num_seqs * per_request

    @property
    def num_kv_blocks(self) -> int:
        """kv_cache_memory's worth of blocks; where it is not given, DEFAULT_KV_CACHE_MEMORY's
        up to `most_blocks_used` (on CUDA the runner sizes it instead, see
        `sized_by_device_memory`)."""
        per_block = self.pool_bytes_per_block
        given = self.cache.kv_cache_memory
        memory = DEFAULT_KV_CACHE_MEMORY if given is None else given
        num_blocks = memory // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory ({memory} bytes) must hold at least one block "
                             f"of {per_block} bytes")
        if given is None:
            num_blocks = min(num_blocks, self.most_blocks_used)
        return int(num_blocks)
