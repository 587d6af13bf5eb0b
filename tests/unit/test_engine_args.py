"""The engine flags: one table for every command, and a round trip for the servers that
benchmarks start."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
import torch

from kvserve import LLM
from kvserve.config import EngineConfig, GiB, resolve_dtype
from kvserve.engine_args import add_engine_args, engine_flags, engine_kwargs


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def test_flags_round_trip_into_the_same_engine_options():
    args = parse("--model", "m", "--dtype", "bfloat16", "--max-num-seqs", "7",
                 "--kv-cache-memory", "0.5", "--max-model-len", "99", "--device", "cuda:1",
                 "--scheduler-policy", "prefill_first", "--no-enable-prefix-caching")
    again = parse("--model", "m", *engine_flags(args))
    assert vars(again) == vars(args)
    kwargs = engine_kwargs(again)
    assert kwargs["kv_cache_memory"] == GiB // 2 and kwargs["enable_prefix_caching"] is False
    assert kwargs["device"] == "cuda:1" and kwargs["max_model_len"] == 99


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
    from kvserve.entrypoints.cli import build_parser

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
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 131072}))
    big = EngineConfig.create(tmp_path, dtype="float32")
    assert big.num_kv_blocks == 2 * GiB // big.pool_bytes_per_block == 512
