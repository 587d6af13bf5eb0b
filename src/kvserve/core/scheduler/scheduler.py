"""Continuous batching with stall-free chunked prefill (Sarathi-Serve) under a token budget.

Every step: running decodes first, then running partial prefills, then new prompts from the
waiting queue (FCFS), each as large a chunk as the remaining `max_num_batched_tokens` allows.
The `prefill_first` policy instead runs waiting prompts whole (never split; the budget only
limits how many share a step) in steps of their own before any decode, as the first
continuous-batching schedulers did; it exists as a baseline to measure.
When the pool runs out of blocks, the newest running request is preempted by recompute: its
blocks are freed and it waits at the front of the queue to be prefilled again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.core.scheduler.output import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from kvserve.core.scheduler.stop import check_stop
from kvserve.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self._started_ids: set[str] = set()
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        """Queues a validated request at the back of the waiting queue."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Picks this step's batch, allocating KV blocks (and preempting) as needed; advances
        each scheduled request's `num_computed_tokens` by its chunk."""
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.config.max_num_batched_tokens
        chunks: dict[str, int] = {}
        decodes_first = sorted(self.running, key=_has_prompt_left)
        if self.config.policy == "prefill_first":
            # Whole prompts in a step of their own whenever any can run; decodes wait.
            self._admit_waiting(out, chunks, budget, whole_prompts=True)
            if not chunks:
                self._schedule_running(decodes_first, out, chunks, budget)
        else:
            budget = self._schedule_running(decodes_first, out, chunks, budget)
            self._admit_waiting(out, chunks, budget, whole_prompts=False)
        for request in self.running:
            if request.request_id in chunks:
                out.scheduled.append(self._schedule_chunk(request, chunks[request.request_id]))
        order = {r.request_id: i for i, r in enumerate(decodes_first)}
        out.scheduled.sort(key=lambda s: order.get(s.request_id, len(order)))
        return out

    def _schedule_running(self, candidates: list[Request], out: SchedulerOutput,
                          chunks: dict[str, int], budget: int) -> int:
        """Gives each running candidate its next chunk, preempting the newest running
        requests while blocks run short; returns the budget left."""
        for request in candidates:
            if request.status != RequestStatus.RUNNING or budget == 0:
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.running[-1]
                budget += chunks.pop(victim.request_id, 0)
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                chunks[request.request_id] = num_new
                budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, chunks: dict[str, int], budget: int,
                       whole_prompts: bool) -> None:
        """Admits waiting requests FCFS into the remaining budget, each starting after its
        cached prefix. With `whole_prompts`, prompts are never split: the step's first may
        exceed the budget, later ones must fit in it. A request whose next block another
        request computes in this very step waits for the next step to hit it instead."""
        pending = self._blocks_completed_by(chunks) if self.waiting else set()
        while (not out.preempted_request_ids and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            cached = self.kv_cache.find_cached_prefix(request)
            hashes = request.block_hashes
            if len(cached) < len(hashes) and hashes[len(cached)] in pending:
                break
            num_cached_tokens = len(cached) * self.kv_cache.block_size
            remaining = request.num_tokens - num_cached_tokens
            if whole_prompts and chunks and remaining > budget:
                break
            num_new = remaining if whole_prompts else min(remaining, budget)
            if not self.kv_cache.allocate_slots(request, num_new, cached):
                break
            self.waiting.popleft()
            self.kv_cache.record_lookup(request, num_cached_tokens)
            request.num_computed_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.request_id not in self._started_ids:
                self._started_ids.add(request.request_id)
                request.scheduled_time = time.monotonic()
                out.new_requests.append(NewRequestData(
                    request.request_id, request.prompt_token_ids, request.sampling_params,
                    request.eos_token_ids))
            chunks[request.request_id] = num_new
            pending.update(self._blocks_completed_by({request.request_id: num_new}))
            budget = max(budget - num_new, 0)

    def _blocks_completed_by(self, chunks: dict[str, int]) -> set[bytes]:
        """The hashes of the full blocks that the given chunks finish computing."""
        if not self.kv_cache.enable_prefix_caching:
            return set()
        size = self.kv_cache.block_size
        completed = set()
        for request_id, num_new in chunks.items():
            request = self.requests[request_id]
            hashes = self.kv_cache.block_hashes(request)
            start = request.num_computed_tokens // size
            completed.update(hashes[start:(request.num_computed_tokens + num_new) // size])
        return completed

    def _schedule_chunk(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_ids_slice(start, start + num_new),
            num_computed_tokens=start,
            block_ids=list(self.kv_cache.get_block_ids(request.request_id)),
            sample=request.num_computed_tokens == request.num_tokens,
        )

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, scheduled: SchedulerOutput,
                           result: ModelRunnerOutput) -> list[Request]:
        """Appends each sampled token to its request and finishes those that hit a token-level
        stop; returns the requests that got a token."""
        for scheduled_request in scheduled.scheduled:
            request = self.requests.get(scheduled_request.request_id)
            if request is not None:
                self.kv_cache.cache_computed_blocks(request)
        updated = []
        for request_id, token_ids in zip(result.request_ids, result.sampled_token_ids,
                                          strict=True):
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            request.output_token_ids.extend(token_ids)
            status = check_stop(request, self.config.max_model_len)
            if status is not None:
                self._finish(request, status)
            updated.append(request)
        return updated

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Ends the given requests (stop string hit, or aborted) and frees their blocks;
        unknown or already finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.status = status
        del self.requests[request.request_id]
        if request.request_id in self._started_ids:
            self._started_ids.discard(request.request_id)
            self._finished_ids.add(request.request_id)


def _has_prompt_left(request: Request) -> bool:
    """More than one token to compute: the request is (re)filling its prompt, not decoding."""
    return request.num_tokens - request.num_computed_tokens > 1
