"""Quantized checkpoints served by the engine give what their dequantized weights give in
transformers: GPTQ files written by `kvserve quantize`, and AWQ files."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.cpp_extension import cpu_kernels
from kvserve.layers.linear import Linear
from kvserve.models.loader import iter_checkpoint
from kvserve.quantization.cpu_kernels import (
    CpuCandidates,
    Int8Weight,
    WxA8Weight,
    amx_int8_runs,
    cpu_candidates,
    dequantized_gemm_runs,
)
from kvserve.quantization.gptq import QuantizedWeight, rtn
from kvserve.quantization.hub_format import QuantConfig, dequantize_checkpoint
from kvserve.quantization.packing import pack_awq
from kvserve.quantization.quantize import quantize_model
from kvserve.quantization.squeezellm import LutWeight
from kvserve.quantization.torch_int4 import Int4Weight
from kvserve.tools.checkpoint_files import write_weights
from kvserve.tools.make_model import make_model
from tests.conftest import random_prompts
from tests.models.test_cpu_decode import greedy_with_logprobs
from tests.models.test_hf_equivalence import MAX_TOKENS, hf_greedy, run_greedy

RELATIVE_ERROR = {8: 0.01, 4: 0.2, 3: 0.4}  # |dequantized - original| / |original|


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("tiny", tmp_path_factory.mktemp("trained") / "tiny", train_steps=10)


def dequantized_copy(quantized: Path, out: Path) -> Path:
    """The same model as a plain float checkpoint: what dequantize-then-run runs."""
    shutil.copytree(quantized, out)
    config = json.loads((out / "config.json").read_text())
    tensors = dict(dequantize_checkpoint(iter_checkpoint(quantized),
                                         QuantConfig.from_hf(config.pop("quantization_config"))))
    (out / "config.json").write_text(json.dumps(config))
    write_weights(out, iter(tensors.items()), torch.float32, 2 << 30, progress=False)
    return out


@pytest.fixture(autouse=True)
def dequantized_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact comparisons run the dequantized weights; the integer kernels (bfloat16
    activations) are compared within a tolerance below."""
    monkeypatch.setenv("KVSERVE_QUANTIZED_KERNEL", "dequantized")


def only_candidate(kind: type) -> Callable[[list[QuantizedWeight]], CpuCandidates]:
    """`cpu_candidates` offering one kernel only."""
    def restricted(shards: list[QuantizedWeight]) -> CpuCandidates:
        candidates = cpu_candidates(shards)
        return dataclasses.replace(candidates, packers={
            k: pack for k, pack in candidates.packers.items() if k is kind})
    return restricted


def assert_serves_like_its_dequantized_weights(quantized: Path, reference: Path) -> None:
    prompts = random_prompts([6, 70], seed=8)
    got = run_greedy(LLM(str(quantized), max_num_batched_tokens=32), prompts)
    assert got == [hf_greedy(reference, tuple(p), MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("method,bits,act_order", [("gptq", 4, True), ("gptq", 3, False),
                                                   ("rtn", 8, False), ("squeezellm", 3, False)])
def test_kvserve_quantize_output_serves_like_its_dequantized_weights(trained_tiny, tmp_path,
                                                                     method, bits, act_order):
    out = quantize_model(trained_tiny, tmp_path / "q", method, bits, group_size=32,
                         act_order=act_order, num_samples=8, seq_len=64)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config == ({"quant_method": "squeezellm", "bits": bits, "lm_head": False}
                      if method == "squeezellm" else
                      {"quant_method": "gptq", "bits": bits, "group_size": 32,
                       "desc_act": act_order, "sym": True, "lm_head": False,
                       "checkpoint_format": "gptq"})
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.layers.0.mlp.down_proj.qweight"].shape == (128 * bits // 32, 64)
    assert "model.layers.0.mlp.down_proj.weight" not in tensors
    reference = dequantized_copy(out, tmp_path / "dequantized")
    original = load_file(str(trained_tiny / "model.safetensors"))
    for name, weight in load_file(str(reference / "model.safetensors")).items():
        error = float((weight - original[name]).norm() / original[name].norm())
        assert error < RELATIVE_ERROR[bits], name  # the files hold the weights, not noise
    assert_serves_like_its_dequantized_weights(out, reference)


def awq_copy(source: Path, out: Path) -> Path:
    """`source` with its decoder projections (each expert's too) as 4-bit AWQ layers."""
    shutil.copytree(source, out)
    tensors = load_file(str(source / "model.safetensors"))
    for name in [n for n in tensors if ".layers." in n and n.endswith("proj.weight")]:
        q = rtn(tensors.pop(name), 4, 32, sym=False)
        layer = name.removesuffix(".weight")
        tensors[f"{layer}.qweight"] = pack_awq(q.intweight.t())
        tensors[f"{layer}.qzeros"] = pack_awq(q.zeros)
        tensors[f"{layer}.scales"] = q.scales.to(torch.float16)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32,
                                     "zero_point": True, "version": "gemm"}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_awq_checkpoints_load(trained_tiny, tmp_path):
    out = awq_copy(trained_tiny, tmp_path / "awq")
    assert_serves_like_its_dequantized_weights(out, dequantized_copy(out, tmp_path / "float"))


def test_sharded_quantized_checkpoints_load(trained_tiny, tmp_path):
    out = quantize_model(trained_tiny, tmp_path / "q", "rtn", 4, group_size=32,
                         max_shard_bytes=100_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and not (out / "model.safetensors").exists()
    assert "model.layers.1.self_attn.o_proj.qweight" in index
    assert_serves_like_its_dequantized_weights(out, dequantized_copy(out, tmp_path / "float"))


def test_a_quantized_file_without_its_config_is_refused(trained_tiny, tmp_path):
    from kvserve.errors import CheckpointError

    out = quantize_model(trained_tiny, tmp_path / "q", "rtn", 4, group_size=32)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="is quantized but config.json has no"):
        LLM(str(out))


def test_quantize_refuses_what_it_cannot_quantize_by_name(trained_tiny, tmp_path):
    """Before any layer is loaded: a folder that is no checkpoint, an output over the model,
    and a checkpoint that is quantized already (transformers would need its GPTQ backend)."""
    from kvserve.errors import CheckpointError

    with pytest.raises(CheckpointError, match="model: no config.json in"):
        quantize_model(tmp_path / "nothing", tmp_path / "q", "rtn", 4, group_size=32)
    with pytest.raises(ValueError, match="output: the quantized checkpoint needs a folder"):
        quantize_model(trained_tiny, trained_tiny / ".", "rtn", 4, group_size=32)
    out = quantize_model(trained_tiny, tmp_path / "q", "rtn", 4, group_size=32)
    with pytest.raises(ValueError, match=r"is already quantized \(gptq, 4 bits\)"):
        quantize_model(out, tmp_path / "q2", "rtn", 4, group_size=32)


def test_the_default_group_is_the_largest_power_of_two_to_128_that_fits(trained_tiny,
                                                                         tmp_path):
    config = json.loads((trained_tiny / "config.json").read_text())
    widths = [config["hidden_size"], config["intermediate_size"]]
    expected = math.gcd(128, *widths)  # tiny is 64 wide: 128 would not divide it
    assert expected < 128
    out = quantize_model(trained_tiny, tmp_path / "q", "rtn", 4)
    written = json.loads((out / "config.json").read_text())["quantization_config"]
    assert written["group_size"] == expected
    assert json.loads((quantize_model(trained_tiny, tmp_path / "q8", "rtn", 8) / "config.json"
                       ).read_text())["quantization_config"]["group_size"] == -1


@pytest.mark.parametrize("method,bits,group_size,act_order,lm_head,choice,kernel", [
    ("gptq", 4, 32, False, False, "integer", Int4Weight),
    ("gptq", 4, 32, True, False, "integer", Int4Weight),
    ("gptq", 4, 64, True, True, "integer", WxA8Weight),
    ("gptq", 8, -1, False, True, "integer", Int8Weight),
    ("gptq", 8, 64, True, False, "integer", WxA8Weight),
    ("gptq", 4, 32, True, True, "triton", "TritonQuantizedWeight"),
    ("squeezellm", 3, -1, False, False, "triton", "TritonQuantizedWeight")])
def test_quantized_kernels_track_the_dequantized_weights(trained_tiny, tmp_path, monkeypatch,
                                                         method, bits, group_size, act_order,
                                                         lm_head, choice, kernel):
    """The CPU int4/W4A8/int8 kernels, and the Triton kernel (here in Triton's interpreter),
    give the dequantized model's log-probabilities within bfloat16 (or int8) noise."""
    if choice == "triton":
        kernel = getattr(pytest.importorskip("kvserve.quantization.triton_gemm"), kernel)
    if kernel is WxA8Weight and cpu_kernels() is None:
        pytest.skip("the C++ kernels are not built here")
    if choice == "integer":  # the kernel under test is the only candidate, whatever the timings
        monkeypatch.setattr("kvserve.quantization.kernels.cpu_candidates",
                            only_candidate(kernel))
    out = quantize_model(trained_tiny, tmp_path / "q", method, bits, group_size=group_size,
                         act_order=act_order, lm_head=lm_head, num_samples=8, seq_len=64)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([6, 70], seed=8)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    dense = LLM(str(out))
    monkeypatch.setenv("KVSERVE_QUANTIZED_KERNEL", choice)
    dequantized = []
    for kind in (QuantizedWeight, LutWeight):
        monkeypatch.setattr(kind, "dequantize", lambda q, f=kind.dequantize: (
            dequantized.append(q), f(q))[1])
    quantized = LLM(str(out))
    assert not dequantized  # a layer on a kernel never builds its dense weight

    def quantized_linears(llm: LLM) -> list[Linear]:
        model = llm.engine.core.runner.model
        return [m for m in model.layers.modules() if isinstance(m, Linear)] + \
            ([model.lm_head] if lm_head else [])

    assert all(isinstance(m.kernel, kernel) for m in quantized_linears(quantized))
    if method != "squeezellm":  # whose tables outweigh the tiny model's rows
        assert sum(m.weight_bytes for m in quantized_linears(quantized)) < \
            sum(m.weight_bytes for m in quantized_linears(dense)) * bits / 16
    for a, b in zip(dense.generate(prompts, params, use_tqdm=False),
                    quantized.generate(prompts, params, use_tqdm=False), strict=True):
        for position, token in enumerate(a.prompt_token_ids[1:], start=1):
            want = a.prompt_logprobs[position][token].logprob
            assert abs(b.prompt_logprobs[position][token].logprob - want) < 0.05


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("group_size", [64, -1])
def test_the_decode_stack_runs_w4a8_layers_as_the_eager_forward(trained_tiny, tmp_path,
                                                                monkeypatch, dtype, group_size):
    """4-bit layers in the one-call decode stack, act-order ones in groups of 64 and per-channel
    ones (whose 128-channel down_proj the AMX int8 tiles take, where the CPU has them): one
    decode on the W4A8 kernel, two or three on the AMX tiles (else its integer GEMM), from four
    on the dequantizing GEMM, the same logprobs to the bit as eager."""
    if not dequantized_gemm_runs(2, getattr(torch, dtype)):
        pytest.skip(f"no blocked GEMM for {dtype} on this CPU")
    monkeypatch.setattr("kvserve.quantization.kernels.cpu_candidates",
                        only_candidate(WxA8Weight))
    monkeypatch.setattr("kvserve.quantization.cpu_kernels._decisions", {})
    monkeypatch.setattr("kvserve.quantization.cpu_kernels.row_crossovers", lambda kernel, _: (
        dataclasses.replace(kernel, gemm_from=2, amx_from=2 if amx_int8_runs(kernel) else None,
                            dequantized_from=4)))
    monkeypatch.setenv("KVSERVE_QUANTIZED_KERNEL", "integer")  # whatever the dense GEMM's time
    out = quantize_model(trained_tiny, tmp_path / "q", "gptq", 4, group_size=group_size,
                         act_order=group_size != -1, num_samples=8, seq_len=64)
    stacked = LLM(str(out), dtype=dtype, max_num_batched_tokens=48)
    eager = LLM(str(out), dtype=dtype, max_num_batched_tokens=48, enforce_eager=True)
    assert stacked.engine.core.runner.cpu_decode is not None
    down = stacked.engine.core.runner.model.layers[0].mlp.down_proj.kernel
    assert down.dequantized_from == 4 and down.gemm_from == 2
    assert down.amx_from == (2 if amx_int8_runs(down) else None)
    prompts = random_prompts([5, 17, 70, 3, 40], seed=4)
    for batch in (prompts, prompts[:3], prompts[:1]):
        assert greedy_with_logprobs(stacked, batch) == greedy_with_logprobs(eager, batch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("kernel", "bits", "group_size", "sym"),
                         [(Int4Weight, 4, 32, True), (Int8Weight, 8, -1, False)])
def test_the_decode_stack_runs_torch_int4_and_int8_layers_as_the_eager_forward(
        trained_tiny, tmp_path, monkeypatch, dtype, kernel, bits, group_size, sym):
    """Whichever kernel a layer's timing picks, the model stays on the stack: torch's int4
    kernel, and its int8 one with zero terms (asymmetric), give the same logprobs to the bit as
    eager."""
    monkeypatch.setattr("kvserve.quantization.kernels.cpu_candidates", only_candidate(kernel))
    monkeypatch.setattr("kvserve.quantization.cpu_kernels._decisions", {})
    monkeypatch.setenv("KVSERVE_QUANTIZED_KERNEL", "integer")  # whatever the dense GEMM's time
    out = quantize_model(trained_tiny, tmp_path / "q", "rtn", bits, group_size=group_size,
                         sym=sym)
    stacked = LLM(str(out), dtype=dtype, max_num_batched_tokens=48)
    eager = LLM(str(out), dtype=dtype, max_num_batched_tokens=48, enforce_eager=True)
    assert stacked.engine.core.runner.cpu_decode is not None
    linears = [m for m in stacked.engine.core.runner.model.layers.modules()
               if isinstance(m, Linear)]
    assert all(isinstance(m.kernel, kernel) for m in linears)
    if kernel is Int8Weight:
        assert any(m.kernel.zero_terms is not None for m in linears)
    prompts = random_prompts([5, 17, 70, 3, 40], seed=4)
    for batch in (prompts, prompts[:1]):
        assert greedy_with_logprobs(stacked, batch) == greedy_with_logprobs(eager, batch)


def test_a_quantized_lm_head_is_written_untied_and_serves_like_its_dequantized_weights(
        trained_tiny, tmp_path):
    out = quantize_model(trained_tiny, tmp_path / "q", "rtn", 8, lm_head=True)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["lm_head"] is True
    assert config["quantization_config"]["group_size"] == -1  # the 8-bit default
    tensors = load_file(str(out / "model.safetensors"))
    assert "lm_head.qweight" in tensors and "model.embed_tokens.weight" in tensors
    assert config["tie_word_embeddings"] is False
    assert_serves_like_its_dequantized_weights(out, dequantized_copy(out, tmp_path / "float"))


def test_a_fused_layer_mixing_quantized_and_float_parts_is_refused(trained_tiny, tmp_path):
    from kvserve.errors import CheckpointError

    out = quantize_model(trained_tiny, tmp_path / "q", "rtn", 4, group_size=32)
    tensors = load_file(str(out / "model.safetensors"))
    layer = "model.layers.0.self_attn.k_proj"
    for part in ("qweight", "qzeros", "scales", "g_idx"):
        del tensors[f"{layer}.{part}"]
    tensors[f"{layer}.weight"] = load_file(str(trained_tiny / "model.safetensors"))[
        f"{layer}.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="qkv_proj.*mixes quantized and float shards"):
        LLM(str(out))
