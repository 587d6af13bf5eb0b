"""Live migration between two engines on a real checkpoint: requests moved mid-decode (their
full blocks sent ahead while they still run, then the rest) finish with exactly the tokens
they would have produced unmoved, greedy and seeded alike, with several completions, and
in a streaming window; neither engine keeps a block. Without swap space at the
destination, the request recomputes its KV instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.request import RequestStatus
from kvserve.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.models.test_hf_equivalence import kv_bytes_for_blocks

PARAMS = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=40,
                         ignore_eos=True)]


# Two seeded completions of one prompt, each with its own KV.
TWO_COMPLETIONS = SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=40, ignore_eos=True)
# Four window blocks after a sink block: these 100 tokens slide it many times.
STREAM = dict(streaming_window=4, attention_sinks=4, enable_prefix_caching=False,
              max_model_len=128)
STREAM_PARAMS = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


def engine(path: Path, swap_blocks: int = 64, **options) -> LLMEngine:
    return LLMEngine(EngineConfig.create(
        str(path), kv_cache_memory=kv_bytes_for_blocks(path, 64),
        swap_space=kv_bytes_for_blocks(path, swap_blocks), **options))


def add_all(llm: LLMEngine) -> list[str]:
    prompts = random_prompts([37, 50, 21, 29], seed=31)
    return [llm.add_request({"prompt_token_ids": p}, params)
            for p, params in zip(prompts, PARAMS + [TWO_COMPLETIONS], strict=True)]


def finish(llm: LLMEngine, done: dict[str, list[list[int]]]) -> None:
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
    kv = llm.core.kv_cache
    assert kv.num_used_blocks == 0 and kv.num_used_host_blocks == 0


@pytest.fixture(scope="module")
def unmoved(llama_dir: Path) -> dict[str, list[list[int]]]:
    llm = engine(llama_dir)
    add_all(llm)
    done: dict[str, list[list[int]]] = {}
    finish(llm, done)
    return done


@pytest.mark.parametrize("swap_blocks", [64, 0], ids=["swapped-in", "recomputed"])
def test_migrated_requests_finish_as_if_unmoved(llama_dir: Path, unmoved, swap_blocks) -> None:
    source, destination = engine(llama_dir), engine(llama_dir, swap_blocks)
    ids = add_all(source)
    for _ in range(12):  # prefills and a few decodes
        source.step()
    sent_ahead = {i: destination.receive_kv(source.export_kv(i, full_only=True)) for i in ids}
    assert len(sent_ahead[ids[-1]]) == (2 if swap_blocks else 0)  # each completion's own
    assert all(bool(blocks) == bool(swap_blocks) for sent in sent_ahead.values()
               for blocks in sent.values())
    for _ in range(3):  # the source keeps decoding while the bulk is on its way
        source.step()
    # The destination serves others meanwhile; the KV received is held, not leaked, when
    # they end (the engine checks its blocks whenever it runs out of requests).
    destination.add_request({"prompt_token_ids": [5, 6, 7]},
                            SamplingParams(temperature=0.0, max_tokens=3))
    while destination.has_unfinished_requests():
        destination.step()
    for request_id in ids:
        sent = {child: len(blocks) for child, blocks in sent_ahead[request_id].items()}
        migrated = source.detach(request_id, sent)
        assert migrated is not None
        destination.attach(migrated, sent_ahead[request_id])
        for child in migrated.kv:
            request = destination.core.scheduler.requests[child]
            assert destination.core.kv_cache.is_swapped(request) == bool(swap_blocks)
            assert (request.num_computed_tokens > 0) == bool(swap_blocks)
    assert not source.has_unfinished_requests()
    done: dict[str, list[list[int]]] = {}
    finish(destination, done)
    assert done == unmoved
    assert source.core.kv_cache.num_used_blocks == 0


def test_a_completion_that_finished_before_the_move_arrives_as_output(llama_dir: Path,
                                                                      unmoved) -> None:
    """The KV sent ahead for a completion that stops (a stop string, say) before its request
    leaves is freed at the destination; its sibling goes on as if unmoved."""
    source, destination = engine(llama_dir), engine(llama_dir)
    request_id = add_all(source)[-1]
    for _ in range(12):
        source.step()
    received = destination.receive_kv(source.export_kv(request_id, full_only=True))
    source.core.scheduler.finish_requests([f"{request_id}-0"], RequestStatus.FINISHED_STOPPED)
    migrated = source.detach(request_id, {c: len(b) for c, b in received.items()})
    assert migrated is not None and list(migrated.kv) == [f"{request_id}-1"]
    destination.attach(migrated, received)
    done: dict[str, list[list[int]]] = {}
    finish(destination, done)  # which also finds no host block left behind
    stopped, went_on = done[request_id]
    assert stopped == unmoved[request_id][0][:len(stopped)] and len(stopped) < 40
    assert went_on == unmoved[request_id][1]


def test_a_streaming_window_moves_whole_at_the_stop(llama_dir: Path) -> None:
    """Nothing is sent ahead of a request in a sliding window; after the move it streams on
    exactly as it would have unmoved."""
    prompt = random_prompts([45], seed=32)[0]
    reference = engine(llama_dir, **STREAM)
    request_id = reference.add_request({"prompt_token_ids": prompt}, STREAM_PARAMS)
    expected: dict[str, list[list[int]]] = {}
    finish(reference, expected)
    source, destination = engine(llama_dir, **STREAM), engine(llama_dir, **STREAM)
    source.add_request({"prompt_token_ids": prompt}, STREAM_PARAMS, request_id=request_id)
    for _ in range(60):  # past the window: its blocks have slid
        source.step()
    request = source.core.scheduler.requests[request_id]
    assert request.num_evicted_tokens > 0
    ahead = source.export_kv(request_id, full_only=True)
    assert ahead is not None and all(len(kv) == 0 for kv in ahead.values())
    migrated = source.detach(request_id, {})
    assert migrated is not None
    destination.attach(migrated, destination.receive_kv(ahead))
    assert destination.core.kv_cache.is_swapped(request)
    done: dict[str, list[list[int]]] = {}
    finish(destination, done)
    assert done == expected
