"""Mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE): greedy
tokens equal transformers' on the same checkpoint in float32, across chunk sizes,
preemption and tensor parallelism; what is not supported for them is refused by name."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from kvserve import LLM, SamplingParams
from kvserve.benchmarks.device import matmul_params, weight_bytes
from kvserve.config import ModelConfig
from kvserve.cpp_extension import cpu_kernels
from kvserve.errors import CheckpointError
from kvserve.layers.linear import Linear
from kvserve.models.moe import SparseMoeBlock
from kvserve.quantization.cpu_kernels import WxA8Weight
from kvserve.quantization.quantize import quantize_model
from kvserve.tools.corpus import heldout_windows
from kvserve.tools.make_lora import make_lora
from kvserve.tools.make_model import MOE_ARCHES, make_model
from tests.conftest import random_prompts
from tests.models.test_cpu_decode import greedy_with_logprobs
from tests.models.test_hf_equivalence import (
    MAX_TOKENS,
    PROMPT_LENS,
    SETTINGS,
    assert_like_hf_greedy,
    kv_bytes_for_blocks,
    run_greedy,
)
from tests.models.test_lora import merged_greedy
from tests.models.test_quantized import (
    assert_serves_like_its_dequantized_weights,
    awq_copy,
    dequantized_copy,
    only_candidate,
)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_model("tiny", root / arch, arch=arch, sliding_window=64)
            for arch in MOE_ARCHES}


def with_dense_first_layer(source: Path, folder: Path) -> Path:
    """A copy of a Qwen MoE checkpoint whose layer 0 is a dense MLP (`mlp_only_layers`)."""
    shutil.copytree(source, folder)
    weights_file = next(folder.glob("*.safetensors"))
    tensors = {name: t for name, t in load_file(weights_file).items()
               if not name.startswith("model.layers.0.mlp.")}
    config = json.loads((folder / "config.json").read_text())
    hidden, size = config["hidden_size"], config["intermediate_size"]
    gen = torch.Generator().manual_seed(5)
    for name, shape in (("gate_proj", (size, hidden)), ("up_proj", (size, hidden)),
                        ("down_proj", (hidden, size))):
        tensors[f"model.layers.0.mlp.{name}.weight"] = torch.randn(*shape, generator=gen) * 0.08
    save_file(tensors, weights_file)
    config["mlp_only_layers"] = [0]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("setting", ["default", "small-chunks", "preemption",
                                     "preemption-swap"])
@pytest.mark.parametrize("arch", MOE_ARCHES)
def test_greedy_matches_transformers(moe_dirs, arch, setting):
    path = moe_dirs[arch]
    kwargs = dict(SETTINGS[setting])
    if "kv_blocks" in kwargs:
        kwargs["kv_cache_memory"] = kv_bytes_for_blocks(path, kwargs.pop("kv_blocks"))
    llm = LLM(str(path), **kwargs)
    prompts = random_prompts(PROMPT_LENS, seed=len(setting))
    for prompt, tokens in zip(prompts, run_greedy(llm, prompts), strict=True):
        assert_like_hf_greedy(path, prompt, tokens)
    if setting.startswith("preemption"):
        assert llm.engine.core.scheduler.num_preemptions > 0


def skip_without_decode_stack(dtype: str) -> None:
    kernels = cpu_kernels()
    if kernels is None or not kernels.gemm_supports(torch.empty(16, 2,
                                                                dtype=getattr(torch, dtype))):
        pytest.skip(f"no blocked {dtype} GEMM on this CPU, so no decode stack")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", MOE_ARCHES)
def test_decode_stack_equals_the_eager_forward(moe_dirs, arch, dtype):
    """The C++ decode stack routes as the eager MoE block does, to the bit."""
    skip_without_decode_stack(dtype)
    prompts = random_prompts([5, 17, 70, 3, 40], seed=4)
    stacked = LLM(str(moe_dirs[arch]), dtype=dtype, max_num_batched_tokens=48)
    eager = LLM(str(moe_dirs[arch]), dtype=dtype, max_num_batched_tokens=48,
                enforce_eager=True)
    assert stacked.engine.core.runner.cpu_decode is not None
    assert greedy_with_logprobs(stacked, prompts) == greedy_with_logprobs(eager, prompts)
    assert greedy_with_logprobs(stacked, prompts[:1]) == greedy_with_logprobs(eager, prompts[:1])


def on_w4a8(monkeypatch: pytest.MonkeyPatch, gemm_from: int | None) -> None:
    """Quantized layers load on the W4A8/W8A8 kernel, its integer GEMM from `gemm_from` rows
    (None: the build's own count)."""
    monkeypatch.setattr("kvserve.quantization.kernels.cpu_candidates",
                        only_candidate(WxA8Weight))
    monkeypatch.setattr("kvserve.quantization.cpu_kernels._decisions", {})
    monkeypatch.setattr("kvserve.quantization.cpu_kernels.row_crossovers",
                        lambda kernel, _: dataclasses.replace(kernel, gemm_from=gemm_from))
    monkeypatch.setenv("KVSERVE_QUANTIZED_KERNEL", "integer")


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "w4a8", "w4a8-gemm-from-2"])
@pytest.mark.parametrize("arch", MOE_ARCHES)
def test_a_cpu_moe_block_is_one_kernel_call_to_the_bits_of_its_python_loop(
        moe_dirs, tmp_path, monkeypatch, arch, weights):
    """Where the C++ kernels run every layer of a block (the blocked GEMM, W4A8 experts), its
    forward is one call to them: the same bits as the routing, per-expert and shared-expert
    ops it replaces, over one row and many. W4A8 experts whose rows all go to the few-rows
    kernel run in one call together: all of them with the build's GEMM start (an expert's
    5-40 rows among 8 experts stay below it); with the GEMM from 2 rows, those of one row
    together and the others one by one."""
    dtype = "float32" if weights.startswith("w4a8") else weights
    skip_without_decode_stack(dtype)
    path = moe_dirs[arch]
    if weights.startswith("w4a8"):
        on_w4a8(monkeypatch, 2 if weights.endswith("2") else None)
        path = quantize_model(path, tmp_path / "q", "rtn", 4, group_size=64)
    model = LLM(str(path), dtype=dtype).engine.core.runner.model
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    assert block.on_cpu_kernels is not None
    torch.manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 5, 40):
            x = torch.randn(rows, model.cfg.hidden_size, dtype=getattr(torch, dtype))
            assert torch.equal(block(x), block._experts(x)), rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", MOE_ARCHES)
def test_greedy_matches_transformers_on_cuda(moe_dirs, arch):
    """Eager steps (no CUDA graphs for MoE models) on the Triton attention backend."""
    path = moe_dirs[arch]
    llm = LLM(str(path), device="cuda", dtype="float32", max_num_batched_tokens=64)
    assert llm.engine.core.runner.graphs is None
    prompts = random_prompts(PROMPT_LENS, seed=1)
    for prompt, tokens in zip(prompts, run_greedy(llm, prompts), strict=True):
        assert_like_hf_greedy(path, prompt, tokens)


def test_dense_layers_among_sparse_ones(moe_dirs, tmp_path):
    path = with_dense_first_layer(moe_dirs["qwen3_moe"], tmp_path / "mixed")
    llm = LLM(str(path), max_num_batched_tokens=32)
    layers = llm.engine.core.runner.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [False, True]
    cfg = llm.engine.core.runner.config.model
    assert cfg.mlp_columns_per_token == (cfg.intermediate_size
                                         + cfg.moe.top_k * cfg.moe.intermediate_size)
    prompts = random_prompts([3, 50, 130], seed=9)
    for prompt, tokens in zip(prompts, run_greedy(llm, prompts), strict=True):
        assert_like_hf_greedy(path, prompt, tokens)


def test_two_ranks_match_one(moe_dirs):
    """Every expert (and Qwen2-MoE's shared one) split by columns, summed over the ranks once."""
    path = moe_dirs["qwen2_moe"]
    prompts = random_prompts([5, 40, 150, 17], seed=41)
    one = run_greedy(LLM(str(path), max_num_batched_tokens=64), prompts)
    two = run_greedy(LLM(str(path), max_num_batched_tokens=64, tensor_parallel_size=2), prompts)
    assert one == two


def test_attention_adapters_match_the_merged_model(moe_dirs, tmp_path):
    """Adapters of the attention projections, beside the base model in one batch."""
    base = moe_dirs["qwen3_moe"]
    pairs = make_lora(base, tmp_path / "attn", rank=4, alpha=8.0,
                      targets=("q_proj", "v_proj", "o_proj"), seed=1, std=0.2)
    llm = LLM(str(base), lora_modules={"attn": str(tmp_path / "attn")})
    prompts = random_prompts([5, 40, 17], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p, "lora_name": name}
                            for name in ("attn", None) for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got[:3] == merged_greedy(base, pairs, 8.0 / 4, prompts)
    assert got[3:] == merged_greedy(base, {}, 1.0, prompts)


def test_expert_adapters_are_refused(moe_dirs, tmp_path):
    base = moe_dirs["qwen3_moe"]
    folder = tmp_path / "experts"
    folder.mkdir()
    prefix = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(4, 64),
               f"{prefix}.lora_B.weight": torch.zeros(64, 4)},
              folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    llm = LLM(str(base))
    with pytest.raises(CheckpointError, match="mixture-of-experts layer's router and experts"):
        llm.engine.add_lora("experts", str(folder))


def test_the_floor_counts_the_top_k_experts(moe_dirs):
    """A token streams its top-k experts' weights, not all of them."""
    llm = LLM(str(moe_dirs["mixtral"]))
    cfg = llm.engine.core.runner.config.model
    model = llm.engine.core.runner.model
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    moe = cfg.moe
    per_layer = (h * (q + 2 * kv) + q * h + h * moe.num_experts
                 + moe.top_k * 3 * h * moe.intermediate_size)
    params = cfg.num_layers * per_layer + cfg.vocab_size * h
    assert cfg.mlp_columns_per_token == cfg.num_layers * moe.top_k * moe.intermediate_size
    assert matmul_params(model) == params
    stored = [m.weight_bytes for m in model.modules() if isinstance(m, Linear)]
    expert = sum(m.weight_bytes for m in model.layers[0].mlp.experts[0].modules()
                 if isinstance(m, Linear))
    unread = cfg.num_layers * (moe.num_experts - moe.top_k) * expert
    assert weight_bytes(model) == sum(stored) - unread
    # Rows routed uniformly at random pick 8 (1 - (6/8)^rows) of the 8 experts on average.
    for rows, picked in ((2, 3.5), (4, 8 - 8 * 0.75 ** 4)):
        unread = cfg.num_layers * (moe.num_experts - picked) * expert
        assert weight_bytes(model, rows) == round(sum(stored) - unread)


def test_config_errors_name_the_field(moe_dirs, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(moe_dirs["qwen3_moe"], folder)
    config = json.loads((folder / "config.json").read_text())
    for change, message in (({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) exceeds"),
                            ({"num_experts": 0}, "'num_experts' must be a positive"),
                            ({"moe_intermediate_size": None},
                             "'moe_intermediate_size' must be a positive")):
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(CheckpointError, match=message):
            ModelConfig.from_pretrained(folder)


@pytest.mark.parametrize(("method", "arch"), [("rtn", "mixtral"), ("rtn", "qwen2_moe"),
                                            ("gptq", "mixtral"), ("squeezellm", "qwen2_moe")])
def test_quantized_experts_serve_like_their_dequantized_weights(moe_dirs, tmp_path,
                                                                monkeypatch, method, arch):
    """Every expert's projections (Mixtral's w1-w3, Qwen's and its shared expert's *_proj)
    under their checkpoint names, calibrated through transformers' stacked experts for GPTQ
    and SqueezeLLM; the routers stay in full precision."""
    monkeypatch.setenv("KVSERVE_QUANTIZED_KERNEL", "dequantized")
    out = quantize_model(moe_dirs[arch], tmp_path / "q", method, 4, group_size=32,
                         num_samples=8, seq_len=64)
    names = set(load_file(str(out / "model.safetensors")))
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    expert = f"model.layers.1.{block}.experts.7." + ("w2" if arch == "mixtral" else "down_proj")
    assert {f"{expert}.qweight", f"model.layers.1.{block}.gate.weight"} <= names
    assert f"{expert}.weight" not in names
    if arch == "qwen2_moe":
        assert {"model.layers.0.mlp.shared_expert.up_proj.qweight",
                "model.layers.0.mlp.shared_expert_gate.weight"} <= names
    assert_serves_like_its_dequantized_weights(out, dequantized_copy(out, tmp_path / "float"))


def test_gptq_experts_err_less_than_rtn_on_heldout_text(moe_dirs, tmp_path):
    """Each expert's Hessian sums the tokens routed to it (and its down projection's, their
    gated activations): on held-out text, the first MoE block of GPTQ's model is closer to
    the full-precision one than that of rounding to nearest. (Qwen3-MoE: no shared expert,
    so the block's error is its experts'.)"""
    source = moe_dirs["qwen3_moe"]
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    block_inputs = []
    model.model.layers[0].mlp.register_forward_pre_hook(
        lambda _, args: block_inputs.append(args[0]))
    with torch.no_grad():
        model(input_ids=heldout_windows(tokenizer, 64, 8))
        reference = model.model.layers[0].mlp(block_inputs[0])

    def block_error(method: str) -> float:
        quantized = quantize_model(source, tmp_path / method, method, 3, group_size=32,
                                   num_samples=64, seq_len=64)
        block = AutoModelForCausalLM.from_pretrained(
            dequantized_copy(quantized, tmp_path / f"{method}-float"),
            dtype=torch.float32).model.layers[0].mlp
        with torch.no_grad():
            return float((block(block_inputs[0]) - reference).pow(2).mean())

    assert block_error("gptq") < 0.95 * block_error("rtn")  # 0.81 measured; 1.0 uncalibrated


def test_awq_experts_load(moe_dirs, tmp_path):
    out = awq_copy(moe_dirs["qwen3_moe"], tmp_path / "awq")
    assert_serves_like_its_dequantized_weights(out, dequantized_copy(out, tmp_path / "float"))


@pytest.mark.parametrize(("dtype", "bits"), [("float32", 4), ("bfloat16", 4), ("float32", 8)])
def test_the_decode_stack_runs_quantized_experts_as_the_eager_forward(moe_dirs, tmp_path,
                                                                      monkeypatch, dtype, bits):
    """Experts on the W4A8/W8A8 kernel, in the one-call decode stack (one row's experts in
    one call; an expert's 2-5 rows of a batch on its integer GEMM) and eagerly (whose block
    call the test above checks against the Python loop)."""
    skip_without_decode_stack(dtype)
    on_w4a8(monkeypatch, 2)
    # Four experts a token, so that summing them in another order would change the bits.
    source = shutil.copytree(moe_dirs["qwen3_moe"], tmp_path / "top4")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"num_experts_per_tok": 4}))
    out = quantize_model(source, tmp_path / "q", "rtn", bits, group_size=64)
    stacked = LLM(str(out), dtype=dtype, max_num_batched_tokens=48)
    eager = LLM(str(out), dtype=dtype, max_num_batched_tokens=48, enforce_eager=True)
    assert stacked.engine.core.runner.cpu_decode is not None
    expert = stacked.engine.core.runner.model.layers[0].mlp.experts[0]
    assert isinstance(expert.down_proj.kernel, WxA8Weight)
    assert len(expert.down_proj.kernel.zeros) == 1  # symmetric: one row of zeros for all
    prompts = random_prompts([5, 17, 70, 3, 40], seed=4)
    for batch in (prompts, prompts[:1]):
        assert greedy_with_logprobs(stacked, batch) == greedy_with_logprobs(eager, batch)
