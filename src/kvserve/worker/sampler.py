"""Turns the logits of each sampling request into its next token.

Order of operations (as in vLLM): raw logprobs are taken first; then the grammar's mask of a
structured output, allowed_token_ids, min_tokens masking, logit_bias, repetition / presence /
frequency penalties,
temperature, top-k, top-p and min-p. Random choice inverts the cumulative distribution at
one uniform draw per row, taken from the request's own generator when it has a seed, so its
text does not depend on what else is in the batch. One draw per row instead of one per
vocabulary entry (the exponential race, or `torch.multinomial`) cut the sampler's time for
32 rows at temperature 1 from 49 to 4 ms on a 2-core CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.core.scheduler.output import TokenLogprobs
from kvserve.cpp_extension import cpu_kernels
from kvserve.request import num_kept_drafts
from kvserve.sampling_params import SamplingParams
from kvserve.worker.structured_output import GrammarMatchers


@dataclass
class SamplingState:
    """What the sampler keeps per request between steps."""

    params: SamplingParams
    prompt_token_ids: list[int]
    stop_ids: list[int]  # tokens banned while fewer than min_tokens are generated
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    matcher: Any = None  # llguidance's, for a structured output
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias: (token ids, values)
    allowed: torch.Tensor | None = None  # allowed_token_ids, the only tokens it may sample
    bad_words: list[list[int]] = field(default_factory=list)  # token sequences never output


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int, device: str, grammars: GrammarMatchers) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.grammars = grammars

    def new_state(self, params: SamplingParams, prompt_token_ids: list[int],
                  eos_token_ids: tuple[int, ...], output_token_ids: tuple[int, ...] = (),
                  generator_state: bytes | None = None) -> SamplingState:
        """A request's state; one migrated from another engine resumes its outputs so far
        and its seeded generator's `generator_state`."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
            if generator_state is not None:
                generator.set_state(torch.frombuffer(bytearray(generator_state),
                                                     dtype=torch.uint8))
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += list(eos_token_ids)
        matcher = None
        if params.structured_output is not None:
            matcher = self.grammars.new(params.structured_output, eos_token_ids,
                                        output_token_ids)
        bias = None
        if params.logit_bias:
            bias = (torch.tensor(list(params.logit_bias), device=self.device),
                    torch.tensor(list(params.logit_bias.values()), device=self.device))
        allowed = None
        if params.allowed_token_ids is not None:
            allowed = torch.tensor(params.allowed_token_ids, device=self.device)
        return SamplingState(params, prompt_token_ids, stop_ids, list(output_token_ids),
                             generator, matcher, bias, allowed,
                             list(params.bad_words_token_ids or []))

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        scored = [row for row, st in enumerate(states) if st.params.logprobs is not None]
        raw = logits[scored] if scored else None  # a copy: what follows changes logits in place
        constrained = [row for row, st in enumerate(states) if st.matcher is not None]
        if constrained:
            self.grammars.mask_disallowed(logits, constrained,
                                          [states[r].matcher for r in constrained])
        sampled = self.token_ids(logits, states).tolist()
        if constrained:
            self.grammars.advance([states[r].matcher for r in constrained],
                                  [sampled[r] for r in constrained])
        return SamplerOutput(sampled, _gather_logprobs(raw, scored, sampled, states))

    def token_ids(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Each row's next token, left on the device: allowed_token_ids, min_tokens, bad
        words, logit_bias, penalties, then greedy or random choice (no grammar, no logprobs;
        `__call__` adds those)."""
        for row, st in enumerate(states):
            if st.allowed is not None:
                kept = logits[row, st.allowed]
                logits[row] = float("-inf")
                logits[row, st.allowed] = kept
            if len(st.output_token_ids) < st.params.min_tokens and st.stop_ids:
                logits[row, st.stop_ids] = float("-inf")
            if st.bad_words:
                banned = banned_next_tokens(st.bad_words, st.output_token_ids)
                if banned:
                    logits[row, banned] = float("-inf")
            if st.bias is not None:
                ids, values = st.bias
                logits[row, ids] += values.to(logits.dtype)
            _apply_penalties(logits[row], st)
        token_ids = greedy_tokens(logits)
        random_rows = [row for row, st in enumerate(states) if not st.params.is_greedy]
        if random_rows:
            token_ids[random_rows] = self._sample(logits[random_rows],
                                                  [states[r] for r in random_rows])
        return token_ids

    @staticmethod
    def samples_on_device(st: SamplingState) -> bool:
        """Whether the request's next token needs nothing from the host that its last
        sampled tokens change (grammar, penalties, min_tokens, bad words, logprobs): a step
        may then sample it before the previous step's token reached the host."""
        p = st.params
        return (st.matcher is None and p.logprobs is None and not st.bad_words
                and len(st.output_token_ids) >= p.min_tokens  # the host's count lags
                and p.repetition_penalty == 1.0 and not p.presence_penalty
                and not p.frequency_penalty)

    def verify(self, logits: torch.Tensor, states: list[SamplingState],
               drafts: list[list[int]], draft_probs: list[torch.Tensor | None] | None = None
               ) -> list[list[int]]:
        """Speculative decoding's check: request i has `len(drafts[i]) + 1` consecutive rows
        of logits, the first scoring its first draft. Returns each request's new tokens: the
        drafts up to the first one the model would not have produced, then one token of the
        model's. Greedy: a draft stays while it is the argmax. Random: with p the model's
        distribution (after temperature, top-k, top-p and min-p) and q the one the draft was
        drawn from (`draft_probs[i]`, a row per draft; None: the draft was a function of the
        context, q one-hot), draft d stays with probability min(1, p(d) / q(d)), else the
        token comes from max(0, p - q), renormalized. That is exact rejection sampling: the
        output follows p as without drafts. Requests that draft have no penalties, grammar,
        logprobs or pending min_tokens."""
        row_states = [st for st, d in zip(states, drafts, strict=True) for _ in range(len(d) + 1)]
        first_rows = [0]
        for d in drafts:
            first_rows.append(first_rows[-1] + len(d) + 1)
        argmax = greedy_tokens(logits).tolist()
        random = [i for i, st in enumerate(states) if not st.params.is_greedy]
        accepted = [num_kept_drafts(d, argmax[first:first + len(d)])
                    for d, first in zip(drafts, first_rows, strict=False)]
        chosen = [argmax[first + a] for first, a in zip(first_rows, accepted, strict=False)]
        if random:
            draft_probs = draft_probs or [None] * len(states)
            rows = [r for i in random for r in range(first_rows[i], first_rows[i + 1])]
            scaled = self._scale_and_filter(logits[rows], [row_states[r] for r in rows])
            probs = torch.softmax(scaled, dim=-1)
            local = dict(zip(rows, range(len(rows)), strict=True))
            draft_rows = [local[first_rows[i] + j] for i in random for j in range(len(drafts[i]))]
            draft_ids = [t for i in random for t in drafts[i]]
            p_draft = probs[draft_rows, draft_ids].tolist()
            final_rows, offset = [], 0
            for i in random:
                st, d, q = states[i], drafts[i], draft_probs[i]
                q_draft = [1.0] * len(d) if q is None else q[list(range(len(d))), d].tolist()
                uniform = torch.rand(len(d), generator=st.generator or self.generator,
                                     device=self.device).tolist()
                accepted[i] = next((j for j, (u, p, qd) in enumerate(zip(
                    uniform, p_draft[offset:offset + len(d)], q_draft, strict=True))
                    if u * qd >= p), len(d))
                offset += len(d)
                row = local[first_rows[i] + accepted[i]]
                if accepted[i] < len(d):  # rejected: the residual max(0, p - q)
                    if q is None:
                        scaled[row, d[accepted[i]]] = float("-inf")
                    else:
                        residual = (probs[row] - q[accepted[i]]).clamp_(min=0)
                        if residual.sum() > 0:  # else p == q up to rounding: p itself
                            scaled[row] = residual.log_()
                final_rows.append(row)
            final = self._draw(scaled[final_rows], [states[i] for i in random]).tolist()
            for i, token_id in zip(random, final, strict=True):
                chosen[i] = token_id
        return [d[:a] + [t] for d, a, t in zip(drafts, accepted, chosen, strict=True)]

    def draw_drafts(self, logits: torch.Tensor, states: list[SamplingState]
                    ) -> tuple[list[int], torch.Tensor]:
        """A draft model's tokens for requests that sample: one per row of its logits
        (overwritten), drawn from its distribution after each request's temperature, top-k,
        top-p and min-p, and that distribution, which `verify` weighs the draft against."""
        scaled = self._scale_and_filter(logits, states)
        probs = torch.softmax(scaled, dim=-1)
        return self._draw(scaled, states).tolist(), probs

    def _sample(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """`logits` is the caller's copy and is overwritten: in-place ops spare the step
        several fresh vocabulary-sized buffers."""
        return self._draw(self._scale_and_filter(logits, states), states)

    @staticmethod
    def _scale_and_filter(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p, in place on the caller's copy."""
        temps = torch.tensor([st.params.temperature for st in states], device=logits.device)
        logits.div_(temps.unsqueeze(1))
        for row, st in enumerate(states):
            _filter(logits[row], st.params)
        return logits

    def _draw(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """One token per row of scaled and filtered logits (overwritten), drawn from their
        softmax."""
        # An unnormalized CDF: the uniform draw is scaled by its total instead.
        cdf = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_().cumsum_(dim=-1)
        uniform = torch.empty(len(states), 1, device=logits.device)
        unseeded = [row for row, st in enumerate(states) if st.generator is None]
        if unseeded:
            uniform[unseeded] = torch.rand(len(unseeded), 1, device=logits.device,
                                           generator=self.generator)
        for row, st in enumerate(states):
            if st.generator is not None:
                uniform[row] = torch.rand(1, device=logits.device, generator=st.generator)
        # Strictly below the total, so the search lands on a token of nonzero probability.
        total = cdf[:, -1:]
        target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1)


def banned_next_tokens(sequences: list[list[int]], output: list[int]) -> list[int]:
    """The last token of each sequence whose other tokens the output ends with: what would
    complete a bad word."""
    return [seq[-1] for seq in sequences
            if len(seq) - 1 <= len(output) and output[len(output) - len(seq) + 1:] == seq[:-1]]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax. torch's CPU argmax is a slow reduction (2.1 ms for 64 rows of a
    49k vocabulary on a 2-core Xeon, where their max takes 0.24), so CPU float32 rows go
    through the C++ kernel, which returns the same index."""
    kernels = _row_kernels(logits)
    if kernels is not None:
        return kernels.greedy_tokens(logits)
    return logits.argmax(dim=-1)


def _row_kernels(logits: torch.Tensor) -> Any:
    """The C++ kernels, for contiguous float32 [rows, vocab] logits on the CPU; else None."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or not logits.is_contiguous()):
        return None
    return cpu_kernels()


def _apply_penalties(logits: torch.Tensor, st: SamplingState) -> None:
    """In place on one row of logits."""
    p = st.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(st.prompt_token_ids) | set(st.output_token_ids)),
                            dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                   values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and st.output_token_ids:
        counts = torch.bincount(torch.tensor(st.output_token_ids, device=logits.device),
                                minlength=logits.shape[0])[:logits.shape[0]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _filter(logits: torch.Tensor, p: SamplingParams) -> None:
    """Top-k, top-p and min-p, in place on one row of temperature-scaled logits."""
    if 0 < p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits.masked_fill_(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the tokens ranked above it already reach top_p. The first always
        # stays: a top_p below float32's smallest number compares as 0.
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= p.top_p
        drop[0] = False
        logits[order[drop]] = float("-inf")
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits.masked_fill_(probs < p.min_p * probs.max(), float("-inf"))


def _gather_logprobs(raw: torch.Tensor | None, rows: list[int], sampled: list[int],
                     states: list[SamplingState]) -> list[TokenLogprobs | None]:
    """The logprobs of the rows that asked for them, from those rows' raw logits."""
    result: list[TokenLogprobs | None] = [None] * len(states)
    if raw is None:
        return result
    entries = token_logprobs(raw, torch.tensor([sampled[r] for r in rows], device=raw.device),
                             [states[r].params.logprobs or 0 for r in rows])
    for row, entry in zip(rows, entries, strict=True):
        result[row] = entry
    return result


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
                   ) -> list[TokenLogprobs]:
    """For each row of raw logits: the log-softmax value and rank of `token_ids[row]` and the
    `num_top[row]` best tokens', brought to the host in one go per field. Log-softmax values
    are formed at those entries only (logit - logsumexp), never over the whole row."""
    chosen = logits.gather(1, token_ids.unsqueeze(1))
    lse, greater = logsumexp_and_greater(logits, chosen.squeeze(1))
    lse = lse.unsqueeze(1)
    ranks = (greater + 1).tolist()
    k = max(num_top, default=0)
    if k:
        top_logits, top_indices = (logits.max(dim=1, keepdim=True) if k == 1
                                   else torch.topk(logits, k))  # max: a third of topk's time
        top_ids, top_values = top_indices.tolist(), (top_logits - lse).tolist()
    else:
        top_ids = top_values = [[]] * len(num_top)
    return [(ids[:n], values[:n], lp, rank) for ids, values, lp, rank, n in
            zip(top_ids, top_values, (chosen - lse).squeeze(1).tolist(), ranks, num_top,
                strict=True)]


def logsumexp_and_greater(logits: torch.Tensor, thresholds: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logsumexp, and how many of its logits exceed `thresholds[row]`. On CPUs with
    AVX-512 one C++ pass per row does both: torch's logsumexp and comparison took 41 and
    64 ms for [512, 49152] float32 rows on a 2-core AVX-512 EPYC."""
    kernels = _row_kernels(logits)
    if kernels is not None and kernels.logsumexp_and_greater_supported():
        return kernels.logsumexp_and_greater(logits, thresholds.contiguous())
    return (torch.logsumexp(logits, dim=1),
            (logits > thresholds.unsqueeze(1)).sum(dim=1))
