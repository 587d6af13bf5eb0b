"""Every sampling field at the edges of what it accepts, combined at random in one batch on a
KV pool small enough to preempt: no step fails, and every token is one of the vocabulary."""

from __future__ import annotations

import random

from kvserve import LLM, SamplingParams
from kvserve.config import ModelConfig
from kvserve.sampling_params import StructuredOutputParams
from tests.conftest import random_prompts
from tests.e2e.test_bad_input import assert_engine_intact

VOCAB = 3000
EDGES = {
    "temperature": [0.0, 1e-300, 9.9e-6, 1e-5, 1.0, 1e6],
    "top_p": [1e-300, 0.5, 1.0],
    "top_k": [-1, 0, 1, 2, 10**12],
    "min_p": [0.0, 1e-300, 1.0],
    "repetition_penalty": [1e-6, 1.0, 1e6],
    "presence_penalty": [-2.0, 2.0],
    "frequency_penalty": [-2.0, 2.0],
    "seed": [None, -2**63, 2**63 - 1],
    "n": [1, 3],
    "min_tokens": [0, 4],
    "stop_token_ids": [[], [0, VOCAB - 1]],
    "logprobs": [None, 0, 20],
    "structured_output": [None, StructuredOutputParams(choice=["yes", "no"]),
                          StructuredOutputParams(regex="[0-9]{1,4}")],
}


def random_params(rng: random.Random) -> SamplingParams:
    fields = {name: rng.choice(values) for name, values in EDGES.items() if rng.random() < 0.4}
    if fields.get("structured_output") is not None:
        fields.pop("min_tokens", None)
    return SamplingParams(max_tokens=rng.choice([4, 6, 12]), **fields)


def test_edge_values_combined_never_fail_a_step(llama_dir):
    block_bytes = ModelConfig.from_pretrained(llama_dir).kv_bytes_per_token * 16
    llm = LLM(str(llama_dir), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
              kv_cache_memory=10 * block_bytes)
    rng = random.Random(0)
    params = [random_params(rng) for _ in range(120)]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(
        [rng.randint(1, 40) for _ in params], seed=1)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(0 <= t < VOCAB for out in outputs for c in out.outputs for t in c.token_ids)
    assert llm.engine.stats().num_preemptions > 0
    assert_engine_intact(llm)
