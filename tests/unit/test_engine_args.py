"""The engine flags: one table for every command, and a round trip for the servers that
benchmarks start."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from kvserve import LLM
from kvserve.config import EngineConfig, GiB, resolve_dtype
from kvserve.engine_args import add_engine_args, engine_flags, engine_kwargs
from kvserve.entrypoints.cli import build_parser
from kvserve.sampling_params import SamplingParams
from kvserve.tools.checkpoint_files import write_json
from kvserve.tools.make_model import PRESETS, hf_config
from kvserve.vllm_flags import take_vllm_options
from kvserve.worker.kv_pool import (
    blocks_in_device_memory,
    graph_pool_bytes,
    reserved_bytes,
    step_activation_bytes,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def parse_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What `kvserve ARGV` prints as its flags are refused."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(list(argv))
    return capsys.readouterr().err


def test_flags_round_trip_into_the_same_engine_options():
    args = parse("--model", "m", "--dtype", "bfloat16", "--max-num-seqs", "7",
                 "--kv-cache-memory", "0.5", "--max-model-len", "99", "--device", "cuda:1",
                 "--scheduler-policy", "prefill_first", "--no-enable-prefix-caching",
                 "--tokenizer", "org/tokenizer")
    again = parse("--model", "m", *engine_flags(args))
    assert vars(again) == vars(args)
    kwargs = engine_kwargs(again)
    assert kwargs["kv_cache_memory"] == GiB // 2 and kwargs["enable_prefix_caching"] is False
    assert kwargs["device"] == "cuda:1" and kwargs["max_model_len"] == 99
    assert kwargs["tokenizer"] == "org/tokenizer"


def test_defaults_survive_the_round_trip():
    args = parse("--model", "m")
    assert "--max-model-len" not in engine_flags(args)
    assert vars(parse("--model", "m", *engine_flags(args))) == vars(args)


def test_auto_dtype_is_bfloat16_on_cuda_for_float32_checkpoints_only():
    assert resolve_dtype("auto", {"torch_dtype": "float32"}, "cuda") == torch.bfloat16
    assert resolve_dtype("auto", {"torch_dtype": "float16"}, "cuda:0") == torch.float16
    assert resolve_dtype("float32", {}, "cuda") == torch.float32


@pytest.mark.parametrize("native", ["0", "1"])
def test_auto_dtype_on_cpu_follows_native_bfloat16(native: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CPU_BF16", native)
    want = torch.bfloat16 if native == "1" else torch.float32
    for checkpoint in ("float32", "bfloat16", "float16"):
        assert resolve_dtype("auto", {"torch_dtype": checkpoint}, "cpu") == want
    assert resolve_dtype("float32", {"torch_dtype": "bfloat16"}, "cpu") == torch.float32
    assert resolve_dtype("bfloat16", {}, "cpu") == torch.bfloat16


def test_bench_serve_hands_every_engine_flag_to_its_servers():
    args = build_parser().parse_args(["bench", "serve", "--model", "m", "--device", "cuda",
                                      "--dtype", "bfloat16", "--kv-cache-memory", "8",
                                      "--max-num-seqs", "256"])
    flags = engine_flags(args)
    for flag, value in (("--device", "cuda"), ("--dtype", "bfloat16"),
                        ("--kv-cache-memory", "8.0"), ("--max-num-seqs", "256"),
                        ("--max-num-batched-tokens", "256")):
        assert flags[flags.index(flag) + 1] == value


def test_the_default_pool_is_what_the_running_requests_can_fill_up_to_2_gib(tmp_path, model_dirs,
                                                                            caplog):
    tiny = model_dirs["llama"]  # 1,024 positions; 16-token blocks
    assert EngineConfig.create(tiny, max_num_seqs=3).num_kv_blocks == 3 * 64
    with caplog.at_level(logging.INFO, logger="kvserve"):
        LLM(str(tiny), max_num_seqs=3)
    assert "KV cache: 3072 tokens in 192 blocks" in caplog.text
    assert "3.00x requests of 1024 tokens (max_model_len) at once" in caplog.text
    assert EngineConfig.create(tiny, max_num_seqs=3, max_model_len=100).num_kv_blocks == 3 * 7
    given = EngineConfig.create(tiny, max_num_seqs=3, kv_cache_memory=GiB)
    assert given.num_kv_blocks == GiB // given.pool_bytes_per_block  # a given size is kept
    # Llama-3-8B's shapes: 128 requests of 131,072 tokens would fill far more than 2 GiB.
    big = EngineConfig.create(llama3_8b_shapes(tmp_path), dtype="float32")
    assert big.num_kv_blocks == 2 * GiB // big.pool_bytes_per_block == 512
    assert not big.sized_by_device_memory  # the CPU's pool is the config's


def llama3_8b_shapes(folder):
    write_json(folder / "config.json", hf_config(PRESETS["llama3-8b"]))
    return folder


def test_a_gpu_pool_gets_what_the_weights_leave_of_gpu_memory_utilization(tmp_path):
    folder = llama3_8b_shapes(tmp_path)
    config = EngineConfig.create(folder, dtype="bfloat16", device="cuda")
    assert config.sized_by_device_memory
    assert not EngineConfig.create(folder, dtype="bfloat16", device="cuda",
                                   kv_cache_memory=GiB).sized_by_device_memory
    total, in_use = 80 * GiB, 16 * GiB  # an H100 with the 8B model's weights loaded
    reserve = reserved_bytes(config)
    # 2,048 tokens' activations, and two float32 rows over 128,256 ids for 512 logits rows
    # (the prompt-logprob slice; 128 sequences sample fewer).
    assert step_activation_bytes(config) == (
        2048 * 2 * (5 * 4096 + 2 * 1024 + 3 * 14336) + 512 * 8 * 128256)
    assert 1 * GiB < reserve < 2 * GiB
    # prefill_first runs a prompt of max_model_len (131,072) tokens in one step: its
    # activations, not a logits row per token, which would ask for 128 GiB more.
    whole = EngineConfig.create(folder, dtype="bfloat16", device="cuda",
                                scheduler_policy="prefill_first")
    assert 16 * GiB < reserved_bytes(whole) < 18 * GiB
    assert blocks_in_device_memory(whole, total - in_use, total) > 0
    # The graphs of steps with chunks hold the activations of 1,024 tokens: 128 MiB here.
    assert graph_pool_bytes(config) == 1024 * 2 * (5 * 4096 + 2 * 1024 + 3 * 14336)
    eager = EngineConfig.create(folder, dtype="bfloat16", device="cuda", enforce_eager=True)
    assert reserved_bytes(eager) == reserve - graph_pool_bytes(config)
    blocks = blocks_in_device_memory(config, total - in_use, total)
    assert blocks == (int(0.9 * total) - in_use - reserve) // config.pool_bytes_per_block
    assert 50 * GiB < blocks * config.pool_bytes_per_block < 55 * GiB
    # Memory that another process holds is not the pool's either.
    assert blocks_in_device_memory(config, total - in_use - 10 * GiB, total) == blocks - 5120
    # Never more than the running requests can fill.
    short = EngineConfig.create(folder, dtype="bfloat16", device="cuda", max_model_len=1024,
                                max_num_seqs=4)
    assert blocks_in_device_memory(short, total - in_use, total) == 4 * 64
    tight = EngineConfig.create(folder, dtype="bfloat16", device="cuda",
                                gpu_memory_utilization=0.21)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.21 of the device's 80.0 "
                                         r"GiB leaves no room for the KV cache: 16.0 GiB"):
        blocks_in_device_memory(tight, total - in_use, total)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=f"gpu_memory_utilization must be in \\(0, 1\\], "
                                             f"got {bad}"):
            EngineConfig.create(folder, device="cuda", gpu_memory_utilization=bad)
    assert engine_kwargs(parse("--model", "m", "--gpu-memory-utilization", "0.5"))[
        "gpu_memory_utilization"] == 0.5
    assert engine_kwargs(parse("--model", "m", "--max-graph-tokens", "0"))[
        "max_graph_tokens"] == 0
    with pytest.raises(ValueError, match="max_graph_tokens must be >= 0, got -1"):
        EngineConfig.create(folder, device="cuda", max_graph_tokens=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_engine_sizes_its_pool_from_the_memory_left(model_dirs):
    tiny = model_dirs["llama"]
    config = EngineConfig.create(tiny, device="cuda", max_num_seqs=64)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    # A utilization that leaves room for about 100 blocks beside what is in use now, the
    # tiny weights and the activation reserve: far fewer than 64 requests of 1,024 tokens.
    room = reserved_bytes(config) + 100 * config.pool_bytes_per_block
    utilization = (total - free + room + (64 << 20)) / total
    llm = LLM(str(tiny), device="cuda", max_num_seqs=64, gpu_memory_utilization=utilization)
    num_blocks = llm.engine.core.kv_cache.pool.num_blocks
    assert 0 < num_blocks < config.most_blocks_used
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_device_is_named_as_cpu_cuda_or_cuda_n_and_must_be_there(tmp_path, monkeypatch,
                                                                   capsys):
    folder = llama3_8b_shapes(tmp_path)
    for bad in ("tpu", "cpu:0", "cuda:x", "CUDA"):
        with pytest.raises(ValueError, match=f"device must be cpu, cuda or cuda:N, got '{bad}'"):
            EngineConfig.create(folder, device=bad)
    EngineConfig.create(folder, device="cpu").check_device()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device cuda: no CUDA device is available"):
        EngineConfig.create(folder, device="cuda").check_device()
    for bench in ("kernels", "quantized"):  # they use the device without an engine
        assert "argument --device: device cuda: no CUDA device" in parse_error(
            capsys, "bench", bench, "--device", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    EngineConfig.create(folder, device="cuda:1").check_device()
    with pytest.raises(ValueError, match="device cuda:2 needs 3 CUDA devices, and 2 are"):
        EngineConfig.create(folder, device="cuda:2").check_device()
    with pytest.raises(ValueError, match="device cuda with tensor_parallel_size 4 needs 4"):
        EngineConfig.create(folder, device="cuda", tensor_parallel_size=4).check_device()


def test_a_vllm_command_line_runs_where_its_meaning_holds(caplog):
    caplog.set_level(logging.INFO, logger="kvserve")
    args = build_parser().parse_args([
        "serve", "m", "--dtype", "half", "-tp", "2", "--no-enable-chunked-prefill",
        "--trust-remote-code", "--kv-cache-dtype", "auto", "--disable-log-requests",
        "--uvicorn-log-level", "warning"])
    kwargs = engine_kwargs(args)
    assert resolve_dtype(kwargs["dtype"], {}) == torch.float16
    assert kwargs["tensor_parallel_size"] == 2
    assert kwargs["scheduler_policy"] == "prefill_first"
    assert args.uvicorn_log_level == "warning"
    assert "vLLM's --trust-remote-code changes nothing: kvserve runs its own" in caplog.text
    assert "vLLM's --kv-cache-dtype auto changes nothing" in caplog.text
    assert engine_kwargs(build_parser().parse_args(
        ["serve", "m", "--scheduler-policy", "prefill_first", "--enable-chunked-prefill"])
    )["scheduler_policy"] == "chunked"


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "m", "--kv-cache-dtype", "fp8"], "kvserve serve: error: argument "
     "--kv-cache-dtype: vLLM's --kv-cache-dtype fp8 is not supported: the KV cache is kept "
     "in the model's dtype"),
    (["serve", "m", "-pp", "2"], "vLLM's -pp 2 is not supported: kvserve splits a model"),
    (["generate", "--model", "m", "--quantization", "gptq"],
     "vLLM's --quantization gptq is not supported: kvserve reads the method from the "
     "checkpoint's quantization_config"),
    (["serve", "m", "--max-num-sequences", "4"], "unrecognized arguments: "
     "--max-num-sequences 4 (--max-num-sequences: did you mean --max-num-seqs?)"),
    (["serve", "m", "--prot=8000", "x"], "unrecognized arguments: --prot=8000 x (--prot: did "
     "you mean --port?)"),
    (["bench", "latency", "--model", "m", "--runz", "3"],
     "kvserve bench latency: error: unrecognized arguments: --runz 3 (--runz: did you mean "
     "--runs?)"),
])
def test_a_flag_kvserve_does_not_take_is_refused_with_what_it_has(capsys, argv, message):
    assert message in parse_error(capsys, *argv)


def test_vllms_speculative_config_sets_kvserves_speculative_options(capsys):
    args = build_parser().parse_args(["serve", "m", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3, '
                                      '"prompt_lookup_max": 5}'])
    kwargs = engine_kwargs(args)
    assert (kwargs["speculative_model"], kwargs["num_speculative_tokens"]) == ("ngram", 3)
    assert kwargs["prompt_lookup_max"] == 5
    assert "--speculative-model ngram" in " ".join(engine_flags(args))
    assert take_vllm_options({"speculative_config": {"model": "draft"}}) == {
        "speculative_model": "draft"}
    for given, message in (('{"method": "eagle", "model": "d"}', "method 'eagle' with model "
                            "'d' is not supported: kvserve drafts by prompt lookup"),
                           ('{"method": "ngram", "disable_by_batch_size": 4}',
                            "['disable_by_batch_size'] are not supported"),
                           ('{"method"', "not valid JSON")):
        assert message in parse_error(capsys, "serve", "m", "--speculative-config", given)


def test_a_positional_model_may_come_as_vllms_model_flag(capsys):
    for argv in (["serve", "m"], ["serve", "--model", "m"], ["serve", "--seed", "1", "--model",
                                                             "m"]):
        assert engine_kwargs(build_parser().parse_args(argv))["model"] == "m"
    for argv, message in ((["serve"], "kvserve serve: error: the model is required: kvserve "
                                      "serve MODEL (a checkpoint folder or a Hugging Face Hub"),
                          (["serve", "a", "--model", "b"], "argument --model: not allowed "
                                                           "with argument model")):
        assert message in parse_error(capsys, *argv)


def test_token_counts_take_vllms_suffixes(capsys):
    for text, tokens in (("4096", 4096), ("32k", 32_000), ("32K", 32_768), ("1.5k", 1500),
                         ("2M", 2 << 20)):
        assert parse("--model", "m", "--max-model-len", text).max_model_len == tokens
    assert parse("--model", "m", "--max-num-batched-tokens", "8K").max_num_batched_tokens == 8192
    for text, message in (("x", "must be a count of tokens such as 4096, 32k or 32K, got 'x'"),
                          ("0.1K", "must be a whole count of tokens, got '0.1K'")):
        assert message in parse_error(capsys, "generate", "m", "--max-model-len", text)
