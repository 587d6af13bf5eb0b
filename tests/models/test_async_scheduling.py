"""Async scheduling: each step is scheduled and launched before the step it follows has
brought its tokens to the host. Outputs must be the tokens a synchronous engine produces,
through chunked prefill, preemption, stops, aborts and migration, with no block leaked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.core.scheduler.output import PENDING_TOKEN
from kvserve.engine.llm_engine import LLMEngine
from tests.conftest import random_prompts
from tests.models.test_hf_equivalence import (
    MAX_TOKENS,
    PROMPT_LENS,
    SETTINGS,
    assert_no_blocks_held,
    hf_greedy,
    kv_bytes_for_blocks,
    run_greedy,
)


def count_pending_tokens(engine: LLMEngine) -> list[int]:
    """Counts, as the engine runs, the tokens that steps took from the step before on the
    device: none would mean the steps never overlapped."""
    count = [0]
    launch = engine.core.runner.launch

    def counting(sched):
        count[0] += sum(s.token_ids.count(PENDING_TOKEN) for s in sched.scheduled)
        return launch(sched)

    engine.core.runner.launch = counting
    return count


# The parity schedules that async scheduling runs (not beside speculative decoding), less
# those that turn it on themselves.
ASYNC_SETTINGS = [s for s, options in SETTINGS.items() if s != "single-token-budget"
                  and not {"speculative_model", "async_scheduling"} & options.keys()]


@pytest.mark.parametrize("setting", ASYNC_SETTINGS)
def test_greedy_matches_transformers(llama_dir, setting):
    kwargs = dict(SETTINGS[setting])
    if "kv_blocks" in kwargs:
        kwargs["kv_cache_memory"] = kv_bytes_for_blocks(llama_dir, kwargs.pop("kv_blocks"))
    llm = LLM(str(llama_dir), async_scheduling=True, **kwargs)
    pending = count_pending_tokens(llm.engine)
    prompts = random_prompts(PROMPT_LENS, seed=len(setting))
    got = run_greedy(llm, prompts)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(llama_dir, tuple(prompt), MAX_TOKENS), f"prompt of {len(prompt)}"
    assert pending[0] > 0
    if setting.startswith("preemption"):
        assert llm.engine.core.scheduler.num_preemptions > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_greedy_matches_transformers_on_cuda(llama_dir, enforce_eager):
    """The pending tokens cross from step to step on the device, into graph replays too."""
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", max_num_batched_tokens=64,
              async_scheduling=True, enforce_eager=enforce_eager)
    pending = count_pending_tokens(llm.engine)
    prompts = random_prompts(PROMPT_LENS, seed=1)
    for prompt, tokens in zip(prompts, run_greedy(llm, prompts), strict=True):
        assert tokens == hf_greedy(llama_dir, tuple(prompt), MAX_TOKENS)
    assert pending[0] > 0


def generate(path: Path, params: list[SamplingParams], prompts: list[list[int]],
             **options) -> list[list[list[int]]]:
    llm = LLM(str(path), **options)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_no_blocks_held(llm)
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_stops_lengths_and_seeded_sampling_come_out_as_without(llama_dir):
    """A request that stops (a stop token, its max_tokens) while the next step is in flight
    loses that step's token; seeded requests draw what they would have; a request that needs
    its tokens on the host (penalties, logprobs, min_tokens) makes its steps wait."""
    prompts = random_prompts([5, 40, 17, 90, 33, 8], seed=21)
    plain = [SamplingParams(temperature=0.0, max_tokens=3 + 7 * i, ignore_eos=True)
             for i in range(len(prompts))]
    reference = generate(llama_dir, plain, prompts, max_num_batched_tokens=48)
    # Stop each request at its third token: it then ends mid-flight.
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                             stop_token_ids=[tokens[0][2]]) if i % 2 else p
              for i, (p, tokens) in enumerate(zip(plain, reference, strict=True))]
    params[2] = SamplingParams(temperature=0.8, top_k=50, seed=5, n=2, max_tokens=30,
                               ignore_eos=True)
    params[4] = SamplingParams(temperature=0.9, seed=9, presence_penalty=0.5, logprobs=2,
                               min_tokens=4, max_tokens=12, ignore_eos=True)
    expected = generate(llama_dir, params, prompts, max_num_batched_tokens=48)
    got = generate(llama_dir, params, prompts, max_num_batched_tokens=48,
                   async_scheduling=True)
    assert got == expected
    for i in (1, 3, 5):  # stopped by the third token at the latest
        tokens = expected[i][0]
        assert tokens[-1] == params[i].stop_token_ids[0] and len(tokens) <= 3


def test_an_abort_while_its_step_is_in_flight_frees_everything(llama_dir):
    engine = LLMEngine(EngineConfig.create(str(llama_dir), async_scheduling=True))
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params)
           for p in random_prompts([20, 31, 12], seed=22)]
    for _ in range(5):
        engine.step()
    assert engine.core._in_flight is not None
    engine.abort_request(ids[1])
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert set(done) == {ids[0], ids[2]}
    assert all(len(done[i].outputs[0].token_ids) == 30 for i in (ids[0], ids[2]))
    kv = engine.core.kv_cache
    kv.check_integrity()
    assert kv.num_used_blocks == 0


def test_a_request_migrated_mid_flight_finishes_as_if_unmoved(llama_dir):
    """`detach` first takes in the step in flight, so the request leaves with every token
    it has and the KV of all but its last."""
    def engine(**options) -> LLMEngine:
        return LLMEngine(EngineConfig.create(
            str(llama_dir), kv_cache_memory=kv_bytes_for_blocks(llama_dir, 64),
            swap_space=kv_bytes_for_blocks(llama_dir, 64), **options))

    prompt = random_prompts([37], seed=23)[0]
    params = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=30, ignore_eos=True)

    def run(llm: LLMEngine) -> list[list[int]]:
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.finished:
                    return [c.token_ids for c in out.outputs]
        raise AssertionError("no output")

    reference = engine()
    reference.add_request({"prompt_token_ids": prompt}, params, request_id="r")
    expected = run(reference)
    source, destination = engine(async_scheduling=True), engine()
    source.add_request({"prompt_token_ids": prompt}, params, request_id="r")
    for _ in range(8):
        source.step()
    assert source.core._in_flight is not None
    migrated = source.detach("r", {})
    assert migrated is not None
    destination.attach(migrated, {})  # nothing sent ahead: all its KV comes now
    assert run(destination) == expected
    source.step()  # the outputs taken in before the move go nowhere
    assert not source.has_unfinished_requests()
    assert source.core.kv_cache.num_used_blocks == 0


def test_async_scheduling_refuses_what_it_cannot_overlap(llama_dir):
    assert not EngineConfig.create(str(llama_dir)).async_scheduling  # no gain on the CPU
    with pytest.raises(ValueError, match="async_scheduling does not run with speculative"):
        EngineConfig.create(str(llama_dir), async_scheduling=True, speculative_model="ngram")
    with pytest.raises(ValueError, match="async_scheduling does not run with a streaming"):
        EngineConfig.create(str(llama_dir), async_scheduling=True, streaming_window=4,
                            enable_prefix_caching=False)
