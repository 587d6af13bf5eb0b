"""The whole engine on the Triton attention backend, against transformers: on CUDA as it
runs there, and on the CPU through Triton's interpreter."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.attention.triton.backend import TritonPagedAttention  # noqa: E402
from kvserve.worker.cuda_graphs import graph_batch_sizes, graph_token_sizes  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402
from tests.models.test_hf_equivalence import MAX_TOKENS, hf_greedy, run_greedy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_everywhere(monkeypatch):
    """The runner takes the Triton backend on any device."""
    monkeypatch.setattr("kvserve.worker.model_runner.get_attention_backend",
                        lambda device, head_dim, softcap=None: TritonPagedAttention(
                            num_programs=8, softcap=softcap))


@pytest.mark.parametrize("arch,budget", [("llama", 16), ("qwen3", 2048), ("mistral", 48)])
def test_greedy_matches_transformers_on_triton_attention(model_dirs, triton_everywhere, arch,
                                                          budget):
    """Chunks after cached context, decodes beside chunks, a sliding window (Mistral), and a
    prefix-cache hit on the second run of the same prompts."""
    path = model_dirs[arch]
    llm = LLM(str(path), device=DEVICE, dtype="float32", max_num_batched_tokens=budget)
    runner = llm.engine.core.runner
    assert isinstance(runner.model.layers[0].self_attn.backend, TritonPagedAttention)
    assert runner.graphs is not None  # decode steps take the padded graph path (eagerly here)
    # Each step costs the interpreter about as much as a chunk, so the runs stop early: at 12
    # tokens the shorter prompts' decodes still cross into a new block. Greedy outputs of fewer
    # tokens are the first tokens of transformers' (cached) longer ones.
    prompts = random_prompts([5, 40, 97], seed=4)
    expected = [hf_greedy(path, tuple(p), MAX_TOKENS) for p in prompts]
    assert run_greedy(llm, prompts, max_tokens=12) == [e[:12] for e in expected]
    assert run_greedy(llm, prompts, max_tokens=3) == [e[:3] for e in expected]
    assert llm.get_stats().prefix_cache_hits > 0


def test_gemma2_matches_transformers_on_triton_attention(variant_dirs, triton_everywhere):
    """Softcapped scores in both kernels; a local layer within the window and a global one
    past it."""
    path = variant_dirs["gemma2"]
    llm = LLM(str(path), device=DEVICE, dtype="float32", max_num_batched_tokens=32)
    prompts = random_prompts([5, 70], seed=2)
    assert run_greedy(llm, prompts, max_tokens=6) == [
        hf_greedy(path, tuple(p), MAX_TOKENS)[:6] for p in prompts]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_transformers_on_split_k_linears(model_dirs, triton_everywhere,
                                                        monkeypatch, arch):
    """Every linear layer of up to 16 rows (decodes, small chunks, the LM head's rows) on
    the split-K kernel, the MLP's activation fused into down's loads; Qwen2 adds the
    projections' biases."""
    from kvserve.layers import triton_linear

    monkeypatch.setenv("KVSERVE_DENSE_KERNEL", "triton")
    path = model_dirs[arch]
    calls = []
    monkeypatch.setattr(triton_linear, "split_k_linear", _counting(
        triton_linear.split_k_linear, calls))
    llm = LLM(str(path), device=DEVICE, dtype="float32", max_num_batched_tokens=16)
    prompts = random_prompts([5, 23], seed=6)
    assert run_greedy(llm, prompts, max_tokens=6) == [
        hf_greedy(path, tuple(p), MAX_TOKENS)[:6] for p in prompts]
    assert any(gated for gated in calls) and not all(calls)


def _counting(split_k_linear, calls):  # noqa: ANN001, ANN202
    def counted(x, weight, num_programs, gated=False):  # noqa: ANN001, ANN202
        calls.append(gated)
        return split_k_linear(x, weight, num_programs, gated)
    return counted


def test_async_scheduling_on_triton_attention(model_dirs, triton_everywhere):
    """Steps launched before the one they follow has brought its tokens back, as on a GPU:
    pending tokens of decodes riding beside chunks, on the graph paths, padded mixed steps
    included."""
    from tests.models.test_async_scheduling import count_pending_tokens

    path = model_dirs["llama"]
    llm = LLM(str(path), device=DEVICE, dtype="float32", async_scheduling=True,
              max_num_batched_tokens=32)
    pending = count_pending_tokens(llm.engine)
    prompts = random_prompts([5, 40, 97], seed=11)
    assert run_greedy(llm, prompts, max_tokens=12) == [
        hf_greedy(path, tuple(p), MAX_TOKENS)[:12] for p in prompts]
    assert pending[0] > 0


def test_lora_adapters_replay_the_graph_paths(model_dirs, triton_everywhere, tmp_path):
    """Adapters and the base model mixed in steps that take the padded graph paths (the
    adapters' slots padded with none), and graphs captured again as an adapter comes and
    goes: outputs equal transformers on the merged weights."""
    from tests.models.test_lora import merged_greedy, write_adapter

    base = model_dirs["llama"]
    first = write_adapter(base, tmp_path / "first", seed=1)
    llm = LLM(str(base), device=DEVICE, dtype="float32", max_num_batched_tokens=32,
              lora_modules={"first": str(tmp_path / "first")})
    runner = llm.engine.core.runner
    assert runner.graphs.lora_slots == 1
    second = write_adapter(base, tmp_path / "second", seed=2, rank=8, alpha=4.0,
                           targets=("q_proj", "v_proj", "down_proj"))
    llm.engine.add_lora("second", str(tmp_path / "second"))
    assert runner.graphs.lora_slots == 2
    prompts = random_prompts([5, 40], seed=3)
    expected = {None: merged_greedy(base, {}, 1.0, prompts),
                "first": merged_greedy(base, first, 8.0 / 4, prompts),
                "second": merged_greedy(base, second, 4.0 / 8, prompts)}
    names = [None, "first", "second", "first"]
    batch = [{"prompt_token_ids": prompts[i % 2], "lora_name": name} if name else
             {"prompt_token_ids": prompts[i % 2]} for i, name in enumerate(names)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(batch, params, use_tqdm=False)
    for i, (name, out) in enumerate(zip(names, outputs, strict=True)):
        assert out.outputs[0].token_ids == expected[name][i % 2][:6], (name, i)
    llm.engine.remove_lora("second")
    assert runner.graphs.lora_slots == 1


def test_drafts_verify_on_triton_attention(model_dirs, triton_everywhere):
    """Speculative drafts as decode rows of one sequence, on the graph path."""
    path = model_dirs["llama"]
    llm = LLM(str(path), device=DEVICE, dtype="float32", speculative_model="ngram")
    phrase = random_prompts([7], seed=6)[0]
    prompts = [phrase * 4, random_prompts([30], seed=7)[0]]
    assert run_greedy(llm, prompts) == [hf_greedy(path, tuple(p), MAX_TOKENS) for p in prompts]
    assert llm.get_stats().num_accepted_tokens > 0


def test_graph_batch_sizes():
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]


def test_graph_token_sizes():
    assert graph_token_sizes(1024) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640,
                                       768, 896, 1024]
    assert graph_token_sizes(100) == [16, 32, 64, 100]
    assert graph_token_sizes(600) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 600]
    assert graph_token_sizes(10) == [10]


def test_a_padded_mixed_step_matches_the_eager_one(model_dirs, triton_everywhere):
    """A step with chunks and decodes at a graph's shape: the decodes counted on the device
    by the decode launch, the chunks in the varlen launch, padding rows and sequences after
    the real ones. Its rows equal the eager step's, and the padding writes no KV."""
    from kvserve.core.scheduler.output import ScheduledRequest
    from kvserve.worker.forward_context import forward_context

    runner = LLM(str(model_dirs["qwen3"]), device=DEVICE, dtype="float32",
                 max_num_seqs=8).engine.core.runner
    step = [ScheduledRequest("a", [5, 9, 3] * 10, 0, [0, 1], False),
            ScheduledRequest("b", [6], 20, [2, 3], True),
            ScheduledRequest("c", list(range(40, 57)), 17, [4, 5, 6], True)]
    inputs = runner.inputs.prepare(step)
    assert inputs.input_ids.shape[0] == 48
    with forward_context(inputs.attn_metadata):
        eager = runner.model(inputs.input_ids, inputs.positions)
    written = runner.kv_cache.clone()
    forwards, size = runner.graphs.forwards_for(inputs)
    assert forwards is runner.graphs.mixed and size == 64
    padded = forwards.run(inputs, size)
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    # The same KV again (up to a GEMM of more rows rounding apart), none for padding.
    torch.testing.assert_close(runner.kv_cache, written, rtol=1e-5, atol=1e-5)


def test_enforce_eager_runs_without_graphs(model_dirs, triton_everywhere):
    llm = LLM(str(model_dirs["llama"]), device=DEVICE, dtype="float32", enforce_eager=True)
    assert llm.engine.core.runner.graphs is None
    prompts = random_prompts([6, 30], seed=5)
    assert run_greedy(llm, prompts) == [hf_greedy(model_dirs["llama"], tuple(p), MAX_TOKENS)
                                        for p in prompts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_never_waits_for_the_gpu(model_dirs):
    """From the scheduler's output to the hidden states, eager and graph-replayed steps,
    with chunks and decode-only, nothing reads a device value back (CUDA's sync debug mode
    raises if so)."""
    from kvserve.core.scheduler.output import ScheduledRequest
    from kvserve.worker.forward_context import forward_context

    runner = LLM(str(model_dirs["llama"]), device="cuda").engine.core.runner
    mixed = [ScheduledRequest("a", [5] * 40, 0, [0, 1, 2], False),
             ScheduledRequest("b", [6], 20, [3, 4], True)]
    decodes = [ScheduledRequest("c", [7], 33, [5, 6, 7], True),
               ScheduledRequest("d", [8], 9, [8], True)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        inputs = runner.inputs.prepare(mixed)
        with forward_context(inputs.attn_metadata):
            runner.model(inputs.input_ids, inputs.positions)
        inputs = runner.inputs.prepare(mixed)
        forwards, size = runner.graphs.forwards_for(inputs)
        assert forwards is runner.graphs.mixed and size in forwards.graphs
        forwards.run(inputs, size)
        inputs = runner.inputs.prepare(decodes)
        forwards, size = runner.graphs.forwards_for(inputs)
        assert forwards is runner.graphs.decodes and size == 2 and 2 in forwards.graphs
        forwards.run(inputs, size)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_with_adapters_never_waits_for_the_gpu(model_dirs, tmp_path):
    """Adapter rows beside base-model rows, eager and graph-replayed, read nothing back."""
    from kvserve.core.scheduler.output import ScheduledRequest
    from kvserve.worker.forward_context import forward_context
    from tests.models.test_lora import write_adapter

    write_adapter(model_dirs["llama"], tmp_path / "a", seed=1)
    runner = LLM(str(model_dirs["llama"]), device="cuda",
                 lora_modules={"a": str(tmp_path / "a")}).engine.core.runner
    step = [ScheduledRequest("a", [5] * 40, 0, [0, 1, 2], False),
            ScheduledRequest("b", [6], 20, [3, 4], True)]
    slots = {"a": runner.loras.slots["a"]}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        inputs = runner.inputs.prepare(step, lora_slot_of=slots)
        with forward_context(inputs.attn_metadata, runner.loras.batch(inputs.lora_slots)):
            runner.model(inputs.input_ids, inputs.positions)
        inputs = runner.inputs.prepare(step, lora_slot_of=slots)
        forwards, size = runner.graphs.forwards_for(inputs)
        assert size in forwards.graphs
        forwards.run(inputs, size)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_blended_prompts_on_triton_attention(model_dirs, triton_everywhere):
    """A blended prompt's recomputed tokens run as one prefill chunk at their own positions;
    recomputing all of them gives the plain prompt's output."""
    path = model_dirs["llama"]
    llm = LLM(str(path), device=DEVICE, dtype="float32", blend_recompute_ratio=1.0)
    a, b, question = random_prompts([40, 23, 9], seed=8)
    max_tokens = 4  # decodes over the blended KV; the interpreter makes each one costly
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for segments in ([a, b, question], [b, a, question]):
        out = llm.generate({"segments": segments}, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(path, tuple(sum(segments, [])),
                                                     max_tokens)
    assert llm.get_stats().blend_chunk_hit_tokens == len(a) + len(b)


def test_bench_step_times_steps_with_chunks_graphed_and_eager(model_dirs, triton_everywhere,
                                                              tmp_path):
    from kvserve.entrypoints.cli import main

    out = tmp_path / "step.json"
    main(["bench", "step", "--model", str(model_dirs["llama"]), "--device", DEVICE,
          "--dtype", "float32", "--decodes", "1", "--chunks", "8", "--context", "8",
          "--repeats", "1", "--prefill-tokens", "16", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["decodes"], r["chunk"]) for r in rows] == [(1, 0), (1, 8)]
    assert rows[1]["eager step ms"] > 0 and rows[1]["graph speed-up"] > 0
