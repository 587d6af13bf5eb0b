"""Global prefix sharing on a real engine: same outputs as FCFS, in the caller's order."""

import random

from kvserve import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.models.test_hf_equivalence import kv_bytes_for_blocks


def test_grouped_admission_returns_fcfs_outputs_in_input_order(llama_dir):
    heads = random_prompts([48, 48, 48], seed=21)
    tails = random_prompts([5 + i % 7 for i in range(18)], seed=22)
    prompts = [heads[i % 3] + tail for i, tail in enumerate(tails)]
    random.Random(0).shuffle(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i % 5, ignore_eos=True)
              for i in range(len(prompts))]
    runs = {}
    for sharing in ("off", "auto"):
        # A pool that holds one head and a few running requests, or two heads.
        llm = LLM(str(llama_dir), prefix_sharing=sharing, max_num_seqs=4,
                  kv_cache_memory=kv_bytes_for_blocks(llama_dir, 10))
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert [o.prompt_token_ids for o in outputs] == prompts
        llm.engine.core.kv_cache.check_integrity()
        runs[sharing] = ([o.outputs[0].token_ids for o in outputs], llm.get_stats())
    assert runs["auto"][0] == runs["off"][0]
    assert runs["auto"][1].prefix_cache_hits > runs["off"][1].prefix_cache_hits
    assert runs["auto"][1].kv_blocks_used == 0


def test_prefix_sharing_value_is_checked(llama_dir):
    import pytest

    with pytest.raises(ValueError, match="prefix_sharing must be one of auto, off"):
        LLM(str(llama_dir), prefix_sharing="always")


def test_a_follow_up_chat_turn_reuses_the_earlier_turn(llama_dir):
    llm = LLM(str(llama_dir))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    chat = [{"role": "system", "content": "You answer briefly. " * 8},
            {"role": "user", "content": "What is a KV cache?"}]
    reply = llm.chat(chat, params, use_tqdm=False)[0].outputs[0].text
    turn1_tokens = len(llm.engine.inputs.apply_chat_template(chat))
    before = llm.get_stats().prefix_cache_hits
    chat += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
    llm.chat(chat, params, use_tqdm=False)
    hits = llm.get_stats().prefix_cache_hits - before
    block = llm.engine.config.cache.block_size
    assert hits >= turn1_tokens // block * block  # at least the whole first prompt's blocks
