"""Prefix-cache offload to host memory and disk on a real checkpoint: greedy outputs equal
transformers' whichever tier the KV comes back from, the disk tier survives a restart, and
a damaged file or another model's folder is never served."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.models.test_hf_equivalence import (
    MAX_TOKENS,
    assert_no_blocks_held,
    hf_greedy,
    kv_bytes_for_blocks,
)


def prompts_sharing_heads() -> list[list[int]]:
    """Six heads of three blocks, each with a tail of its own; run twice, the second pass
    asks for heads that the 12-block pool (and a 4-block host tier) evicted long before."""
    heads = random_prompts([48] * 6, seed=21)
    tails = random_prompts([5, 9, 7, 3, 11, 6], seed=22)
    return [head + tail for head, tail in zip(heads, tails, strict=True)]


def offload_llm(path: Path, folder: Path | None, host_blocks: int = 4,
                tensor_parallel_size: int = 1) -> LLM:
    """A 12-block pool and a host tier of `host_blocks` (on each rank, whose blocks hold 1/T
    of the KV heads)."""
    ranks = tensor_parallel_size
    return LLM(str(path), kv_cache_memory=kv_bytes_for_blocks(path, 12) // ranks,
               max_num_seqs=2, kv_offload_host=kv_bytes_for_blocks(path, host_blocks) // ranks,
               kv_offload_dir=str(folder) if folder else None, tensor_parallel_size=ranks)


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = []
    for prompt in prompts:  # one at a time, so each finds what the earlier ones left
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        outputs.append(out[0].outputs[0].token_ids)
    assert_no_blocks_held(llm)
    # No file the tier forgot, none it lists that is gone (under tensor parallelism each
    # rank's store lives in its process: see its test).
    disk = getattr(llm.engine.core.runner, "disk_kv", None)
    if disk is not None:
        assert_files_are_the_disk_tier(llm, disk.folder)
    return outputs


def assert_files_are_the_disk_tier(llm: LLM, folder: Path) -> None:
    on_disk = {path.stem for path in folder.glob("*.kv")}
    assert on_disk == {h.hex() for h in llm.engine.core.kv_cache.tiers.disk}


@pytest.fixture(scope="module")
def expected(model_dirs) -> list[list[int]]:
    path = model_dirs["llama"]
    return [hf_greedy(path, tuple(p), MAX_TOKENS) for p in prompts_sharing_heads() * 2]


def test_host_tier_hits_keep_greedy_outputs(model_dirs, expected):
    llm = offload_llm(model_dirs["llama"], None, host_blocks=64)
    assert run(llm, prompts_sharing_heads() * 2) == expected
    stats = llm.get_stats()
    assert stats.prefix_cache_host_hits > 0 and stats.prefix_cache_disk_hits == 0


def test_disk_tier_hits_survive_a_restart_and_damage_is_discarded(model_dirs, expected,
                                                                   tmp_path):
    path = model_dirs["llama"]
    llm = offload_llm(path, tmp_path)
    assert run(llm, prompts_sharing_heads() * 2) == expected
    assert llm.get_stats().prefix_cache_disk_hits > 0
    (folder,) = tmp_path.iterdir()
    files = sorted(folder.iterdir())
    assert files and all(f.suffix == ".kv" for f in files)
    del llm

    damaged = files[0].read_bytes()
    files[0].write_bytes(damaged[:-1] + bytes([damaged[-1] ^ 1]))  # a flipped bit
    leftover = folder / ("0" * 64 + ".tmp123")
    leftover.write_bytes(b"killed mid-write")
    files[1].write_bytes(files[1].read_bytes()[:100])  # truncated
    restarted = offload_llm(path, tmp_path)
    assert not leftover.exists() and not files[1].exists()
    assert run(restarted, prompts_sharing_heads()) == expected[:6]
    assert restarted.get_stats().prefix_cache_disk_hits > 0
    disk = restarted.engine.core.runner.disk_kv
    assert disk.num_read > 0 and disk.num_damaged == 1


def test_another_model_never_reads_the_disk_tier(model_dirs, tmp_path):
    run(offload_llm(model_dirs["llama"], tmp_path), prompts_sharing_heads() * 2)
    other = offload_llm(model_dirs["qwen3"], tmp_path)
    run(other, prompts_sharing_heads())
    assert other.get_stats().prefix_cache_disk_hits == 0
    assert len(list(tmp_path.iterdir())) == 2  # a folder per model identity


def test_a_cache_salt_never_reads_blocks_offloaded_without_it(model_dirs, expected, tmp_path):
    llm = offload_llm(model_dirs["llama"], tmp_path)
    run(llm, prompts_sharing_heads() * 2)
    before = llm.get_stats()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt, tokens in zip(prompts_sharing_heads(), expected, strict=False):
        out = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, params,
                           use_tqdm=False)
        assert out[0].outputs[0].token_ids == tokens
    after = llm.get_stats()
    assert after.prefix_cache_hits == before.prefix_cache_hits  # no tier served a salted head
    assert_no_blocks_held(llm)
