"""The architectures kvserve can run, keyed by the `architectures` field of `config.json`.

All are the same pre-norm decoder; they differ in a few switches (Phi-3's checkpoints hold
q/k/v and gate/up fused, which the loader splits; Gemma 3 norms more, see `gemma`). The
mixture-of-experts ones (`moe`) route each token's MLP through its top-k experts (see
models/moe.py), with the router and expert sizes spelled Mixtral's way or Qwen's way in
`config.json`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.errors import CheckpointError


@dataclass(frozen=True)
class ArchSpec:
    name: str
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: str | None = None  # None: a dense MLP; "mixtral" or "qwen": whose config fields
    sliding_window_when: Callable[[dict[str, Any]], bool] = lambda raw: False
    # rope_scaling types that name another here (Phi-3's older "su" and "yarn" are LongRoPE)
    rope_aliases: tuple[tuple[str, str], ...] = ()
    # Gemma's version (2 or 3; 0: not Gemma) for its layout: norms around attention and the
    # MLP, (1 + w) norm weights, scaled embeddings, local and global layers (see
    # ModelConfig's Gemma fields)
    gemma: int = 0

    def uses_sliding_window(self, raw: dict[str, Any]) -> bool:
        return bool(raw.get("sliding_window")) and self.sliding_window_when(raw)


def _qwen_window(raw: dict[str, Any]) -> bool:
    if raw.get("use_sliding_window"):
        raise CheckpointError("model: use_sliding_window=true is not supported for Qwen models")
    return False


ARCHITECTURES = {
    spec.name: spec
    for spec in (
        ArchSpec("LlamaForCausalLM"),
        ArchSpec("MistralForCausalLM", sliding_window_when=lambda raw: True),
        ArchSpec("Qwen2ForCausalLM", qkv_bias=True, sliding_window_when=_qwen_window),
        ArchSpec("Qwen3ForCausalLM", qk_norm=True, sliding_window_when=_qwen_window),
        ArchSpec("MixtralForCausalLM", moe="mixtral", sliding_window_when=lambda raw: True),
        ArchSpec("Qwen2MoeForCausalLM", qkv_bias=True, moe="qwen",
                 sliding_window_when=_qwen_window),
        ArchSpec("Gemma2ForCausalLM", gemma=2, sliding_window_when=lambda raw: True),
        ArchSpec("Gemma3ForCausalLM", qk_norm=True, gemma=3,
                 sliding_window_when=lambda raw: True),
        ArchSpec("Phi3ForCausalLM", sliding_window_when=lambda raw: True,
                 rope_aliases=(("su", "longrope"), ("yarn", "longrope"))),
        ArchSpec("Qwen3MoeForCausalLM", qk_norm=True, moe="qwen",
                 sliding_window_when=_qwen_window),
    )
}


# Multimodal checkpoints whose language model is one of the above, served as text models.
MULTIMODAL_LANGUAGE_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}


def resolve_architecture(architectures: list[str] | None) -> ArchSpec:
    for name in architectures or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise CheckpointError(
        f"model: architecture {architectures!r} is not supported "
        f"(supported: {', '.join(sorted(ARCHITECTURES))})")
