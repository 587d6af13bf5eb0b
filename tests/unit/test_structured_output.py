"""Structured outputs: constraints checked where they enter, and what a grammar lets a random
model write."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.openai.protocol import CompletionRequest
from kvserve.sampling_params import StructuredOutputParams
from tests.conftest import random_prompts

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["id", "name", "tags", "ok", "score"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "name": {"type": "string", "maxLength": 8},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["a", "bb", "ccc"]}},
                         "ok": {"type": "boolean"},
                         "score": {"type": ["integer", "null"], "minimum": -5, "maximum": 5}}}
# Bounded values: a JSON number may take any count of trailing zeros, which a random model
# can go on writing until max_tokens.


@pytest.mark.parametrize(("given", "words"), [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": {"type": "objekt"}}, "json is not a valid constraint"),
    ({"json": "{not json"}, "json must be a JSON schema object"),
    ({"regex": "(a"}, "regex is not a valid constraint"),
    ({"choice": ["a", ""]}, "choice must be"),
])
def test_bad_constraints_name_their_field(given, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        StructuredOutputParams(**given)


@pytest.mark.parametrize(("field", "value"), [("ignore_eos", True), ("min_tokens", 5)])
def test_eos_rules_cannot_fight_the_grammar(field, value):
    """Once the grammar is complete only EOS is allowed: ignoring or banning it would leave
    the request nothing to write (banning it made the sampler pick an out-of-range id)."""
    with pytest.raises(ValueError, match=f"^{field} cannot be set with structured_output"):
        SamplingParams(structured_output=StructuredOutputParams(regex="a"), **{field: value})


def test_openai_fields_map_to_one_constraint():
    request = CompletionRequest(prompt="x", response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
    assert request.structured_output() == StructuredOutputParams(json=SCHEMA)
    assert CompletionRequest(prompt="x", response_format={"type": "json_object"}
                             ).structured_output() == StructuredOutputParams(json_object=True)
    assert CompletionRequest(prompt="x", response_format={"type": "text"}
                             ).structured_output() is None
    assert CompletionRequest(prompt="x", guided_choice=["a"]).structured_output() == \
        StructuredOutputParams(choice=["a"])
    with pytest.raises(ValueError, match="^guided_json: json is not a valid"):
        CompletionRequest(prompt="x", guided_json={"type": 3}).structured_output()


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_num_batched_tokens=64)


def _texts(llm, constraint, temperature, n=12):
    params = SamplingParams(temperature=temperature, max_tokens=120, seed=3,
                            structured_output=constraint)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 30, 70] * (n // 3), seed=5)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)  # ended by the grammar
    return [o.outputs[0].text for o in outputs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_parses_and_validates(llm, temperature):
    for text in _texts(llm, StructuredOutputParams(json=SCHEMA), temperature):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_and_choice_hold(llm):
    pattern = r"[A-Z][a-z]{1,5} (19|20)[0-9]{2}"
    assert all(re.fullmatch(pattern, t)
               for t in _texts(llm, StructuredOutputParams(regex=pattern), 1.0))
    options = ["red", "green", "dark blue"]
    assert set(_texts(llm, StructuredOutputParams(choice=options), 1.0)) <= set(options)


def test_constrained_and_free_requests_share_a_batch(llm):
    """A free request beside constrained ones computes what it computes alone."""
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 40], seed=8)]
    alone = llm.generate(prompts[:1], free, use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=1.0, max_tokens=60,
                                 structured_output=StructuredOutputParams(json=SCHEMA))
    mixed = llm.generate(prompts, [free, constrained], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMA)


WIDE_CHOICE = [f"option {i}" for i in range(2001)]  # one parser row of 2,002 items, past 2,000


def test_a_grammar_past_the_parsers_limits_ends_its_request_with_the_error(llm):
    """Once "option" is written, the next row overflows llguidance's limit: the request ends
    there, "abort" with the parser's error, not "stop" with an output short of the grammar;
    the request beside it goes on."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 40], seed=8)]
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(prompts[:1], free, use_tqdm=False)[0].outputs[0]
    wide = SamplingParams(temperature=0.0, max_tokens=20,
                          structured_output=StructuredOutputParams(choice=WIDE_CHOICE))
    beside, failed = (o.outputs[0] for o in llm.generate(prompts, [free, wide],
                                                         use_tqdm=False))
    assert beside.token_ids == alone.token_ids and beside.error is None
    assert failed.finish_reason == "abort" and failed.text == "option"
    assert failed.error == ("structured_output: the grammar's parser stopped: Parser Error: "
                            "Current row has 2002 items; max is 2000; consider making your "
                            "grammar left-recursive if it's right-recursive")
    assert llm.engine.core.kv_cache.num_used_blocks == 0


def test_the_cpu_mask_kernel_bans_what_the_bitmask_leaves_out():
    from kvserve.cpp_extension import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels do not build")
    gen = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partial
    words = torch.randint(-2**31, 2**31 - 1, (3, 4), generator=gen, dtype=torch.int64)
    words[0, 1], words[1, 2], words[2, 0] = 0, -1, 0  # none, all and none allowed
    bitmask = words.to(torch.int32)
    logits = torch.randn(5, vocab, generator=gen)
    rows = [4, 0, 2]
    got = logits.clone()
    kernels.apply_token_bitmask(got, bitmask, torch.tensor(rows))
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(3, -1)[:, :vocab].bool()
    want = logits.clone()
    want[rows] = want[rows].masked_fill(~allowed, float("-inf"))
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_resume_inside_the_grammar(llama_dir, mode):
    """A pool of 12 blocks for requests that grow to 4-6 each: preempted ones come back with
    their outputs so far, which their new matchers replay."""
    from kvserve.config import ModelConfig

    block_bytes = ModelConfig.from_pretrained(llama_dir).kv_bytes_per_token * 16
    llm = LLM(str(llama_dir), max_num_batched_tokens=64, kv_cache_memory=12 * block_bytes,
              preemption_mode=mode)
    params = SamplingParams(temperature=1.0, max_tokens=120, seed=4,
                            structured_output=StructuredOutputParams(json=SCHEMA))
    prompts = [{"prompt_token_ids": p} for p in random_prompts([40] * 6, seed=6)]
    before = llm.get_stats().num_preemptions
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats().num_preemptions > before
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)


def test_a_slow_tokenizer_is_refused_at_the_door():
    """The grammar's token masks are built from the fast tokenizer's vocabulary."""
    from types import SimpleNamespace

    from kvserve.engine.input_processor import InputProcessor, RequestLimits

    limits = RequestLimits(max_model_len=64, vocab_size=100, block_size=16, num_kv_blocks=8)
    params = SamplingParams(structured_output=StructuredOutputParams(regex="a"))
    slow = InputProcessor(SimpleNamespace(is_fast=False), limits)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^structured_output needs a fast tokenizer"):
        slow.check_request([1, 2], params)
    assert InputProcessor(SimpleNamespace(is_fast=True), limits).check_request(  # type: ignore[arg-type]
        [1, 2], params) == 16
