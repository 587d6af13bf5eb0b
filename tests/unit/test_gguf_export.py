"""GGUF export for llama.cpp: every tensor under its GGUF name in the requested dtype (a
quantized checkpoint's layers in Q4_0 or Q8_0), q/k rows in the rotary order of llama.cpp's
graph for the architecture, experts stacked per layer, and the vocabulary padded to the
model's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.layers.rotary import to_interleaved
from kvserve.models.loader import iter_checkpoint
from kvserve.quantization.hub_format import dequantize_checkpoint
from kvserve.quantization.quantize import quantize_model
from kvserve.tools.gguf_export import cached_gguf, export_gguf

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gguf_holds_the_checkpoint(llama_dir: Path, tmp_path: Path, dtype: torch.dtype
                                       ) -> None:
    out = tmp_path / "model.gguf"
    export_gguf(llama_dir, dtype, out)
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    cfg = ModelConfig.from_pretrained(llama_dir, "float32")
    checkpoint = dict(iter_checkpoint(llama_dir))
    assert len(tensors) == len(checkpoint)
    q = tensors["blk.0.attn_q.weight"]
    want = gguf.GGMLQuantizationType.BF16 if dtype == torch.bfloat16 else \
        gguf.GGMLQuantizationType.F32
    assert q.tensor_type == want
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    expected = to_interleaved(checkpoint["model.layers.0.self_attn.q_proj.weight"],
                              cfg.head_dim).to(dtype).float()
    got = np.array(q.data)
    got = (torch.from_numpy(got.view(np.int16).astype(np.int32) << 16).view(torch.float32)
           if dtype == torch.bfloat16 else torch.from_numpy(got))
    assert torch.equal(got.reshape(expected.shape), expected)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == cfg.vocab_size


def test_a_conversion_is_cached(llama_dir: Path, tmp_path: Path) -> None:
    first = cached_gguf(llama_dir, torch.float32, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cached_gguf(llama_dir, torch.float32, tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    assert cached_gguf(llama_dir, torch.bfloat16, tmp_path) != first


def test_other_dtypes_are_refused(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        export_gguf(llama_dir, torch.float16, tmp_path / "x.gguf")


@pytest.mark.parametrize(("bits", "ggml_type"), [(4, "Q4_0"), (8, "Q8_0")])
def test_a_quantized_checkpoint_is_written_in_llama_cpps_type_of_its_width(
        llama_dir: Path, tmp_path: Path, bits: int, ggml_type: str) -> None:
    model = quantize_model(llama_dir, tmp_path / "q", "rtn", bits, group_size=32)
    path = cached_gguf(model, torch.bfloat16, tmp_path)
    assert ggml_type in path.name
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    cfg = ModelConfig.from_pretrained(model, "float32")
    checkpoint = dict(dequantize_checkpoint(iter_checkpoint(model), cfg.quantization))
    q = tensors["blk.0.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType[ggml_type]
    expected = to_interleaved(checkpoint["model.layers.0.self_attn.q_proj.weight"],
                              cfg.head_dim).numpy()
    assert np.array_equal(np.array(q.data).reshape(-1), gguf.quants.quantize(
        expected, gguf.GGMLQuantizationType[ggml_type]).reshape(-1))
    # The float tensors keep the requested dtype.
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.BF16
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_a_width_llama_cpp_has_no_like_type_for_is_refused(llama_dir: Path, tmp_path: Path
                                                           ) -> None:
    model = quantize_model(llama_dir, tmp_path / "q", "rtn", 3, group_size=32)
    with pytest.raises(ValueError, match="not 3-bit gptq"):
        cached_gguf(model, torch.float32, tmp_path)
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"])
def test_llama_cpp_scores_the_next_token_as_kvserve_does(llama_dir: Path, tmp_path: Path,
                                                          arch: str) -> None:
    """Where llama-cpp-python is installed: the same top-5 next tokens, logprobs within
    1e-2 (llama.cpp keeps its KV cache in float16). Its Llama graph rotates q/k as adjacent
    pairs (the rows reordered), its Qwen graphs as halves; Qwen2 adds q/k/v biases, Qwen3 per-
    head q/k norms, the MoEs experts (Qwen2-MoE's with its gated shared expert)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from kvserve import LLM, SamplingParams
    from kvserve.tools.make_model import make_model
    from tests.conftest import random_prompts

    model = llama_dir if arch == "llama" else make_model("tiny", tmp_path / arch, arch=arch)
    prompt = random_prompts([60], seed=4)[0]
    path = cached_gguf(model, torch.float32, tmp_path)
    peer = llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False)
    peer.eval(prompt)
    theirs = torch.log_softmax(torch.tensor(peer.scores[len(prompt) - 1]), -1)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    ours = LLM(str(model), dtype="float32").generate(
        [{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].logprobs[0]
    assert list(ours)[:5] == torch.topk(theirs, 5).indices.tolist()
    for token, entry in ours.items():
        assert abs(entry.logprob - theirs[token].item()) < 1e-2


@pytest.mark.parametrize("bits", [None, 4])
def test_mixtral_experts_are_stacked_per_layer(tmp_path: Path, bits: int | None) -> None:
    """llama.cpp's Llama graph with experts: the router as ffn_gate_inp, each layer's w1, w3
    and w2 stacked over the experts (in Q4_0 for a 4-bit checkpoint)."""
    from kvserve.tools.make_model import make_model

    model = make_model("tiny", tmp_path / "mixtral", arch="mixtral")
    if bits is not None:
        model = quantize_model(model, tmp_path / "q", "rtn", bits, group_size=32)
    out = tmp_path / "model.gguf"
    export_gguf(model, torch.float32, out)
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    cfg = ModelConfig.from_pretrained(model, "float32")
    checkpoint = dict(dequantize_checkpoint(iter_checkpoint(model), cfg.quantization))
    experts = cfg.moe.num_experts
    assert int(reader.fields["llama.expert_count"].parts[-1][0]) == experts
    assert int(reader.fields["llama.expert_used_count"].parts[-1][0]) == cfg.moe.top_k
    assert len(tensors) == len(checkpoint) - cfg.num_layers * 3 * (experts - 1)
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    up = tensors["blk.1.ffn_up_exps.weight"]
    stacked = torch.stack([checkpoint[f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight"]
                           for e in range(experts)]).numpy()
    if bits is None:
        assert np.array_equal(np.array(up.data).reshape(stacked.shape), stacked)
    else:
        assert up.tensor_type == gguf.GGMLQuantizationType.Q4_0
        assert np.array_equal(np.array(up.data).reshape(-1), gguf.quants.quantize(
            stacked, gguf.GGMLQuantizationType.Q4_0).reshape(-1))


def exported_tiny(tmp_path: Path, arch: str) -> tuple[object, dict, ModelConfig, dict]:
    """A tiny `arch` checkpoint exported: the GGUF's reader and tensors by name, and the
    checkpoint's config and tensors."""
    from kvserve.tools.make_model import make_model

    model = make_model("tiny", tmp_path / arch, arch=arch)
    out = tmp_path / "model.gguf"
    export_gguf(model, torch.float32, out)
    reader = gguf.GGUFReader(str(out))
    return (reader, {t.name: t for t in reader.tensors},
            ModelConfig.from_pretrained(model, "float32"), dict(iter_checkpoint(model)))


def assert_layer_tensors(tensors: dict, checkpoint: dict,
                         names: tuple[tuple[str, str], ...]) -> None:
    """Layer 1's checkpoint tensors, as (their name, the GGUF's), hold the same values."""
    for ours, theirs in names:
        want = checkpoint[f"model.layers.1.{ours}"].numpy()
        assert np.array_equal(np.array(tensors[f"blk.1.{theirs}"].data).reshape(want.shape),
                              want)


def test_qwen3_moe_experts_are_stacked_under_llama_cpps_names(tmp_path: Path) -> None:
    """The qwen3moe graph: the router, each layer's experts stacked, the per-head q/k norms,
    the experts' width as its own key, and q/k rows as the checkpoint has them (NEOX)."""
    reader, tensors, cfg, checkpoint = exported_tiny(tmp_path, "qwen3_moe")
    assert int(reader.fields["qwen3moe.expert_feed_forward_length"].parts[-1][0]) == \
        cfg.moe.intermediate_size
    assert len(tensors) == len(checkpoint) - cfg.num_layers * 3 * (cfg.moe.num_experts - 1)
    down = torch.stack([checkpoint[f"model.layers.0.mlp.experts.{e}.down_proj.weight"]
                        for e in range(cfg.moe.num_experts)]).numpy()
    assert np.array_equal(np.array(tensors["blk.0.ffn_down_exps.weight"].data).reshape(
        down.shape), down)
    assert_layer_tensors(tensors, checkpoint, (("self_attn.q_proj.weight", "attn_q.weight"),
                                               ("self_attn.k_norm.weight", "attn_k_norm.weight"),
                                               ("mlp.gate.weight", "ffn_gate_inp.weight")))


def test_qwen2_moe_shared_expert_goes_under_llama_cpps_names(tmp_path: Path) -> None:
    """The qwen2moe graph: the shared expert's projections as ffn_*_shexp, its width as a
    key of its own, its [1, hidden] sigmoid gate as the vector ffn_gate_inp_shexp, and the
    tied embedding also as output.weight, without which the graph does not load."""
    reader, tensors, cfg, checkpoint = exported_tiny(tmp_path, "qwen2_moe")
    assert int(reader.fields["qwen2moe.expert_shared_feed_forward_length"].parts[-1][0]) == \
        cfg.moe.shared_expert_intermediate_size
    assert cfg.tie_word_embeddings
    assert len(tensors) == len(checkpoint) + 1 - cfg.num_layers * 3 * (cfg.moe.num_experts - 1)
    assert np.array_equal(np.array(tensors["output.weight"].data),
                          np.array(tensors["token_embd.weight"].data))
    gate = tensors["blk.1.ffn_gate_inp_shexp.weight"]
    assert gate.n_elements == cfg.hidden_size and len(gate.shape) == 1
    assert_layer_tensors(tensors, checkpoint,
                         (("mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"),
                          ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
                          ("self_attn.v_proj.bias", "attn_v.bias")))


def test_a_sliding_window_and_other_routings_are_refused(tmp_path: Path) -> None:
    from kvserve.tools.make_model import make_model

    model = make_model("tiny", tmp_path / "mixtral", arch="mixtral", sliding_window=64)
    with pytest.raises(ValueError, match="sliding_window is 64"):
        export_gguf(model, torch.float32, tmp_path / "x.gguf")
    model = make_model("tiny", tmp_path / "q", arch="qwen2_moe")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"norm_topk_prob": True}))
    with pytest.raises(ValueError, match="qwen2moe graph .* never renormalizes .* "
                                         "norm_topk_prob is true"):
        export_gguf(model, torch.float32, tmp_path / "y.gguf")
