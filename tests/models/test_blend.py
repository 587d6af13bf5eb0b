"""CacheBlend: prompts given as segments reuse their chunks' KV wherever the chunks appear.
Recomputing every reused token gives transformers' greedy output on the joined prompt; a
chunk reused where it was computed (first) is exact with no recompute at all; the copied KV
is the chunk's own, moved to its new positions; no block is left held."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.models.test_hf_equivalence import (
    MAX_TOKENS,
    assert_no_blocks_held,
    hf_greedy,
    kv_bytes_for_blocks,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def corpus(seed: int = 5) -> list[list[int]]:
    """Chunks of a few blocks, a block and a half, one token, and a question."""
    return random_prompts([40, 16, 24, 1, 57, 9], seed=seed)


def blended(llm: LLM, segment_lists: list[list[list[int]]],
            params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"segments": s} for s in segment_lists], params, use_tqdm=False)
    assert_no_blocks_held(llm)
    return [o.outputs[0].token_ids for o in outputs]


SETTINGS = {
    "default": {},
    "eager": {"enforce_eager": True},
    "small-pool": {"kv_blocks": 30, "max_num_seqs": 2},
}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_full_recompute_matches_transformers(model_dirs, arch, setting):
    """Chunks in several orders, cold then cached, batched with plain prompts."""
    path = model_dirs[arch]
    kwargs = dict(SETTINGS[setting])
    if "kv_blocks" in kwargs:
        kwargs["kv_cache_memory"] = kv_bytes_for_blocks(path, kwargs.pop("kv_blocks"))
    assert_full_recompute_matches_transformers(path, **kwargs)


def assert_full_recompute_matches_transformers(path: Path, **kwargs: object) -> None:
    llm = LLM(str(path), blend_recompute_ratio=1.0, **kwargs)
    a, b, c, d, e, question = corpus()
    segment_lists = [[a, b, question], [b, a, c, question], [d, e, a, question],
                     [a, b, question], [c, d, b, e, question]]
    plain = random_prompts([30, 5], seed=8)
    outputs = llm.generate([{"segments": s} for s in segment_lists]
                           + [{"prompt_token_ids": p} for p in plain], GREEDY, use_tqdm=False)
    assert_no_blocks_held(llm)
    prompts = [sum(s, []) for s in segment_lists] + plain
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, tuple(prompt), MAX_TOKENS)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_blended_prompts == len(segment_lists)
    assert scheduler.num_chunk_hit_tokens > 0 and scheduler.num_chunk_fill_tokens > 0


@pytest.mark.parametrize("budget", [2048, 16])
def test_chunk_first_in_the_prompt_needs_no_recompute(llama_dir, budget):
    """A chunk at position 0 has the same KV on its own as in the prompt: with nothing
    recomputed, the output is the full prefill's, in one step or in chunks of 16."""
    llm = LLM(str(llama_dir), blend_recompute_ratio=0.0, max_num_batched_tokens=budget)
    a, _, _, _, _, question = corpus()
    for _ in range(2):  # the chunk computed, then found
        got = blended(llm, [[a, question]])[0]
        assert got == hf_greedy(llama_dir, tuple(a + question), MAX_TOKENS)


def test_copied_keys_are_moved_to_their_positions(llama_dir):
    assert_copied_keys_are_moved(llama_dir)


def assert_copied_keys_are_moved(path: Path, layer: int = 0, ratio: float = 0.0) -> None:
    """A blended prompt's KV at `layer` equals the full prefill's. The first layer's depends
    on each token and its position alone, so a chunk's KV copied behind another is moved
    there exactly; with a ratio above 0, the second layer's is refreshed in context."""
    a, b, *_, question = corpus()
    prompt = a + b + question
    kvs = {}
    for blend, request in ((False, {"prompt_token_ids": prompt}),
                           (True, {"segments": [a, b, question]})):
        llm = LLM(str(path), blend_recompute_ratio=ratio, enable_prefix_caching=True)
        engine = llm.engine
        engine.add_request(request, SamplingParams(max_tokens=4, ignore_eos=True), "r")
        while not engine.core.scheduler.requests["r"].num_output_tokens:
            engine.step()
        table = engine.core.kv_cache.get_block_ids("r")
        kv = engine.core.runner.kv_cache[layer]  # [K/V, heads, blocks, block_size, dim]
        kvs[blend] = kv[:, :, table].flatten(2, 3)[:, :, :len(prompt) - 1].clone()
    torch.testing.assert_close(kvs[True], kvs[False], atol=1e-5, rtol=1e-5)


def test_prompt_beyond_the_budget_is_blended_in_chunks(llama_dir):
    """Each chunk under the budget recomputes its own share in context, over the KV of the
    chunks before it; a chunk boundary may fall anywhere in a segment."""
    llm = LLM(str(llama_dir), max_num_batched_tokens=24, blend_recompute_ratio=1.0)
    a, b, c, *_, question = corpus()
    for segments in ([a, c, b, question], [c, a, question]):
        got = blended(llm, [segments])[0]
        assert got == hf_greedy(llama_dir, tuple(sum(segments, [])), MAX_TOKENS)
    assert llm.engine.core.scheduler.num_blended_prompts == 2


def test_bad_segments_name_the_field(llama_dir):
    llm = LLM(str(llama_dir))
    a, *_ = corpus()
    for segments, message in (([a], "at least 2 segments"), ([a, ""], r"segments\[1\]"),
                              ([a, [10**9]], "out of the vocabulary"),
                              ([a, "x\udfff"], r"segments\[1\] is not valid Unicode"),
                              ("text", "at least 2 segments")):
        with pytest.raises(ValueError, match=message):
            llm.generate({"segments": segments}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate({"segments": [a, a]}, SamplingParams(prompt_logprobs=1), use_tqdm=False)
    off = LLM(str(llama_dir), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching"):
        off.generate({"segments": [a, a]}, GREEDY, use_tqdm=False)
    assert_no_blocks_held(llm)


def test_abort_while_chunks_fill_lets_go_of_their_blocks(llama_dir):
    llm = LLM(str(llama_dir))
    engine = llm.engine
    a, b, *_, question = corpus()
    engine.add_request({"segments": [a, b, question]}, GREEDY, "r")
    engine.step()  # computes the chunks; the prompt waits for the next step
    assert engine.core.kv_cache.segment_holds["r"]
    engine.abort_request("r")
    assert_no_blocks_held(llm)
    # The chunks stay cached: the same segments in another order hit them.
    blended(llm, [[b, a, question]])
    scheduler = engine.core.scheduler
    assert scheduler.num_chunk_hit_tokens == len(a) + len(b)
    assert scheduler.num_chunk_fill_tokens == len(a) + len(b)


def test_preempted_blended_prompt_goes_on_plainly(llama_dir):
    """Under a pool too small for all, blended prompts are preempted by recompute after their
    blend step; their outputs stay those of full recompute."""
    llm = LLM(str(llama_dir), blend_recompute_ratio=1.0, max_num_batched_tokens=160,
              preemption_mode="recompute", kv_cache_memory=kv_bytes_for_blocks(llama_dir, 22))
    a, b, c, d, e, question = corpus()
    segment_lists = [[a, b, question], [c, e, question], [e, d, a, question],
                     [b, c, question]]
    got = blended(llm, segment_lists, SamplingParams(temperature=0.0, max_tokens=60,
                                                     ignore_eos=True))
    for segments, tokens in zip(segment_lists, got, strict=True):
        assert tokens == hf_greedy(llama_dir, tuple(sum(segments, [])), 60)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert scheduler.num_blended_prompts == len(segment_lists)  # none blended twice


def test_chunks_evicted_to_the_host_tier_are_loaded_back(llama_dir):
    """The chunk store is the prefix cache: chunks pushed out of a small pool by other
    prompts go to the host tier, and a later blended prompt loads them from there."""
    llm = LLM(str(llama_dir), blend_recompute_ratio=1.0,
              kv_cache_memory=kv_bytes_for_blocks(llama_dir, 24),
              kv_offload_host=kv_bytes_for_blocks(llama_dir, 64))
    a, b, *_, question = corpus()
    blended(llm, [[a, b, question]])
    for prompt in random_prompts([120, 120], seed=9):  # fills the pool, evicting the chunks
        llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    got = blended(llm, [[b, a, question]])[0]
    assert got == hf_greedy(llama_dir, tuple(b + a + question), MAX_TOKENS)
    stats = llm.get_stats()
    assert stats.blend_chunk_hit_tokens == len(a) + len(b)
    assert stats.blend_chunk_fill_tokens == len(a) + len(b)
    assert stats.prefix_cache_host_hits > 0
    host_hits = stats.prefix_cache_host_hits
    blended(llm, [[a, b, question]])  # now back in the pool
    assert llm.get_stats().prefix_cache_host_hits == host_hits


def test_waiting_blended_prompt_lets_go_of_its_chunks_for_a_running_request(llama_dir):
    """A blended prompt holds its chunks while it waits for blocks; a running request that
    runs short takes them back instead of being preempted."""
    llm = LLM(str(llama_dir), kv_cache_memory=kv_bytes_for_blocks(llama_dir, 12))
    engine = llm.engine
    a, b, *_, question = corpus()
    long_prompt = random_prompts([100], seed=12)[0]
    engine.add_request({"prompt_token_ids": long_prompt},
                       SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), "long")
    engine.add_request({"segments": [a, b, question]}, GREEDY, "blended")
    done = {}
    for _ in range(500):  # a few times the steps it takes: held chunks must not stall it
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert done["long"] == hf_greedy(llama_dir, tuple(long_prompt), 60)
    assert engine.core.scheduler.num_preemptions == 0
    assert engine.core.scheduler.num_blended_prompts == 1
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("seed", range(4))
def test_random_mixes_of_blended_and_plain_prompts_end_with_every_block_back(llama_dir, seed):
    """Blended and plain prompts arriving over time with shared chunks, aborts, small pools,
    preemption and the host tier: the engine finishes everything and holds no block."""
    rng = random.Random(seed)
    llm = LLM(str(llama_dir), kv_cache_memory=kv_bytes_for_blocks(llama_dir,
                                                                  rng.choice([30, 40])),
              max_num_batched_tokens=rng.choice([16, 64, 128]),
              max_num_seqs=rng.choice([2, 4]),
              blend_recompute_ratio=rng.choice([0.0, 0.15]),
              preemption_mode=rng.choice(["recompute", "swap"]),
              kv_offload_host=kv_bytes_for_blocks(llama_dir, 16))
    engine = llm.engine
    chunks = random_prompts([rng.randrange(1, 60) for _ in range(6)], seed=seed)
    for index in range(30):
        segments = rng.sample(chunks, rng.randrange(1, 4)) + random_prompts([3], seed=index)
        prompt = ({"segments": segments} if rng.random() < 0.7
                  else {"prompt_token_ids": sum(segments, [])})
        engine.add_request(prompt, SamplingParams(temperature=rng.choice([0.0, 1.0]),
                                                  max_tokens=rng.randrange(1, 30),
                                                  ignore_eos=True), f"r{index}")
        if rng.random() < 0.1:
            engine.abort_request(f"r{rng.randrange(index + 1)}")
        for _ in range(rng.randrange(0, 4)):
            engine.step()
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    assert llm.get_stats().num_blended_prompts > 0
    assert_no_blocks_held(llm)
