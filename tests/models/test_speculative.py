"""Speculative decoding changes how fast tokens come, never which: greedy outputs equal
transformers' and the engine's own without drafts, through every decode path and schedule."""

from __future__ import annotations

import json
import shutil

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.metrics import EngineMetrics
from kvserve.worker.draft_model import DraftModel
from tests.conftest import random_prompts
from tests.models.test_hf_equivalence import (
    MAX_TOKENS,
    PROMPT_LENS,
    assert_no_blocks_held,
    hf_greedy,
    kv_bytes_for_blocks,
    run_greedy,
)

SETTINGS = {
    "default": {},
    "eager": {"enforce_eager": True},  # the fused attention kernel, not the decode stack
    "small-chunks": {"max_num_batched_tokens": 16},
    "preemption": {"max_num_batched_tokens": 64, "kv_blocks": 24,
                   "preemption_mode": "recompute"},
    "preemption-swap": {"max_num_batched_tokens": 64, "kv_blocks": 24, "preemption_mode": "swap"},
    "one-draft": {"num_speculative_tokens": 1},
}


def looping_prompts(seed: int) -> list[list[int]]:
    """Random prompts, and ones that repeat a phrase: prompt lookup finds drafts in both
    (a tiny random model's greedy output soon repeats itself)."""
    phrase = random_prompts([9], seed=seed)[0]
    return random_prompts(PROMPT_LENS, seed=seed) + [phrase * 5, phrase * 2 + phrase[:4]]


CASES = ([("llama", setting) for setting in SETTINGS]
         + [(arch, setting) for arch in ("mistral", "qwen3") for setting in ("default", "eager")])


@pytest.mark.parametrize(("arch", "setting"), CASES)
def test_greedy_with_drafts_matches_transformers(model_dirs, arch, setting):
    path = model_dirs[arch]
    kwargs = dict(SETTINGS[setting])
    if "kv_blocks" in kwargs:
        kwargs["kv_cache_memory"] = kv_bytes_for_blocks(path, kwargs.pop("kv_blocks"))
    llm = LLM(str(path), speculative_model="ngram", **kwargs)
    prompts = looping_prompts(seed=len(setting))
    got = run_greedy(llm, prompts, max_tokens=2 * MAX_TOKENS)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(path, tuple(prompt), 2 * MAX_TOKENS), f"prompt of {len(prompt)}"
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_accepted_tokens > 0, "no draft was verified and kept"
    if setting.startswith("preemption"):
        assert scheduler.num_preemptions > 0


def test_stops_limits_and_seeds_are_unchanged_by_drafts(llama_dir):
    """max_tokens, stop tokens, stop strings, n and seeded sampling give what they give
    without drafts, though a step may bring several tokens."""
    plain = LLM(str(llama_dir))
    speculative = LLM(str(llama_dir), speculative_model="ngram")
    prompts = [{"prompt_token_ids": p} for p in looping_prompts(seed=3)]
    greedy = [o.outputs[0].token_ids for o in plain.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        use_tqdm=False)]
    stop_token = greedy[-1][25]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[plain.get_tokenizer().decode(
            greedy[-1][20:22])]),
        SamplingParams(temperature=0.8, max_tokens=30, seed=5, n=2),
    ]
    for params in cases:
        want = plain.generate(prompts, params, use_tqdm=False)
        got = speculative.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got, strict=True):
            for wc, gc in zip(w.outputs, g.outputs, strict=True):
                if params.temperature == 0.0:
                    assert (gc.token_ids, gc.text, gc.finish_reason) == \
                        (wc.token_ids, wc.text, wc.finish_reason)
                else:
                    assert len(gc.token_ids) == len(wc.token_ids)
    again = speculative.generate(prompts, cases[-1], use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == \
        [[c.token_ids for c in o.outputs] for o in got]
    stats = speculative.engine.stats()
    assert stats.num_accepted_tokens > 0
    metrics = EngineMetrics("m")
    metrics.on_step(speculative.engine, [])
    for name, value in (("draft", stats.num_draft_tokens),
                        ("accepted", stats.num_accepted_tokens)):
        assert metrics.registry.get_sample_value(
            f"kvserve_spec_decode_{name}_tokens_total", {"model_name": "m"}) == value
    assert_no_blocks_held(speculative)


def test_speculative_options_are_checked(llama_dir):
    with pytest.raises(ValueError, match="speculative_model"):
        LLM(str(llama_dir), speculative_model="eagle")  # neither ngram nor a folder
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(llama_dir), speculative_model="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        LLM(str(llama_dir), speculative_model="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens, prompt_lookup_max: "
                                         "speculative decoding is off"):
        LLM(str(llama_dir), num_speculative_tokens=3, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="streaming_window"):
        LLM(str(llama_dir), speculative_model="ngram", streaming_window=4,
            enable_prefix_caching=False)


@pytest.mark.parametrize("setting",
                         ["default", "eager", "small-chunks", "preemption", "preemption-swap"])
def test_a_model_drafting_for_itself_is_always_right(model_dirs, always_draft, setting):
    """The draft's KV stays in step with the target's through chunks, preemption (by
    recompute and by swap, after which the draft recomputes its own) and prefix hits (the
    batch runs twice): drafting with the target's own weights, every draft is kept, and the
    output is transformers'."""
    path = model_dirs["llama"]
    kwargs = dict(SETTINGS[setting])
    if "kv_blocks" in kwargs:  # the draft's KV as large as the target's: twice the bytes
        kwargs["kv_cache_memory"] = 2 * kv_bytes_for_blocks(path, kwargs.pop("kv_blocks") - 4)
    llm = LLM(str(path), speculative_model=str(path), **kwargs)
    prompts = random_prompts(PROMPT_LENS, seed=8)
    for _ in range(2):
        got = run_greedy(llm, prompts)
        assert got == [hf_greedy(path, tuple(p), MAX_TOKENS) for p in prompts]
    stats = llm.get_stats()
    assert stats.num_draft_tokens > len(prompts) * MAX_TOKENS
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.prefix_cache_hits > 0
    if setting.startswith("preemption"):
        assert stats.num_preemptions > 0
        assert stats.num_swapped_preemptions == (stats.num_preemptions
                                                 if setting == "preemption-swap" else 0)


def test_a_model_drafting_for_itself_keeps_its_sampled_drafts(model_dirs, always_draft):
    """At temperature 1 the draft draws from its own distribution, and the verifier weighs
    each draft by both: drafting with the target's weights the two agree, so the drafts stay
    (weighed as fixed tokens, they would stay at the rate p(draft), a few percent here)."""
    path = model_dirs["llama"]
    llm = LLM(str(path), speculative_model=str(path))
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=4)
    prompts = random_prompts(PROMPT_LENS, seed=8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
    stats = llm.get_stats()
    assert stats.num_draft_tokens > len(prompts) * MAX_TOKENS // 2
    assert stats.num_accepted_tokens >= 0.98 * stats.num_draft_tokens
    finished = {o.request_id for o in outputs}  # the runner hears of them in the next step
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert not finished & set(llm.engine.core.runner.draft_probs)
    assert_no_blocks_held(llm)


def test_another_model_drafts_without_changing_the_output(model_dirs, always_draft):
    path = model_dirs["llama"]
    llm = LLM(str(path), speculative_model=str(model_dirs["qwen3"]))
    prompts = looping_prompts(seed=9)
    assert run_greedy(llm, prompts) == [hf_greedy(path, tuple(p), MAX_TOKENS) for p in prompts]
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
    assert llm.get_stats().num_draft_tokens > 0


def test_a_drafts_cost_is_timed_on_its_decode_steps(model_dirs, always_draft, monkeypatch):
    """What a further draft costs is measured on the draft model's decode steps alone: the
    forward that catches up on a request's tokens (its whole prompt, at its first draft) is
    not a draft's cost."""
    proposals = []
    propose = DraftModel.propose

    def recorded(self, *args):
        proposals.append(propose(self, *args))
        return proposals[-1]

    monkeypatch.setattr(DraftModel, "propose", recorded)
    llm = LLM(str(model_dirs["llama"]), speculative_model=str(model_dirs["qwen3"]))
    run_greedy(llm, random_prompts(PROMPT_LENS, seed=10))
    assert any(p.num_decode_steps for p in proposals)
    for p in proposals:
        assert p.num_decode_steps == max(map(len, p.drafts.values()), default=1) - 1


def test_a_draft_model_must_fit_the_target(model_dirs, tmp_path):
    path = model_dirs["llama"]
    other = tmp_path / "draft"
    shutil.copytree(model_dirs["qwen3"], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 2999}))
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(str(path), speculative_model=str(other))
    with pytest.raises(ValueError, match="'ngram', a draft model's checkpoint folder"):
        LLM(str(path), speculative_model=str(tmp_path / "missing"))
