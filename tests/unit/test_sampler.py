import pytest
import torch

from kvserve.cpp_extension import cpu_kernels
from kvserve.sampling_params import SamplingParams
from kvserve.worker.sampler import (
    Sampler,
    banned_next_tokens,
    greedy_tokens,
    logsumexp_and_greater,
    token_logprobs,
)
from kvserve.worker.structured_output import GrammarMatchers

LOGITS = torch.tensor([2.0, 0.5, float("-inf"), 1.0, -1.0, 3.0, 0.0, float("-inf")])


def sample_many(params: SamplingParams, rows: int = 20000) -> torch.Tensor:
    sampler = Sampler(seed=0, device="cpu", grammars=GrammarMatchers("", 0))
    states = [sampler.new_state(params, [1], ()) for _ in range(rows)]
    out = sampler(LOGITS.repeat(rows, 1), states)
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(LOGITS)) / rows


def test_random_choice_follows_the_tempered_distribution():
    for temperature in (1.0, 0.5):
        freq = sample_many(SamplingParams(temperature=temperature))
        expected = torch.softmax(LOGITS / temperature, dim=-1)
        assert torch.allclose(freq, expected, atol=0.015), (temperature, freq, expected)
        assert freq[2] == 0 and freq[7] == 0  # impossible tokens are never drawn


def test_filtered_tokens_are_never_drawn():
    freq = sample_many(SamplingParams(temperature=1.0, top_k=2))
    assert freq_support(freq) == {0, 5}
    expected = torch.softmax(torch.tensor([2.0, 3.0]), dim=-1)
    assert torch.allclose(freq[[0, 5]], expected, atol=0.015)


def test_a_single_possible_token_is_always_drawn():
    logits = torch.full((64, 8), float("-inf"))
    logits[:, 7] = 0.0  # the last entry: the search must not run past it or stop before it
    sampler = Sampler(seed=1, device="cpu", grammars=GrammarMatchers("", 0))
    states = [sampler.new_state(SamplingParams(temperature=1.0), [1], ()) for _ in range(64)]
    assert sampler(logits, states).token_ids == [7] * 64


def test_greedy_tokens_are_torch_argmax_with_ties_infinities_and_nans():
    torch.manual_seed(0)
    logits = torch.randn(9, 1003)  # a vocabulary that is no multiple of the vector width
    logits[1, 17] = logits[1, 600] = logits[1].max() + 1  # a tie: the first one wins
    logits[2] = float("-inf")
    logits[3, 40] = logits[3, 900] = float("nan")  # NaN counts as the maximum
    logits[4, 1002] = 1e30  # the last, partial vector
    logits[5] = 0.0
    logits[6, 0] = logits[6].max() + 1
    assert greedy_tokens(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert greedy_tokens(logits[:, :1].contiguous()).tolist() == [0] * 9


def test_the_extremes_of_each_setting_draw_tokens_of_the_vocabulary():
    """At the limits SamplingParams allows, float32 sampling math stays finite: a masked
    logit stays masked and the draw has a distribution. Below 1e-5 the temperature is greedy;
    a top_p that rounds to 0 in float32 keeps the top token."""
    hot = sample_many(SamplingParams(temperature=1e6), rows=4000)
    assert freq_support(hot) == {0, 1, 3, 4, 5, 6}
    assert sample_many(SamplingParams(temperature=1e-108), rows=50)[5] == 1.0
    assert sample_many(SamplingParams(temperature=1.0, top_p=1e-300), rows=50)[5] == 1.0
    sampler = Sampler(seed=0, device="cpu", grammars=GrammarMatchers("", 0))
    for penalty, winner in ((1e-6, 1), (1e6, 5)):  # the seen token 1: 0.5 / 1e-6, 0.5 * 1e6
        params = SamplingParams(temperature=1e-5, repetition_penalty=penalty)
        states = [sampler.new_state(params, [1, 2, 4], ()) for _ in range(50)]
        assert sampler(LOGITS.repeat(50, 1), states).token_ids == [winner] * 50


def test_logit_bias_shifts_the_logits_the_sampler_draws_from():
    """+3 on token 1 (0.5 -> 3.5) makes it the argmax; -100 on token 5 all but bans it; the
    reported logprobs stay the raw logits' (as in vLLM)."""
    params = SamplingParams(temperature=0.0, logit_bias={1: 3.0, 5: -100.0}, logprobs=0)
    sampler = Sampler(seed=0, device="cpu", grammars=GrammarMatchers("", 0))
    out = sampler(LOGITS.repeat(3, 1), [sampler.new_state(params, [1], ()) for _ in range(3)])
    assert out.token_ids == [1] * 3
    assert abs(out.logprobs[0][2] - torch.log_softmax(LOGITS, dim=-1)[1].item()) < 1e-6
    freq = sample_many(SamplingParams(temperature=1.0, logit_bias={5: -100.0, 6: 2.0}))
    biased = LOGITS.clone()
    biased[5] -= 100.0
    biased[6] += 2.0
    assert torch.allclose(freq, torch.softmax(biased, dim=-1), atol=0.015)
    assert not SamplingParams(logit_bias={1: 1.0}).allows_drafts


def test_allowed_token_ids_are_the_only_ones_drawn():
    greedy = sample_many(SamplingParams(temperature=0.0, allowed_token_ids=[1, 3, 4]), rows=5)
    assert greedy[3] == 1.0  # the best allowed one, not token 5
    freq = sample_many(SamplingParams(temperature=1.0, allowed_token_ids=[1, 3, 4]))
    assert torch.allclose(freq[[1, 3, 4]], torch.softmax(LOGITS[[1, 3, 4]], dim=-1), atol=0.015)
    assert freq_support(freq) == {1, 3, 4}
    assert not SamplingParams(allowed_token_ids=[1]).allows_drafts


def test_a_bad_words_last_token_is_banned_where_the_output_ends_with_the_rest():
    sequences = [[5], [3, 0], [1, 6, 3]]
    assert banned_next_tokens(sequences, []) == [5]  # [3, 0] needs a 3 before, [1, 6, 3] 1, 6
    assert banned_next_tokens(sequences, [4, 3]) == [5, 0]
    assert banned_next_tokens(sequences, [1, 6]) == [5, 3]
    assert banned_next_tokens(sequences, [6]) == [5]
    sampler = Sampler(seed=0, device="cpu", grammars=GrammarMatchers("", 0))
    params = SamplingParams(temperature=0.0, bad_words_token_ids=sequences)
    state = sampler.new_state(params, [1], (), output_token_ids=(4, 3))
    # Token 5 (the best) and 0 (after a 3) are banned: the next best is token 3.
    assert sampler(LOGITS.unsqueeze(0).clone(), [state]).token_ids == [3]
    assert not params.allows_drafts and not Sampler.samples_on_device(state)
    with pytest.raises(ValueError, match="bad_words cannot be set with allowed_token_ids"):
        SamplingParams(bad_words=["x"], allowed_token_ids=[1])
    with pytest.raises(ValueError, match="bad_words_token_ids must be a list of non-empty"):
        SamplingParams(bad_words_token_ids=[[]])


def freq_support(freq: torch.Tensor) -> set[int]:
    return set(freq.nonzero().flatten().tolist())


def test_logsumexp_and_greater_is_torchs_with_nans_and_infinities():
    kernels = cpu_kernels()
    if kernels is None or not kernels.logsumexp_and_greater_supported():
        pytest.skip("the C++ pass is built for AVX-512 CPUs; elsewhere torch's ops run")
    logits = torch.randn(8, 1003, generator=torch.Generator().manual_seed(3)) * 5
    logits[1, 5] = float("nan")
    logits[2] = float("-inf")
    logits[3, 7] = float("inf")
    logits[4, :500] = float("-inf")
    logits[7, 1002] = 1e4  # the last, partial vector
    thresholds = logits[:, 3].clone()
    thresholds[5], thresholds[6] = float("-inf"), float("inf")
    lse, greater = logsumexp_and_greater(logits, thresholds)
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=1), rtol=1e-6, atol=1e-6,
                               equal_nan=True)
    assert greater.tolist() == (logits > thresholds.unsqueeze(1)).sum(dim=1).tolist()


@pytest.mark.parametrize("k", [0, 1, 3])
def test_token_logprobs_are_the_log_softmax_at_the_token_and_the_top_k(k):
    logits = torch.randn(6, 4099, generator=torch.Generator().manual_seed(k)) * 4
    tokens = torch.tensor([0, 17, 4098, 5, 5, 2000])
    logits[4, 5] = logits[4].max() + 1  # a token that is the argmax: rank 1
    reference = torch.log_softmax(logits, dim=-1)
    for row, (ids, values, logprob, rank) in enumerate(token_logprobs(logits, tokens, [k] * 6)):
        token = int(tokens[row])
        assert abs(logprob - reference[row, token].item()) < 1e-5
        assert rank == int((reference[row] > reference[row, token]).sum()) + 1
        top = torch.topk(reference[row], k)
        assert ids == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(values), top.values, rtol=0, atol=1e-5)
