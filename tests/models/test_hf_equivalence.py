"""Greedy tokens and logprobs equal to transformers on the same checkpoint, in float32."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, RequestOutput, SamplingParams
from kvserve.config import ModelConfig
from kvserve.tools.make_model import make_model
from tests.conftest import ARCHES, SLIDING_WINDOW, random_prompts

PROMPT_LENS = [1, 7, 33, 120, 250]
MAX_TOKENS = 20


@functools.cache
def hf_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def hf_greedy(path: Path, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def assert_like_hf_greedy(path: Path, prompt: list[int], tokens: list[int]) -> None:
    """`tokens` are transformers' greedy tokens for `prompt`, or part from them only at a tie:
    after the prompt and the tokens before it, each token's logit in transformers is its top
    one within float32 rounding (random weights can tie two tokens to an ulp, which two
    correct implementations may round either way)."""
    if tokens == hf_greedy(path, tuple(prompt), len(tokens)):
        return
    with torch.inference_mode():
        logits = hf_model(path)(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    for i, token in enumerate(tokens):
        top = logits[i].max()
        assert top - logits[i, token] <= 1e-5 * max(1.0, top.abs().item()), \
            f"prompt of {len(prompt)}: token {i} is {token}, transformers' top is " \
            f"{logits[i].argmax().item()} by {(top - logits[i, token]).item():.3g}"


def assert_prompt_logprobs_like_hf(path: Path, prompts: list[list[int]],
                                   outputs: list[RequestOutput]) -> None:
    """Every prompt token's logprob (within 1e-4), rank and top-3 (of SamplingParams'
    prompt_logprobs=3) are transformers' log-softmax's, up to ties within rounding."""
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(path)(torch.tensor([prompt])).logits[0].float(), -1)
        scored = out.prompt_logprobs
        assert scored is not None and len(scored) == len(prompt) and scored[0] is None
        for position in range(1, len(prompt)):
            entry, row, token = scored[position], ref[position - 1], prompt[position]
            assert abs(entry[token].logprob - row[token].item()) < 1e-4
            # Its rank among transformers' logprobs, up to those within rounding of it.
            above, near = (int((row > row[token] + sign * 1e-5).sum()) for sign in (1, -1))
            assert above + 1 <= entry[token].rank <= near + 1
            # Its top 3 are transformers' top 3 (or, at a tie, tokens of the same logprob).
            torch.testing.assert_close(row[list(entry)[:3]], torch.topk(row, 3).values,
                                       rtol=0, atol=1e-5)


def kv_bytes_for_blocks(path: Path, num_blocks: int, block_size: int = 16) -> int:
    return ModelConfig.from_pretrained(path).kv_bytes_per_token * block_size * num_blocks


def assert_no_blocks_held(llm: LLM) -> None:
    """The pool is consistent and every device and host block is back."""
    kv = llm.engine.core.kv_cache
    kv.check_integrity()
    assert kv.num_used_blocks == 0 and kv.num_used_host_blocks == 0


def run_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS
               ) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_no_blocks_held(llm)
    return [o.outputs[0].token_ids for o in outputs]


SETTINGS = {
    "default": {},
    "small-chunks": {"max_num_batched_tokens": 16},
    "single-token-budget": {"max_num_batched_tokens": 1},
    "preemption": {"max_num_batched_tokens": 64, "kv_blocks": 24,
                   "preemption_mode": "recompute"},
    "preemption-swap": {"max_num_batched_tokens": 64, "kv_blocks": 24, "preemption_mode": "swap"},
    "prefill-first": {"max_num_batched_tokens": 96, "scheduler_policy": "prefill_first"},
    # Features at once: drafts verified (and swapped out) beside preempted requests, and
    # preemption while the next step is scheduled ahead of the last one's tokens.
    "preemption-swap-speculative": {"max_num_batched_tokens": 64, "kv_blocks": 24,
                                    "preemption_mode": "swap", "speculative_model": "ngram"},
    "preemption-async": {"max_num_batched_tokens": 32, "kv_blocks": 24,
                         "preemption_mode": "recompute", "async_scheduling": True},
}
ONE_ARCH_SETTINGS = ("single-token-budget", "prefill-first", "preemption-swap",
                     "preemption-swap-speculative", "preemption-async")


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", ARCHES)
def test_greedy_matches_transformers(model_dirs, arch, setting):
    path = model_dirs[arch]
    if setting in ONE_ARCH_SETTINGS and arch != "llama":
        pytest.skip("one architecture is enough for this schedule")
    kwargs = dict(SETTINGS[setting])
    if "kv_blocks" in kwargs:
        kwargs["kv_cache_memory"] = kv_bytes_for_blocks(path, kwargs.pop("kv_blocks"))
    llm = LLM(str(path), **kwargs)
    prompts = random_prompts(PROMPT_LENS, seed=len(setting))
    got = run_greedy(llm, prompts)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert_like_hf_greedy(path, prompt, tokens)
    scheduler = llm.engine.core.scheduler
    if setting.startswith("preemption"):
        assert scheduler.num_preemptions > 0
        swapped = scheduler.num_swapped_preemptions
        swap = SETTINGS[setting]["preemption_mode"] == "swap"
        assert swapped == (scheduler.num_preemptions if swap else 0)
    if "speculative_model" in kwargs:
        assert llm.get_stats().num_accepted_tokens > 0


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_priority_and_fair_preemption_keep_greedy_outputs(model_dirs, policy):
    """Low-priority requests of one tenant run first; outranking ones (high priority, or
    another tenant) arrive while they decode, through two sequence slots and a small pool,
    so that the running ones are preempted (by swap) or see their chunks deferred."""
    path = model_dirs["llama"]
    llm = LLM(str(path), max_num_batched_tokens=32, max_num_seqs=2, scheduling_policy=policy,
              kv_cache_memory=kv_bytes_for_blocks(path, 24))
    engine = llm.engine
    prompts = random_prompts(PROMPT_LENS, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = {}

    def submit(index: int, priority: int, tenant: str) -> None:
        engine.add_request({"prompt_token_ids": prompts[index], "priority": priority,
                            "tenant": tenant}, params, request_id=str(index))

    def run_steps(count: int) -> None:
        for _ in range(count):
            outputs.update((o.request_id, o) for o in engine.step() if o.finished)

    submit(0, 5, "bulk")
    submit(3, 5, "bulk")
    run_steps(6)  # both bulk requests are decoding
    for index in (1, 2, 4):
        submit(index, 0, f"urgent-{index}")
    while engine.has_unfinished_requests():
        run_steps(1)
    for index, prompt in enumerate(prompts):
        got = outputs[str(index)].outputs[0].token_ids
        assert got == hf_greedy(path, tuple(prompt), MAX_TOKENS), f"prompt of {len(prompt)}"
    assert_no_blocks_held(llm)
    assert engine.core.scheduler.num_swapped_preemptions > 0


def shared_head_prompts() -> list[list[int]]:
    """Prompts that share heads of whole blocks, one block and a half, and all their tokens,
    with the short and the long sharer first in turn."""
    head, other, *tails = random_prompts([64, 24, 1, 9, 40, 17, 3], seed=11)
    return [head + tails[0], head + tails[1], head[:40] + tails[2], head, head + tails[1],
            other + tails[3], head + tails[4]]


@pytest.mark.parametrize("setting", ["default", "small-chunks", "preemption", "preemption-swap"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_cache_hits_keep_greedy_outputs(model_dirs, arch, setting):
    """Twice over the same batch, so the second run is served from the cache, beside a
    run with caching off."""
    path = model_dirs[arch]
    kwargs = dict(SETTINGS[setting])
    if "kv_blocks" in kwargs:  # ten: the longest request alone needs eight
        kwargs["kv_cache_memory"] = kv_bytes_for_blocks(path, 10)
        del kwargs["kv_blocks"]
    prompts = shared_head_prompts()
    expected = [hf_greedy(path, tuple(p), MAX_TOKENS) for p in prompts]
    assert run_greedy(LLM(str(path), enable_prefix_caching=False, **kwargs), prompts) == expected
    llm = LLM(str(path), **kwargs)
    for _ in range(2):
        assert run_greedy(llm, prompts) == expected
    kv = llm.engine.core.kv_cache
    assert kv.prefix_cache_hits >= 64 * len(prompts) // 2
    if setting.startswith("preemption"):
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_mistral_prompt_longer_than_sliding_window(model_dirs):
    path = model_dirs["mistral"]
    assert ModelConfig.from_pretrained(path).sliding_window == SLIDING_WINDOW
    prompts = random_prompts([5 * SLIDING_WINDOW, 2 * SLIDING_WINDOW + 3], seed=7)
    for budget in (2048, 48):
        llm = LLM(str(path), max_num_batched_tokens=budget)
        for prompt, tokens in zip(prompts, run_greedy(llm, prompts), strict=True):
            assert tokens == hf_greedy(path, tuple(prompt), MAX_TOKENS)


def test_sample_logprobs_match_transformers_log_softmax(model_dirs):
    path = model_dirs["qwen2"]
    llm = LLM(str(path))
    prompts = random_prompts([9, 60], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        full = torch.tensor([prompt + completion.token_ids])
        with torch.inference_mode():
            logits = hf_model(path)(full).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)
        assert len(completion.logprobs) == 6
        for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs,
                                               strict=True)):
            row = ref[len(prompt) - 1 + i]
            top = torch.topk(row, 5)
            assert list(entry)[:5] == top.indices.tolist()
            for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist(),
                                                    strict=True), start=1):
                assert entry[tid].rank == rank
                assert abs(entry[tid].logprob - value) < 1e-4
            assert entry[token].rank == 1  # greedy picks the top token


@pytest.mark.parametrize("setting", ["default", "small-chunks", "preemption", "preemption-swap"])
def test_prompt_logprobs_match_transformers_log_softmax(model_dirs, setting):
    """Every prompt token's logprob, rank and top-3 across chunk boundaries, with a shared
    head that prefix caching must not serve (its logits are needed), and preemption."""
    path = model_dirs["llama"]
    kwargs = dict(SETTINGS[setting])
    if "kv_blocks" in kwargs:  # eight: the longest request alone needs seven
        kwargs["kv_cache_memory"] = kv_bytes_for_blocks(path, 8)
        del kwargs["kv_blocks"]
    llm = LLM(str(path), **kwargs)
    head, *tails = random_prompts([48, 1, 30, 90], seed=6)
    prompts = [head + tails[0], head + tails[1], tails[2]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.get_stats().prefix_cache_hits == 0
    assert_prompt_logprobs_like_hf(path, prompts, outputs)
    llm.engine.core.kv_cache.check_integrity()
    if setting.startswith("preemption"):
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_llama3_rope_scaling_matches_transformers(model_dirs, tmp_path):
    import json
    import shutil

    path = tmp_path / "llama3-rope"
    shutil.copytree(model_dirs["llama"], path)
    config = json.loads((path / "config.json").read_text())
    # A short original context so the scaling changes the frequencies of a 16-dim head.
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_pretrained(path).rope_scaling["rope_type"] == "llama3"
    prompts = random_prompts([3, 150], seed=5)
    for prompt, tokens in zip(prompts, run_greedy(LLM(str(path)), prompts), strict=True):
        assert tokens == hf_greedy(path, tuple(prompt), MAX_TOKENS)


def test_a_bfloat16_checkpoint_served_in_float32_matches_transformers(tmp_path):
    """Its linear weights stay bfloat16 until each layer widens them as it lays them out."""
    path = make_model("tiny", tmp_path / "bf16", dtype="bfloat16")
    llm = LLM(str(path), dtype="float32")
    assert llm.engine.core.runner.model.lm_head.weight.dtype == torch.float32
    prompts = random_prompts([5, 33], seed=12)
    for prompt, tokens in zip(prompts, run_greedy(llm, prompts), strict=True):
        assert tokens == hf_greedy(path, tuple(prompt), MAX_TOKENS)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_tracks_float32(model_dirs, dtype):
    path = model_dirs["qwen3"]
    llm = LLM(str(path), dtype=dtype)
    assert llm.engine.core.runner.kv_cache.dtype == getattr(torch, dtype)
    prompts = random_prompts([4, 40], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=1)
    half = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    full = LLM(str(path)).generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)
    for h, f in zip(half, full, strict=True):
        h_lp = h.outputs[0].logprobs[0][h.outputs[0].token_ids[0]].logprob
        f_lp = f.outputs[0].logprobs[0][f.outputs[0].token_ids[0]].logprob
        assert abs(h_lp - f_lp) < 0.1


# bfloat16 keeps 8 bits of mantissa: two correct implementations that sum in different
# orders differ by about a hundredth of a nat in a token's logprob (0.016 at most measured
# on the tiny models), so 0.05 leaves a margin.
BF16_LOGPROB_TOLERANCE = 0.05


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_tracks_transformers_in_bfloat16(model_dirs, arch):
    """Prompt tokens (the prefill path) and generated tokens (the decode kernel): each one's
    logprob within the tolerance of transformers' own bfloat16 forward over the same ids."""
    path = model_dirs[arch]
    llm = LLM(str(path), dtype="bfloat16", max_num_batched_tokens=64)
    prompts = random_prompts([9, 100], seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for prompt, out in zip(prompts, outputs, strict=True):
        generated = out.outputs[0].token_ids
        ids = prompt + generated
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        ours = [entry[token].logprob for entry, token in
                zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
        ours += [entry[token].logprob for entry, token in
                 zip(out.outputs[0].logprobs, generated, strict=True)]
        theirs = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < \
            BF16_LOGPROB_TOLERANCE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_matches_transformers_on_cuda(model_dirs):
    path = model_dirs["llama"]
    llm = LLM(str(path), device="cuda", dtype="float32", max_num_batched_tokens=64)
    prompts = random_prompts(PROMPT_LENS, seed=1)
    for prompt, tokens in zip(prompts, run_greedy(llm, prompts), strict=True):
        assert tokens == hf_greedy(path, tuple(prompt), MAX_TOKENS)


def test_offline_requests_report_only_once_finished(model_dirs):
    """`LLM.generate`'s requests build no output before they end (vLLM's FINAL_ONLY); a
    request beside them still gets one every step, and both match transformers."""
    path = model_dirs["llama"]
    engine = LLM(str(path)).engine
    prompts = random_prompts(PROMPT_LENS, seed=4)[1:3]  # transformers' answers are cached
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for request_id, prompt in zip(("streamed", "offline"), prompts, strict=True):
        parent, max_tokens = engine.inputs.prepare_request({"prompt_token_ids": prompt}, params,
                                                           request_id)
        parent.final_only = request_id == "offline"
        engine.add_validated(parent, params, max_tokens)
    seen: dict[str, list] = {"streamed": [], "offline": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert [out.finished for out in seen["offline"]] == [True]
    assert len(seen["streamed"]) == MAX_TOKENS and seen["streamed"][-1].finished
    for request_id, prompt in zip(("streamed", "offline"), prompts, strict=True):
        assert seen[request_id][-1].outputs[0].token_ids == hf_greedy(path, tuple(prompt),
                                                                      MAX_TOKENS)
