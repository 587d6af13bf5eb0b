"""Sampling behaviour through the offline API on a tiny checkpoint."""

from __future__ import annotations

import re

import pytest

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputParams
from tests.conftest import random_prompts


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_num_batched_tokens=64)


def ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    target = random_prompts([20], seed=11)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24,
                            ignore_eos=True)
    alone = tokens(llm.generate(ids([target]), params, use_tqdm=False))[0]
    others = random_prompts([5, 90, 300, 41], seed=12)
    mixed_params = [SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True)] * 4
    batch = llm.generate(ids(others[:2] + [target] + others[2:]),
                         mixed_params[:2] + [params] + mixed_params[2:], use_tqdm=False)
    assert tokens(batch)[2] == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24,
                                ignore_eos=True)
    assert tokens(llm.generate(ids([target]), other_seed, use_tqdm=False))[0] != alone


def test_top_k_one_is_greedy(llm):
    prompt = random_prompts([15], seed=2)
    greedy = tokens(llm.generate(ids(prompt), SamplingParams(temperature=0, max_tokens=12,
                                                             ignore_eos=True), use_tqdm=False))
    top1 = tokens(llm.generate(ids(prompt), SamplingParams(temperature=1.5, top_k=1,
                                                           max_tokens=12, ignore_eos=True),
                               use_tqdm=False))
    assert greedy == top1


def test_max_tokens_and_n(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=7, ignore_eos=True)
    out = llm.generate(ids(random_prompts([10], seed=3)), params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 7 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_n_at_the_largest_seed_wraps_the_second_childs_seed(llm):
    prompt = ids(random_prompts([10], seed=3))
    out = llm.generate(prompt, SamplingParams(n=2, temperature=1.0, seed=2**63 - 1,
                                              max_tokens=7, ignore_eos=True), use_tqdm=False)
    second = llm.generate(prompt, SamplingParams(temperature=1.0, seed=-2**63, max_tokens=7,
                                                 ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[1].token_ids == tokens(second)[0]
    assert not llm.engine.has_unfinished_requests()


def test_stop_token_ids_and_min_tokens(llm):
    prompt = ids(random_prompts([12], seed=4))
    free = tokens(llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16,
                                                      ignore_eos=True), use_tqdm=False))[0]
    stop_at = free[3]
    first = free.index(stop_at)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                              stop_token_ids=[stop_at]), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.token_ids == free[:first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_at
    # The stop token's text is left out, as a stop string's is (vLLM's rule), unless asked.
    decode = llm.get_tokenizer().decode
    assert completion.text == decode(free[:first])
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                               stop_token_ids=[stop_at],
                                               include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == decode(free[:first + 1])
    delayed = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                  stop_token_ids=[stop_at],
                                                  min_tokens=first + 2), use_tqdm=False)
    delayed_ids = delayed[0].outputs[0].token_ids
    assert len(delayed_ids) >= first + 2
    assert stop_at not in delayed_ids[:first + 2]  # banned until min_tokens are out


def test_eos_text_stays_out_even_with_special_tokens_kept(llm):
    """skip_special_tokens=False keeps special tokens the model writes, but not the EOS that
    ended the output (here the grammar's end forces it)."""
    regex = StructuredOutputParams(regex="ab+c")
    out = llm.generate("x", SamplingParams(max_tokens=12, seed=1, skip_special_tokens=False,
                                           structured_output=regex), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] in llm.engine.config.model.eos_token_ids
    assert re.fullmatch("ab+c", completion.text)


def test_stop_string_is_cut_from_the_text(llm):
    prompt = ids(random_prompts([12], seed=6))
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 2]
    assert stop
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                              stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == free.text[:free.text.index(stop)]
    assert stop not in cut.text


def test_penalties_change_greedy_output_and_discourage_repeats(llm):
    prompt = ids(random_prompts([8], seed=8))
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = tokens(llm.generate(prompt, base, use_tqdm=False))[0]
    penalized = tokens(llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=2.0,
        presence_penalty=2.0, repetition_penalty=2.0), use_tqdm=False))[0]
    assert len(set(penalized)) > len(set(plain))


def test_text_and_chat_prompts(llm):
    out = llm.generate(["def main():", "import os"], SamplingParams(temperature=0,
                                                                    max_tokens=5),
                       use_tqdm=False)
    tok = llm.get_tokenizer()
    assert out[0].prompt == "def main():"
    assert out[0].prompt_token_ids == tok.encode("def main():")
    chat = llm.chat([{"role": "user", "content": "hi"}],
                    SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert chat[0].prompt_token_ids == tok.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_detokenized_text_equals_full_decode(llm):
    out = llm.generate(ids(random_prompts([30, 3], seed=9)),
                       SamplingParams(temperature=1.0, seed=0, max_tokens=40, ignore_eos=True),
                       use_tqdm=False)
    tok = llm.get_tokenizer()
    for o in out:
        c = o.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_truncate_prompt_tokens_keeps_the_prompts_tail(llm):
    """vLLM's left truncation: the last k tokens, as if only they had been given; -1 keeps
    what the context holds beside max_tokens."""
    prompt = random_prompts([40], seed=21)[0]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tail = llm.generate(ids([prompt[-9:]]), greedy, use_tqdm=False)[0]
    cut = llm.generate(ids([prompt]), SamplingParams(temperature=0, max_tokens=6,
                                                     ignore_eos=True, truncate_prompt_tokens=9),
                       use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-9:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    limit = llm.engine.max_model_len
    too_long = random_prompts([limit + 50], seed=22)[0]
    with pytest.raises(ValueError, match="the context limit"):
        llm.generate(ids([too_long]), greedy, use_tqdm=False)
    fitted = llm.generate(ids([too_long]), SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=-1),
        use_tqdm=False)[0]
    assert fitted.prompt_token_ids == too_long[-(limit - 6):]
    assert len(fitted.outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 .* or >= 1, got 0"):
        SamplingParams(truncate_prompt_tokens=0)


def test_bad_words_never_appear_in_the_output(llm):
    """vLLM's bad_words: tokenized as written and after a space; no output holds either."""
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = ids(random_prompts([12], seed=31))
    free = tokens(llm.generate(prompt, greedy, use_tqdm=False))[0]
    word = next(text for token in free[1:]
                if (text := tokenizer.decode([token])).strip()
                and tokenizer.encode(text, add_special_tokens=False) == [token])
    banned = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=[word])
    out = tokens(llm.generate(prompt, banned, use_tqdm=False))[0]
    sequences = banned.bad_words_token_ids  # filled in with the model's tokenizer
    assert [tokenizer.encode(word, add_special_tokens=False)] == sequences[:1]
    assert out != free and len(out) == 16
    for seq in sequences:
        assert all(out[i:i + len(seq)] != seq for i in range(len(out)))


def test_cumulative_logprob_sums_the_sampled_tokens_logprobs(llm):
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=6, logprobs=2, n=2,
                            ignore_eos=True)
    for c in llm.generate(ids(random_prompts([9], seed=5)), params, use_tqdm=False)[0].outputs:
        each = [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs, strict=True)]
        assert c.cumulative_logprob == pytest.approx(sum(each)) and c.cumulative_logprob < 0
    plain = llm.generate(ids([[1, 2]]), SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.outputs[0].cumulative_logprob is None  # as vLLM's, without logprobs
