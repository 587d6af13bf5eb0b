"""Tensor parallelism on CPU: two ranks (gloo) give exactly the single-process greedy tokens
on Llama, Qwen2 (QKV bias) and Qwen3 (q/k norms), across chunked prefill and preemption, and
with LoRA adapters mixed in the batch, blending chunks (CacheBlend) and with drafts
(speculative decoding)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.quantization.quantize import quantize_model
from kvserve.tools.make_lora import make_lora
from kvserve.tools.make_model import make_model
from tests.conftest import random_prompts
from tests.models.test_hf_equivalence import kv_bytes_for_blocks
from tests.models.test_kv_offload import (
    assert_files_are_the_disk_tier,
    offload_llm,
    prompts_sharing_heads,
    run,
)

PROMPTS = random_prompts([5, 40, 150, 17, 90], seed=41)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def greedy(path: Path, adapters: tuple[str | None, ...] = (None,), **options: object
           ) -> list[list[int]]:
    """Prompt i runs on adapters[i % len(adapters)] (None: the base model)."""
    llm = LLM(str(path), max_num_batched_tokens=64, **options)
    prompts = [{"prompt_token_ids": p, "lora_name": adapters[i % len(adapters)]}
               for i, p in enumerate(PROMPTS)]
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_match_one(model_dirs: dict[str, Path], arch: str) -> None:
    path = model_dirs[arch]
    # A pool of 24 blocks cannot hold all five requests at once: some are preempted.
    small_pool = kv_bytes_for_blocks(path, 24)
    assert (greedy(path, tensor_parallel_size=2, kv_cache_memory=small_pool // 2)
            == greedy(path, kv_cache_memory=small_pool))


def test_two_ranks_match_one_with_lora_adapters(model_dirs: dict[str, Path],
                                                tmp_path: Path) -> None:
    """Column-parallel layers split B's outputs, row-parallel ones A's inputs."""
    path = model_dirs["llama"]
    modules = {name: str(tmp_path / name) for name in ("a", "b")}
    for seed, folder in enumerate(modules.values()):
        make_lora(path, folder, rank=4, alpha=8.0, seed=seed, std=0.2)
    adapters = ("a", None, "b")
    one = greedy(path, adapters, lora_modules=modules)
    assert one != greedy(path)  # the adapters change the outputs
    assert greedy(path, adapters, lora_modules=modules, tensor_parallel_size=2) == one


@pytest.mark.parametrize(("method", "bits", "group_size"), [("gptq", 4, 32),
                                                           ("squeezellm", 3, None)])
def test_two_ranks_match_one_on_quantized_checkpoints(model_dirs: dict[str, Path],
                                                      tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      method: str, bits: int,
                                                      group_size: int | None) -> None:
    """Column-parallel layers split the quantized rows, row-parallel ones the input channels
    (act-order GPTQ: scattered over the groups) with the groups they use."""
    monkeypatch.setenv("KVSERVE_QUANTIZED_KERNEL", "dequantized")  # no activation rounding
    path = quantize_model(model_dirs["llama"], tmp_path / method, method, bits, group_size,
                          act_order=True, num_samples=8, seq_len=64)
    assert greedy(path, tensor_parallel_size=2) == greedy(path)


def test_two_ranks_offload_to_disk_and_find_it_again(model_dirs: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """Each rank keeps its KV heads' part of a block in a folder of its own. A restart counts
    a block as on disk only where every rank has its part (deleting the others), and a part
    that one rank cannot read has the block computed again, its parts deleted on every rank."""
    path, prompts = model_dirs["llama"], prompts_sharing_heads()
    one = run(offload_llm(path, tmp_path / "one"), prompts * 2)

    def folders() -> list[Path]:
        return sorted((tmp_path / "two").iterdir())

    def serve(llm: LLM, rounds: int = 2) -> int:
        """The run's disk hits (in one round, each from an earlier run: every head differs)."""
        assert run(llm, prompts * rounds) == one[:len(prompts) * rounds]
        for folder in folders():
            assert_files_are_the_disk_tier(llm, folder)
        return llm.get_stats().prefix_cache_disk_hits

    def start() -> LLM:
        return offload_llm(path, tmp_path / "two", tensor_parallel_size=2)

    assert serve(start()) > 0 and len(folders()) == 2
    parts = [sorted(folder.glob("*.kv")) for folder in folders()]
    parts[1][0].unlink()  # as if killed between the ranks' writes: the other part is a stray
    restarted = start()
    assert not parts[0][0].exists()
    assert serve(restarted) > 0
    del restarted
    names = sorted(part.name for part in folders()[0].glob("*.kv"))
    for i, name in enumerate(names):  # every block damaged, half in each rank's part
        part = folders()[i % 2] / name
        data = part.read_bytes()
        part.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert serve(start(), rounds=1) == 0


def test_heads_that_do_not_divide_are_refused(model_dirs: dict[str, Path],
                                              tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size .3. must divide"):
        LLM(str(model_dirs["llama"]), tensor_parallel_size=3)
    draft = tmp_path / "draft"
    shutil.copytree(model_dirs["llama"], draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 1}))
    with pytest.raises(ValueError, match="speculative_model: tensor_parallel_size .2. must "
                                         "divide the model's num_kv_heads"):
        LLM(str(model_dirs["llama"]), speculative_model=str(draft), tensor_parallel_size=2)


def blended_kv(path: Path, segments: list[list[int]], ratio: float, size: int
               ) -> torch.Tensor:
    """The KV of a blended prompt once its first token is out: [tokens, layers, K/V, heads,
    head_dim], every rank's heads."""
    engine = LLM(str(path), tensor_parallel_size=size, blend_recompute_ratio=ratio).engine
    engine.add_request({"segments": segments}, PARAMS, "r")
    for _ in range(4):  # the chunks are computed, then blended
        engine.step()
    assert engine.core.scheduler.requests["r"].num_output_tokens
    kv = engine.core.runner.read_kv_blocks(engine.core.kv_cache.get_block_ids("r"))
    return kv.permute(0, 4, 1, 2, 3, 5).flatten(0, 1)[:len(sum(segments, []))]


def test_two_ranks_blend_as_one(tmp_path: Path) -> None:
    """CacheBlend: the ranks sum their KV heads' deviations, so all recompute the same tokens
    and the prompt's KV is the single process's. The model has 4 layers: with 2, the tokens
    chosen at the second would write no KV of their own."""
    path = make_model("small", tmp_path / "small")
    a, b, c, question = random_prompts([40, 24, 57, 9], seed=5)
    segments = [b, a, c, question]
    one = blended_kv(path, segments, 0.3, 1)
    torch.testing.assert_close(blended_kv(path, segments, 0.3, 2), one, atol=1e-5, rtol=1e-5)
    # Which tokens are recomputed shows in the later layers' KV.
    assert not torch.allclose(blended_kv(path, segments, 1.0, 1)[:, 2:], one[:, 2:], atol=1e-3)


@pytest.mark.parametrize("drafts", ["ngram", "the model itself"])
def test_two_ranks_draft_and_verify_as_one(model_dirs: dict[str, Path], always_draft,
                                           drafts: str) -> None:
    """Speculative decoding: a draft model is split among the ranks like the target, so
    every rank drafts, verifies and keeps the same tokens."""
    path = model_dirs["llama"]
    speculative_model = "ngram" if drafts == "ngram" else str(path)
    one = greedy(path, speculative_model=speculative_model)
    llm = LLM(str(path), max_num_batched_tokens=64, speculative_model=speculative_model,
              tensor_parallel_size=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == one == greedy(path)
    stats = llm.get_stats()
    assert stats.num_draft_tokens > 0
    if drafts != "ngram":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
