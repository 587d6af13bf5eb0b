"""Bad input gets a ValueError naming the field and the limit; the engine keeps working."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.async_llm import AsyncLLM
from kvserve.errors import CheckpointError
from kvserve.sampling_params import StructuredOutputParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_model_len=256)


def assert_engine_intact(llm):
    kv = llm.engine.core.kv_cache
    kv.check_integrity()
    assert kv.num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.5, r"temperature must be in \[0, 1e\+06\], got -0.5"),
    ("temperature", 1e300, r"temperature must be in \[0, 1e\+06\], got 1e\+300"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\], got 1.5"),
    ("top_k", -2, r"top_k must be -1 or 0 \(off\) or >= 1, got -2"),
    ("n", 0, r"n must be in \[1, 128\], got 0"),
    ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
    ("logprobs", 21, r"logprobs must be in \[0, 20\], got 21"),
    ("prompt_logprobs", -1, r"prompt_logprobs must be in \[0, 20\], got -1"),
    ("min_p", 1.5, r"min_p must be in \[0, 1\], got 1.5"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be in \[1e-06, 1e\+06\], got 0.0"),
    ("repetition_penalty", 1e-300, r"repetition_penalty must be in \[1e-06, 1e\+06\]"),
    ("presence_penalty", 3.0, r"presence_penalty must be in \[-2, 2\], got 3.0"),
    ("frequency_penalty", -3.0, r"frequency_penalty must be in \[-2, 2\], got -3.0"),
    ("min_tokens", -1, "min_tokens must be >= 0, got -1"),
    ("stop", [""], "stop must be non-empty strings"),
    ("stop_token_ids", [-1], "stop_token_ids must be non-negative integers"),
    ("stop_token_ids", [1.5], r"stop_token_ids must be non-negative integers, got \[1.5\]"),
    ("stop_token_ids", ["a"], "stop_token_ids must be non-negative integers, got \\['a'\\]"),
    ("logit_bias", {5: 100.5}, r"logit_bias values must be in \[-100, 100\], got \[100.5\]"),
    ("logit_bias", {5: float("nan")}, r"logit_bias values must be in \[-100, 100\]"),
    ("logit_bias", {-1: 1.0}, r"logit_bias keys must be token ids \(non-negative integers\)"),
    ("allowed_token_ids", [], "allowed_token_ids must be a non-empty list of token ids"),
    ("allowed_token_ids", [-2], "allowed_token_ids must be a non-empty list of token ids"),
    ("seed", 2**64, r"seed must be in \[-9223372036854775808, 9223372036854775807\] "
                    r"\(64-bit\), got 18446744073709551616"),
    ("max_tokens", "5", "max_tokens must be an integer or None, got '5'"),
    ("temperature", "hot", "temperature must be a number, got 'hot'"),
    ("n", True, "n must be an integer, got True"),
    ("seed", 1.5, "seed must be an integer or None, got 1.5"),
    ("ignore_eos", 1, "ignore_eos must be true or false, got 1"),
    ("stop", 5, "stop must be a string or a list of strings, got 5"),
    ("stop_token_ids", 5, "stop_token_ids must be a list of token ids, got 5"),
    ("logit_bias", [5], "logit_bias must be a dict of token id -> bias, got \\[5\\]"),
    ("structured_output", {"json": {}}, "structured_output must be a StructuredOutputParams"),
])
def test_invalid_sampling_params(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_numpy_scalars_become_python_numbers():
    params = SamplingParams(seed=np.int64(3), max_tokens=np.int32(4),
                            temperature=np.float32(0.5), stop_token_ids=[np.int64(7)],
                            logit_bias={np.int64(8): 1.0}, allowed_token_ids=(np.int16(9),))
    assert (params.seed, params.max_tokens, params.temperature) == (3, 4, 0.5)
    assert type(params.seed) is int and type(params.temperature) is float
    assert params.stop_token_ids == [7] and type(params.stop_token_ids[0]) is int
    assert list(params.logit_bias) == [8] and type(next(iter(params.logit_bias))) is int
    assert params.allowed_token_ids == [9] and type(params.allowed_token_ids[0]) is int


@pytest.mark.parametrize(("field", "message"), [
    ("max_token", "SamplingParams has no field 'max_token' (did you mean max_tokens?)"),
    ("best_of", "SamplingParams has no field 'best_of' (vLLM's): n samples n sequences"),
    ("guided_decoding", "(vLLM's): structured_output=StructuredOutputParams(json=..."),
])
def test_a_field_sampling_params_lacks_is_named(field, message):
    with pytest.raises(TypeError) as error:
        SamplingParams(**{field: 1})
    assert message in str(error.value)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize("prompt, message", [
    ("", r"prompts\[0\] must not be empty"),
    ("a\ud800b", r"prompts\[0\] is not valid Unicode: it holds a lone surrogate \(U\+D800\)"),
    ({"prompt_token_ids": []}, r"prompts\[0\].prompt_token_ids must be a non-empty list"),
    ({"prompt_token_ids": [1, 3000]},
     r"token id 3000 is out of the vocabulary \[0, 3000\)"),
    ({"prompt_token_ids": [-1]}, r"token id -1 is out of the vocabulary"),
    ({"prompt_token_ids": ["a"]}, r"token ids must be integers, got 'a'"),
    ({"prompt_token_ids": [1, 2.0]}, r"token ids must be integers, got 2.0"),
    ({"prompt_token_ids": [1] * 256}, r"prompts\[0\] has 256 tokens; the context limit "
                                      r"\(max_model_len\) is 256"),
    (3, r"prompts\[0\] must be a string or a dict with 'prompt' or 'prompt_token_ids', got int"),
    ({"prompt": 5}, r"prompts\[0\].prompt must be a string"),
    ({"prompt": "x", "cache_salt": ""}, r"prompts\[0\].cache_salt must be a non-empty string"),
    ({"prompt": "x", "tenant": 7}, r"prompts\[0\].tenant must be a non-empty string"),
    ({"prompt": "x", "priority": "high"}, r"prompts\[0\].priority must be an integer, "
                                          r"got 'high'"),
])
def test_invalid_prompts(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    assert_engine_intact(llm)


def test_token_ids_from_numpy_are_taken(llm):
    ids = np.array([5, 6, 7])
    out = llm.generate({"prompt_token_ids": list(ids)}, SamplingParams(max_tokens=2),
                       use_tqdm=False)
    assert out[0].prompt_token_ids == [5, 6, 7] and type(out[0].prompt_token_ids[0]) is int


@pytest.mark.parametrize("call, message", [
    (lambda llm: llm.generate(None), "prompts must be a prompt .* got NoneType"),
    (lambda llm: llm.generate(b"abc"), "prompts must be a prompt .* got bytes"),
    (lambda llm: llm.generate("x", {"max_tokens": 2}),
     "sampling_params must be a SamplingParams or a list of them, got dict"),
    (lambda llm: llm.generate(["x", "y"], [SamplingParams(), {"max_tokens": 2}]),
     r"sampling_params\[1\] must be a SamplingParams, got dict"),
    (lambda llm: llm.chat("hello"), "messages must be a list of message dicts"),
])
def test_arguments_of_the_wrong_type(llm, call, message):
    with pytest.raises(ValueError, match=message):
        call(llm)
    assert_engine_intact(llm)


def test_priority_needs_one_entry_per_prompt(llm):
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=4), use_tqdm=False, priority=[0])
    assert_engine_intact(llm)


def test_max_tokens_beyond_context(llm):
    with pytest.raises(ValueError, match=r"max_tokens \(250\) plus the prompt \(10 tokens\) "
                                         r"exceeds the context limit \(max_model_len\) of 256"):
        llm.generate({"prompt_token_ids": [3] * 10}, SamplingParams(max_tokens=250),
                     use_tqdm=False)
    assert_engine_intact(llm)


def test_a_stop_token_outside_the_vocabulary(llm):
    # With min_tokens, the sampler would index the logits with it.
    with pytest.raises(ValueError, match=r"stop_token_ids: token id 3000 is out of the "
                                         r"vocabulary \[0, 3000\)"):
        llm.generate("x", SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[3000]),
                     use_tqdm=False)
    assert_engine_intact(llm)


def test_allowed_token_ids_that_could_leave_nothing_to_sample():
    for extra in ({"min_tokens": 2},
                  {"structured_output": StructuredOutputParams(choice=["a", "b"])}):
        with pytest.raises(ValueError, match="allowed_token_ids cannot be set with"):
            SamplingParams(allowed_token_ids=[5], **extra)


def test_a_biased_token_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match=r"logit_bias: token id 3000 is out of the "
                                         r"vocabulary \[0, 3000\)"):
        llm.generate("x", SamplingParams(max_tokens=4, logit_bias={3000: 5.0}), use_tqdm=False)
    assert_engine_intact(llm)
    with pytest.raises(ValueError, match=r"allowed_token_ids: token id 3000 is out of the "):
        llm.generate("x", SamplingParams(max_tokens=4, allowed_token_ids=[5, 3000]),
                     use_tqdm=False)
    assert_engine_intact(llm)


def test_a_request_whose_choices_ids_are_taken_adds_nothing(llm):
    engine = llm.engine
    engine.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2), "x-1")
    with pytest.raises(ValueError, match="request_id 'x-1' is already in use"):
        engine.add_request({"prompt_token_ids": [7, 8]}, SamplingParams(n=2, max_tokens=2), "x")
    stepped = set()
    while engine.has_unfinished_requests():
        stepped |= {out.request_id for out in engine.step()}
    assert stepped == {"x-1"}  # no choice of "x" ran
    assert_engine_intact(llm)


def test_a_step_that_fails_ends_the_calls_requests(llm, monkeypatch):
    """The error reaches the caller; the call's KV blocks go back to the pool and the next
    call runs only its own requests."""
    runner = llm.engine.core.runner
    launch = runner.launch
    calls = iter(range(1000))

    def fail_third(sched):
        if next(calls) == 2:
            raise RuntimeError("the device fell over")
        return launch(sched)

    monkeypatch.setattr(runner, "launch", fail_third)
    with pytest.raises(RuntimeError, match="the device fell over"):
        llm.generate(["a b c", "d e f g"], SamplingParams(max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
    monkeypatch.undo()
    assert_engine_intact(llm)


def test_one_bad_prompt_in_a_batch_names_its_index_and_runs_nothing(llm):
    good = {"prompt_token_ids": [4, 5, 6]}
    with pytest.raises(ValueError, match=r"prompts\[2\]"):
        llm.generate([good, good, {"prompt_token_ids": [99999]}, good],
                     SamplingParams(max_tokens=4), use_tqdm=False)
    assert_engine_intact(llm)


def test_request_larger_than_the_kv_pool(llama_dir, caplog):
    from kvserve.config import ModelConfig

    block_bytes = ModelConfig.from_pretrained(llama_dir).kv_bytes_per_token * 16
    small = LLM(str(llama_dir), kv_cache_memory=4 * block_bytes, max_model_len=256)
    assert "the pool holds fewer tokens than max_model_len (64 < 256)" in caplog.text
    with pytest.raises(ValueError, match=r"needs 5 KV blocks but the pool \(kv_cache_memory\) "
                                         r"holds 4"):
        small.generate({"prompt_token_ids": [3] * 70}, SamplingParams(max_tokens=4),
                       use_tqdm=False)
    assert_engine_intact(small)


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "int8"}, "dtype must be auto, float32, bfloat16 or float16, got 'int8'"),
    ({"block_size": 3}, "block_size must be a power of two in"),
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1, got 0"),
    ({"max_model_len": 5000}, r"max_model_len must be <= the model's context \(1024: "
                              r"max_position_embeddings, .*\), got 5000"),
    ({"kv_cache_memory": 100}, r"kv_cache_memory \(100 bytes\) must hold at least one block"),
    ({"scheduling_policy": "lottery"},
     "scheduling_policy must be one of fcfs, priority, fair, got 'lottery'"),
    ({"preemption_mode": "drop"}, "preemption_mode must be one of auto, swap, recompute"),
    ({"swap_space": -1}, "swap_space must be >= 0 bytes, got -1"),
])
def test_invalid_engine_options(llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(llama_dir), **kwargs)


@pytest.fixture
def broken_dir(llama_dir, tmp_path):
    target = tmp_path / "broken"
    shutil.copytree(llama_dir, target)
    return target


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_unknown_architecture(broken_dir):
    edit_config(broken_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match=r"architecture \['GPT2LMHeadModel'\] is not "
                                              r"supported \(supported: .*LlamaForCausalLM, "
                                              r"MistralForCausalLM"):
        LLM(str(broken_dir))


@pytest.mark.parametrize(("changes", "message"), [
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(supported: silu, "
                             r"gelu_pytorch_tanh\)"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     r"rope_scaling type 'dynamic' is not supported \(supported: default, linear, llama3, "
     r"yarn, longrope\)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": -2}},
     "rope_scaling factor must be a positive number, got -2"),
    ({"partial_rotary_factor": 0.2}, "partial_rotary_factor 0.2 of head_dim 16 must give an "
                                     "even number of rotated dimensions"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                       "long_factor": [1.0] * 7}},
     r"rope_scaling long_factor must be a list of 8 numbers \(one a rotated pair\)"),
])
def test_config_fields_the_model_cannot_run_are_named(broken_dir, changes, message):
    edit_config(broken_dir, **changes)
    with pytest.raises(CheckpointError, match=message):
        LLM(str(broken_dir))


def test_missing_folder_and_missing_weights(broken_dir, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json in"):
        LLM(str(tmp_path / "nowhere"))
    (broken_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors weights"):
        LLM(str(broken_dir))


def test_corrupt_weights(broken_dir):
    (broken_dir / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="cannot read model.safetensors"):
        LLM(str(broken_dir))


def test_corrupt_config(broken_dir):
    (broken_dir / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json .* is not valid JSON"):
        LLM(str(broken_dir))
    edit_config_text = json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64})
    (broken_dir / "config.json").write_text(edit_config_text)
    with pytest.raises(CheckpointError, match="field 'vocab_size' must be a positive integer"):
        LLM(str(broken_dir))


def test_shape_mismatch(broken_dir):
    edit_config(broken_dir, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.down_proj.weight': "
                                              r"expected shape \[64, 96\], got \[64, 128\]"):
        LLM(str(broken_dir))


def test_missing_and_unexpected_tensors(broken_dir):
    weights = load_file(broken_dir / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, broken_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"lacks tensors: layers.1.mlp.down_proj.weight"):
        LLM(str(broken_dir))
    weights["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 128)
    weights["model.layers.1.mlp.extra.weight"] = torch.zeros(64)
    save_file(weights, broken_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.1.mlp.extra"):
        LLM(str(broken_dir))


def test_pickle_checkpoints_are_never_loaded(broken_dir):
    (broken_dir / "model.safetensors").rename(broken_dir / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickled .bin checkpoints are not loaded"):
        LLM(str(broken_dir))


def test_an_unknown_engine_option_is_named_with_the_nearest_known_one(llama_dir):
    with pytest.raises(ValueError, match=r"max_num_seq is not an engine option \(did you mean "
                                         r"max_num_seqs\?\)"):
        LLM(str(llama_dir), max_num_seq=4)
    with pytest.raises(ValueError, match="num_gpu_blocks_override is not an engine option; "
                                         "see"):
        LLM(str(llama_dir), num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match=r"max_num_seq is not an engine option \(did you "):
        AsyncLLM(str(llama_dir), max_num_seq=4)  # the server's engine takes the same


def test_vllms_llm_keywords_run_where_their_meaning_holds(llama_dir, caplog):
    caplog.set_level(logging.INFO, logger="kvserve")
    llm = LLM(str(llama_dir), trust_remote_code=True, quantization=None, kv_cache_dtype="auto",
              enable_chunked_prefill=False)
    assert llm.engine.config.scheduler.policy == "prefill_first"
    assert "vLLM's trust_remote_code=True changes nothing" in caplog.text
    with pytest.raises(ValueError, match="vLLM's kv_cache_dtype='fp8' is not supported: the KV "
                                         "cache is kept in the model's dtype"):
        LLM(str(llama_dir), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="scheduler_policy or vLLM's enable_chunked_prefill"):
        LLM(str(llama_dir), enable_chunked_prefill=True, scheduler_policy="chunked")
    # vLLM's swap_space is in GiB, kvserve's in bytes: a count of GiB holds no block.
    with pytest.raises(ValueError, match=r"swap_space \(4 bytes\) holds no KV block, of \d+ "
                                         r"bytes: it is a size in bytes"):
        LLM(str(llama_dir), swap_space=4)
