"""Live migration between two engines on a real checkpoint: requests moved mid-decode (their
full blocks sent ahead while they still run, then the rest) finish with exactly the tokens
they would have produced unmoved, greedy and seeded alike, and neither engine keeps a
block. Without swap space at the destination, the request recomputes its KV instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.models.test_hf_equivalence import kv_bytes_for_blocks

PARAMS = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=40,
                         ignore_eos=True)]


def engine(path: Path, swap_blocks: int = 64) -> LLMEngine:
    return LLMEngine(EngineConfig.create(
        str(path), kv_cache_memory=kv_bytes_for_blocks(path, 64),
        swap_space=kv_bytes_for_blocks(path, swap_blocks)))


def add_all(llm: LLMEngine) -> list[str]:
    prompts = random_prompts([37, 50, 21], seed=31)
    return [llm.add_request({"prompt_token_ids": p}, params)
            for p, params in zip(prompts, PARAMS, strict=True)]


def finish(llm: LLMEngine, done: dict[str, list[int]]) -> None:
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    kv = llm.core.kv_cache
    assert kv.num_used_blocks == 0 and kv.num_used_host_blocks == 0


@pytest.fixture(scope="module")
def unmoved(llama_dir: Path) -> dict[str, list[int]]:
    llm = engine(llama_dir)
    add_all(llm)
    done: dict[str, list[int]] = {}
    finish(llm, done)
    return done


@pytest.mark.parametrize("swap_blocks", [64, 0], ids=["swapped-in", "recomputed"])
def test_migrated_requests_finish_as_if_unmoved(llama_dir: Path, unmoved, swap_blocks) -> None:
    source, destination = engine(llama_dir), engine(llama_dir, swap_blocks)
    ids = add_all(source)
    for _ in range(12):  # prefills and a few decodes
        source.step()
    sent_ahead = {i: destination.receive_kv(source.export_kv(i, full_only=True)) for i in ids}
    assert all(bool(blocks) == bool(swap_blocks) for blocks in sent_ahead.values())
    for _ in range(3):  # the source keeps decoding while the bulk is on its way
        source.step()
    # The destination serves others meanwhile; the KV received is held, not leaked, when
    # they end (the engine checks its blocks whenever it runs out of requests).
    destination.add_request({"prompt_token_ids": [5, 6, 7]},
                            SamplingParams(temperature=0.0, max_tokens=3))
    while destination.has_unfinished_requests():
        destination.step()
    for request_id in ids:
        migrated = source.detach(request_id, len(sent_ahead[request_id]))
        assert migrated is not None
        destination.attach(migrated, sent_ahead[request_id])
        request = destination.core.scheduler.requests[request_id]
        assert destination.core.kv_cache.is_swapped(request) == bool(swap_blocks)
        assert (request.num_computed_tokens > 0) == bool(swap_blocks)
    assert not source.has_unfinished_requests()
    done: dict[str, list[int]] = {}
    finish(destination, done)
    assert done == unmoved
    assert source.core.kv_cache.num_used_blocks == 0
