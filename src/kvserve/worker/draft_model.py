"""A small model with the same tokenizer that drafts tokens for a larger one (speculative
decoding with a draft model).

It keeps a KV pool of its own with the target's block ids, so one block table serves both,
and runs only when it drafts: first over the request's tokens its cache lacks (the prompt
at the first draft, the last token or two after a step, more after steps it sat out), then
k - 1 greedy decode steps, writing its KV into slots the scheduler allocated ahead. Drafts
the target kept leave valid KV behind them. Its drafts are a function of the context, which
is what the sampler's rejection sampling needs to keep the target's distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvserve.attention.selector import get_attention_backend
from kvserve.config import EngineConfig, ModelConfig
from kvserve.core.scheduler.output import ScheduledRequest
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_model
from kvserve.request import num_kept_drafts
from kvserve.worker.cpu_decode import CpuDecodeStack
from kvserve.worker.forward_context import forward_context
from kvserve.worker.input_batch import InputBuffers, ModelInputs
from kvserve.worker.kv_pool import allocate_kv_pool
from kvserve.worker.sampler import Sampler, SamplingState, greedy_tokens


@dataclass(frozen=True)
class Proposal:
    """Request id -> its drafts, the distribution each sampled draft was drawn from (requests
    that sample; a row per draft), and the seconds and number of the decode steps that made
    the drafts after each request's first: what a further draft costs. The catch-up forward
    before them is left out of that: at a request's first draft it runs the whole prompt."""

    drafts: dict[str, list[int]]
    probs: dict[str, torch.Tensor]
    decode_seconds: float
    num_decode_steps: int


def draft_model_config(config: EngineConfig) -> ModelConfig:
    assert config.speculative is not None and config.speculative.draft is not None
    return config.speculative.draft.shard(config.tensor_parallel_size)


def load_draft_model(config: EngineConfig) -> LlamaForCausalLM:
    """The draft model's weights, loaded before the pools are sized, as the target's are."""
    cfg = draft_model_config(config)
    backend = get_attention_backend(config.device, cfg.head_dim, cfg.attn_logit_softcapping)
    return load_model(cfg, backend, config.device,
                      config.scheduler.max_model_len)


class DraftModel:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, num_blocks: int,
                 sampler: Sampler) -> None:
        """`model` from `load_draft_model`; its pool holds as many blocks as the target's."""
        cfg = draft_model_config(config)
        self.model = model
        block_size = config.cache.block_size
        self.kv_cache = allocate_kv_pool(self.model, cfg, num_blocks, block_size, config.device)
        sched = config.scheduler
        self.max_model_len = sched.max_model_len
        max_blocks = -(-(sched.max_model_len + sched.draft_lookahead) // block_size)
        self.inputs = InputBuffers(max(sched.max_num_batched_tokens, sched.max_num_seqs),
                                   sched.max_num_seqs, max_blocks, block_size,
                                   cfg.sliding_window, config.device)
        # Request id -> (its token count when it last drafted, those drafts).
        self._cached: dict[str, tuple[int, list[int]]] = {}
        self.stack = CpuDecodeStack.build(self.model, config.enforce_eager)
        self.sampler = sampler  # the target's: a seeded request draws from its own generator

    def _hidden(self, inputs: ModelInputs) -> torch.Tensor:
        hidden = self.stack.run(inputs) if self.stack is not None else None
        if hidden is None:
            with forward_context(inputs.attn_metadata):
                hidden = self.model(inputs.input_ids, inputs.positions)
        return hidden

    def forget(self, request_id: str) -> None:
        """The request ended, or its blocks were freed (preempted): its draft KV is gone."""
        self._cached.pop(request_id, None)

    def propose(self, requests: list[ScheduledRequest], states: list[SamplingState],
                num_drafts: list[int]) -> Proposal:
        """Up to `num_drafts[i]` drafts to follow request i's tokens (prompt and outputs in
        `states[i]`; its last has no KV in the target's cache yet), within the slots its
        block table holds."""
        block_size = self.inputs.block_size
        jobs = []
        for s, state, count in zip(requests, states, num_drafts, strict=True):
            tokens = state.prompt_token_ids + state.output_token_ids
            position = len(tokens) - 1
            count = min(count, len(s.block_ids) * block_size - position,
                        self.max_model_len - position - 1)
            if count > 0:
                jobs.append(_Job(s, state, tokens, count,
                                 self._valid_prefix(s.request_id, tokens)))
        self._catch_up(jobs)
        start, num_steps = time.perf_counter(), 0
        for step in range(1, max((job.count for job in jobs), default=0)):
            active = [job for job in jobs if job.count > step]
            position = [len(job.tokens) - 1 + step for job in active]
            self._sample([ScheduledRequest(job.request.request_id, [job.drafts[-1]], pos,
                                           job.request.block_ids, True)
                          for job, pos in zip(active, position, strict=True)], active)
            num_steps += 1
        for job in jobs:
            self._cached[job.request.request_id] = (len(job.tokens), job.drafts)
        return Proposal({job.request.request_id: job.drafts for job in jobs},
                        {job.request.request_id: torch.stack(job.probs)
                         for job in jobs if job.probs},
                        time.perf_counter() - start, num_steps)

    def _valid_prefix(self, request_id: str, tokens: list[int]) -> int:
        """How many leading tokens have their draft KV: those up to the last drafting, and
        the drafts since kept (all but the last draft, which was never an input)."""
        length, drafts = self._cached.get(request_id, (0, []))
        return min(length + num_kept_drafts(drafts[:-1], tokens[length:]), len(tokens) - 1)

    def _catch_up(self, jobs: list[_Job]) -> None:
        """Runs each job's uncached tokens, in forwards of at most the buffers' size, and
        takes its first draft from the last."""
        while any(job.start < len(job.tokens) for job in jobs):
            batch, owners, room = [], [], self.inputs.max_num_tokens
            for job in jobs:
                if job.start == len(job.tokens) or room == 0:
                    continue
                end = min(len(job.tokens), job.start + room)
                batch.append(ScheduledRequest(job.request.request_id, job.tokens[job.start:end],
                                              job.start, job.request.block_ids,
                                              end == len(job.tokens)))
                owners.append(job)
                room -= end - job.start
                job.start = end
            self._sample(batch, [job for job, s in zip(owners, batch, strict=True) if s.sample])

    def _sample(self, batch: list[ScheduledRequest], sampling: list[_Job]) -> None:
        """One draft forward; appends the draft of each sampling row to its job: the argmax,
        or for a request that samples a draw and the distribution it came from."""
        inputs = self.inputs.prepare(batch)
        hidden = self._hidden(inputs)
        if not sampling:
            return
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        by_id = {job.request.request_id: job for job in sampling}
        jobs = [by_id[s.request_id] for s in inputs.sample_requests]
        random = [row for row, job in enumerate(jobs) if not job.state.params.is_greedy]
        tokens = greedy_tokens(logits).tolist()
        if random:
            drawn, probs = self.sampler.draw_drafts(logits[random],
                                                    [jobs[row].state for row in random])
            for row, token_id, row_probs in zip(random, drawn, probs, strict=True):
                tokens[row] = token_id
                jobs[row].probs.append(row_probs)
        for job, token_id in zip(jobs, tokens, strict=True):
            job.drafts.append(token_id)


@dataclass
class _Job:
    request: ScheduledRequest
    state: SamplingState
    tokens: list[int]
    count: int
    start: int  # the first token without draft KV
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # what each draft was drawn from
