"""The Llama-family decoder (Llama, Mistral, Phi-3, Qwen2, Qwen3, Gemma 2 and 3, and the
mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE): pure math over flat token batches.
Built from one tensor-parallel rank's `ModelConfig.shard`, it holds that rank's heads and MLP
(or experts') columns; embedding, norms, routers and LM head are whole on every rank.

Inputs are all the step's tokens flattened to [N]; attention finds each token's sequence and
cache slots through the forward context, so prefill chunks and decodes share one forward.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend, QKNorm
from kvserve.config import ModelConfig
from kvserve.layers.linear import Linear
from kvserve.layers.norm import RMSNorm, rms_norm_heads
from kvserve.layers.rotary import RotaryEmbedding, to_interleaved
from kvserve.models.mlp import MLP
from kvserve.models.moe import SparseMoeBlock
from kvserve.worker.forward_context import get_attention_metadata, get_selective_recompute

_ROTATED = re.compile(r"\.(q_proj|k_proj|q_norm|k_norm)\.(weight|bias)$")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], cfg.qkv_bias,
                               cfg.dtype, parallel="column")
        self.o_proj = Linear(q_size, [cfg.hidden_size], False, cfg.dtype, parallel="row")
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype) if cfg.qk_norm else None
        self.scale = cfg.attention_scale or cfg.head_dim ** -0.5
        # Gemma's global layers attend past the window its local layers keep to.
        self.full_attention = index in cfg.full_attention_layers
        self.backend = backend
        self.kv_cache = torch.empty(0)  # bound by the model runner to this layer's pool

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None and self.backend.fuses_qk_norm:
            qk_norm = QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        qk, v = self.project(x, norm=qk_norm is None)
        meta = get_attention_metadata()
        if self.full_attention and meta.sliding_window:
            meta = replace(meta, sliding_window=None)
        out = self.backend.forward(qk, v, freqs_cis, self.kv_cache, meta, self.scale, qk_norm)
        return self.o_proj(out)

    def project(self, x: torch.Tensor, norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' queries then keys [N, Hq + Hkv, D] (normed unless not `norm`, not yet
        rotated), and their values [N, Hkv, D]."""
        heads = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)
        num_qk = self.num_heads + self.num_kv_heads
        qk, v = heads[:, :num_qk], heads[:, num_qk:]
        if norm and self.q_norm is not None and self.k_norm is not None:
            qk = rms_norm_heads(qk, self.num_heads, self.q_norm, self.k_norm)
        return qk, v


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> None:
        super().__init__()
        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, backend, index)
        # Llama's norm before the MLP, where attention's output is added; Gemma's norm of
        # attention's output, before it is added.
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if cfg.sandwich_norms else None
        # Gemma 3's local layers turn by their own rotary embedding (the model's `local_rotary`).
        self.uses_local_rotary = (cfg.local_rope_theta is not None
                                  and not self.self_attn.full_attention)
        self.mlp: MLP | SparseMoeBlock
        if cfg.moe is not None and index in cfg.moe.sparse_layers:
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe, cfg.dtype)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.dtype, act=cfg.hidden_act)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns this layer's output and the residual stream before it: the add of one
        layer happens in the next one's norm (a single kernel on CUDA)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, freqs_cis)
        if self.pre_feedforward_layernorm is None:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        assert self.post_feedforward_layernorm is not None
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class LlamaForCausalLM(nn.Module):
    # Checkpoint tensor names that are slices of one fused layer here: name -> (layer, shard);
    # Mixtral's experts call gate, down and up w1, w2 and w3.
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
        "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0),
    }
    # Checkpoint module names that are another module's here (Mixtral's MoE block).
    renamed_modules = {"block_sparse_moe": "mlp"}
    # Checkpoint tensors that hold several of the above at once (Phi-3's), in shard order:
    # the loader splits them into those.
    fused_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                     "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 max_model_len: int | None = None) -> None:
        """`max_model_len`: the longest sequence served (LongRoPE picks its factors by it);
        the model's whole context where not given."""
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, index)
                                    for index in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size], False, cfg.dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_positions, cfg.rope_theta,
                                      cfg.rope_scaling, cfg.rotary_dim, max_model_len)
        self.local_rotary = None if cfg.local_rope_theta is None else RotaryEmbedding(
            cfg.head_dim, cfg.max_positions, cfg.local_rope_theta, None, cfg.rotary_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, hidden] for a flat batch of tokens; with blended prompts, of the
        rows that went on (see worker/blend.py)."""
        x = self.embed_tokens[input_ids]
        # Indexed by a layer's `uses_local_rotary`: the global rotation, then the local one.
        rotations = [rotary(positions) for rotary in self.rotaries]
        residual = None
        blend = get_selective_recompute()
        for index, layer in enumerate(self.layers):
            if blend is not None and index == blend.layer:
                (x, rotations), residual = blend.select(layer, x, residual, rotations), None
            x, residual = layer(x, residual, rotations[layer.uses_local_rotary])
        return self.norm(x, residual)[0]

    @property
    def rotaries(self) -> list[RotaryEmbedding]:
        """The rotary embeddings, indexed by a layer's `uses_local_rotary`."""
        return [self.rotary] + ([] if self.local_rotary is None else [self.local_rotary])

    def key_turns(self, num_positions: int) -> torch.Tensor:
        """[layers, head_dim / 2]: the rotation that moves each layer's cached keys
        `num_positions` on, by that layer's rotary embedding."""
        turns = [rotary.turn(num_positions) for rotary in self.rotaries]
        return torch.stack([turns[layer.uses_local_rotary] for layer in self.layers])

    def adapt_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Puts q/k rows in the interleaved order the rotary embedding expects (a tensor of the
        wrong shape passes unchanged, for the loader to report), and adds Gemma's offset to
        norm weights."""
        if self.cfg.norm_offset and name.endswith("norm.weight"):
            tensor = tensor + self.cfg.norm_offset
        if _ROTATED.search(name) and tensor.shape[0] % self.cfg.head_dim == 0:
            return to_interleaved(tensor, self.cfg.head_dim, self.cfg.rotary_dim)
        return tensor

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
