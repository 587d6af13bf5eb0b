"""Continuous batching with stall-free chunked prefill (Sarathi-Serve) under a token budget.

Every step: running decodes first, then running partial prefills, then new prompts from the
waiting queue in the order of the scheduling policy (policy.py: fcfs, priority, fair), each
as large a chunk as the remaining `max_num_batched_tokens` allows. Under priority and fair,
a waiting request that outranks running ones takes back their prefill chunks' budget this
step, and preempts them when it lacks KV blocks or a sequence slot.
The `prefill_first` policy instead runs waiting prompts whole (never split; the budget only
limits how many share a step) in steps of their own before any decode, as the first
continuous-batching schedulers did; it exists as a baseline to measure.
When the pool runs out of blocks, the running request the policy ranks last (under fcfs, the
newest) is preempted and waits at the front of its lane. By recompute, its blocks are freed
and it is prefilled again; by swap, its KV moves to host blocks and back when it resumes.
`preemption_mode` picks one, or `auto` picks per request whichever `PreemptionCosts`
measures cheaper.
With speculative decoding, a decode also carries some of the tokens the runner drafted for it
last step: as many as `DraftPolicy` expects to pay off, and the budget, its max_tokens and
max_model_len allow. The runner returns the drafts the model agreed with plus one token of
its own; the KV written for the rejected ones is overwritten later (their slots lie past the
request's computed tokens).
A prompt given as segments (CacheBlend) is blended: at admission it holds the KV blocks of its
chunks (every segment but the last) computed on their own; chunks not in the cache yet are
computed in this step, each as a sequence of its own from position 0, and the request waits a
step. Then it is admitted with blocks for all of it and its chunks' KV copied in, and runs as
prefill chunks under the budget like any prompt; the runner recomputes only part of each
chunk in context.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache.manager import CachedPrefix, KVCacheManager, SegmentKV
from kvserve.core.scheduler.output import (
    PENDING_TOKEN,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from kvserve.core.scheduler.policy import WaitingQueue, make_policy
from kvserve.core.scheduler.preemption import PreemptionCosts
from kvserve.core.scheduler.speculation import DraftPolicy
from kvserve.core.scheduler.stop import check_stop
from kvserve.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 costs: PreemptionCosts | None = None) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.costs = costs or PreemptionCosts(swap_seconds_per_block=0.0)
        self.policy = make_policy(config.scheduling_policy, config.max_num_batched_tokens)
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self._started_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_swapped_preemptions = 0  # of those, by swap
        self.num_recomputed_tokens = 0  # tokens computed again after recompute preemptions
        self._dropped: dict[str, int] = {}  # request id -> computed tokens its preemption dropped
        self.drafts = DraftPolicy()
        self._num_decoding = 0  # running requests with one token to compute, this step
        self._lookahead: dict[str, int] = {}  # request id -> draft tokens to allocate, this step
        self.num_draft_tokens = 0  # speculative tokens verified
        self.num_accepted_tokens = 0  # of those, the ones the model agreed with
        self._segments: dict[str, list[SegmentKV]] = {}  # blended request id -> held chunks
        self._filling: list[tuple[SegmentKV, int]] = []  # chunks this step computes, tokens
        self.num_blended_prompts = 0
        self.num_chunk_hit_tokens = 0  # blended prompts' tokens whose KV was in the cache
        self.num_chunk_fill_tokens = 0  # of those not, computed on their own first
        # Under a streaming window, a prompt's chunks are this long, wherever a step's budget
        # ends (`_chunk_size`); short enough that the running batch's decodes leave room.
        room_beside_decodes = config.max_num_batched_tokens - config.max_num_seqs + 1
        self._window_stride = (max(1, min(kv_cache.window_chunk, room_beside_decodes))
                               if kv_cache.window_blocks else 0)

    def add_request(self, request: Request, first_in_line: bool = False) -> None:
        """Queues a validated request at the back of the waiting queue (or its front)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.policy.on_added(request)
        if first_in_line:
            self.waiting.appendleft(request)
        else:
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
        decoding: list[Request] = []
        prefilling: list[Request] = []
        for request in self.running:
            (prefilling if _has_prompt_left(request) else decoding).append(request)
        if self.policy.ranks:
            now = time.monotonic()
            decoding.sort(key=lambda r: self.policy.rank(r, now))
            prefilling.sort(key=lambda r: self.policy.rank(r, now))
        decodes_first = decoding + prefilling
        self._num_decoding = len(decoding)
        self._lookahead: dict[str, int] = {}
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
        out.transfers = self.kv_cache.take_transfers()
        return out

    def _schedule_running(self, candidates: list[Request], out: SchedulerOutput,
                          chunks: dict[str, int], budget: int) -> int:
        """Gives each running candidate its next chunk, preempting the lowest-ranked running
        requests while blocks run short; returns the budget left."""
        for request in candidates:
            if request.status != RequestStatus.RUNNING or budget == 0:
                continue
            if self.config.prefill_only and (request.num_output_tokens
                                             or request.num_pending_tokens):
                continue  # prefilled: held until it moves to a decode replica
            if self._ends_in_flight(request):
                continue
            remaining = request.num_tokens_with_pending - request.num_computed_tokens
            if self._stream_waits(remaining, budget):
                continue
            num_new = self.kv_cache.slide_window(request, self._chunk_size(remaining, budget))
            lookahead = self._num_lookahead(request, request.num_computed_tokens, num_new)
            num_drafts = self._num_drafts(request, budget - num_new)
            num_new += num_drafts
            # Short of blocks, the lookahead, then the drafts, then waiting blended prompts'
            # chunks give way before anyone is preempted.
            while not self.kv_cache.allocate_slots(request, num_new + lookahead):
                if lookahead or num_drafts:
                    num_new, num_drafts, lookahead = num_new - num_drafts, 0, 0
                    continue
                if self._release_chunks():
                    continue
                victim = self._last_ranked()
                budget += chunks.pop(victim.request_id, 0)
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                chunks[request.request_id] = num_new
                self._lookahead[request.request_id] = lookahead
                budget -= num_new
        return budget

    def _chunk_size(self, remaining: int, budget: int) -> int:
        """The tokens a request with `remaining` to compute gets in a step with `budget`
        left: as many as fit, and under a streaming window no more than its stride."""
        return min(remaining, budget, self._window_stride or remaining)

    def _stream_waits(self, remaining: int, budget: int) -> bool:
        """Whether a stream's next chunk (its stride, or the rest) misses the budget left,
        so it waits a step. The cached tokens a chunk's queries attend to depend on where
        the chunk starts, so a stream's chunks start at the same places in every batch, and
        its output does not depend on what runs beside it."""
        return bool(self._window_stride) and min(remaining, self._window_stride) > budget

    def _ends_in_flight(self, request: Request) -> bool:
        """Whether the token the step in flight samples for it is its last by length."""
        if not request.num_pending_tokens:
            return False
        return (request.num_output_tokens + request.num_pending_tokens >= request.max_tokens
                or request.num_tokens_with_pending >= self.config.max_model_len)

    def _num_lookahead(self, request: Request, start: int, num_new: int) -> int:
        """With a draft model, the tokens it should draft after this step's chunk (of
        `num_new` tokens from `start`), which need slots: none unless the chunk ends the
        request's known tokens (it samples)."""
        most = self.config.draft_lookahead
        if (not most or not request.sampling_params.allows_drafts
                or start + num_new != request.num_tokens):
            return 0
        return self.drafts.num_to_propose(request, self._num_decoding, most)

    def _num_drafts(self, request: Request, room: int) -> int:
        """How many of the request's drafts to verify this step: none unless it decodes, at
        most `room` tokens of budget, no more than could be kept without passing its
        max_tokens or max_model_len (the model adds a token of its own), and no more than
        the draft policy expects to pay off."""
        if not request.spec_token_ids or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        limit = min(room, request.max_tokens - request.num_output_tokens - 1,
                    self.config.max_model_len - request.num_tokens)
        if limit <= 0:
            return 0
        return min(limit, self.drafts.num_to_verify(request, self._num_decoding))

    def _admit_waiting(self, out: SchedulerOutput, chunks: dict[str, int], budget: int,
                       whole_prompts: bool) -> None:
        """Admits waiting requests in policy order into the remaining budget, each starting
        after its cached prefix (or where it was swapped out). With `whole_prompts`, prompts
        are never split: the step's first may exceed the budget, later ones must fit in it.
        A request whose next block another request computes in this very step waits for the
        next step to hit it instead. Nothing is admitted in a step that preempted running
        requests for blocks."""
        if out.preempted_request_ids:
            return
        pending = self._blocks_completed_by(chunks) if self.waiting else set()
        while self.waiting:
            request = self.waiting.peek()
            if request.num_pending_tokens:  # preempted while a step samples for it
                break
            if budget == 0:
                budget += self._defer_prefills_for(request, chunks)
                if budget == 0:
                    break
            if request.segment_lens and not request.blended:
                num_new = self._start_blend(request, out, budget)
                if num_new is None:
                    break
                chunks[request.request_id] = num_new
                budget -= num_new
                continue
            swapped = self.kv_cache.is_swapped(request)
            cached = CachedPrefix() if swapped else self.kv_cache.find_cached_prefix(request)
            if cached.on_disk:  # read into host memory this step, loaded the next
                self.kv_cache.promote(cached.on_disk)
                break
            if not swapped and self._computes_next_block(request, len(cached), pending):
                break
            if not (swapped or whole_prompts) and self._stream_waits(
                    request.num_tokens - len(cached) * self.kv_cache.block_size, budget):
                break
            num_new = None
            if len(self.running) < self.config.max_num_seqs:
                num_new = self._start(request, cached, out, budget,
                                      whole_prompts and bool(chunks), whole_prompts)
            if num_new is None and self._release_chunks(keep=request):
                continue
            if num_new is None:
                victim = self._last_ranked()
                if victim is None or not self.policy.outranks(request, victim,
                                                              time.monotonic()):
                    break
                budget += chunks.pop(victim.request_id, 0)
                self._preempt(victim, out)
                continue
            if num_new:  # zero: swapped in with a full window, it slides from next step on
                chunks[request.request_id] = num_new
                pending.update(self._blocks_completed_by({request.request_id: num_new}))
                budget = max(budget - num_new, 0)

    def _start(self, request: Request, cached: CachedPrefix, out: SchedulerOutput,
               budget: int, must_fit: bool, whole_prompts: bool) -> int | None:
        """Moves the waiting request into the running batch with blocks for its first
        chunk (after its `cached` prefix blocks), which it returns; None, changing nothing,
        when it cannot start now."""
        kv = self.kv_cache
        if kv.is_swapped(request):
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining if whole_prompts else min(remaining, budget),
                          kv.window_room(request))
            if not kv.swap_in(request, num_new):
                return None
        else:
            num_cached_tokens = len(cached) * kv.block_size
            remaining = request.num_tokens - num_cached_tokens
            if must_fit and remaining > budget:
                return None
            num_new = kv.slide_window(request, remaining if whole_prompts
                                      else self._chunk_size(remaining, budget))
            lookahead = self._num_lookahead(request, num_cached_tokens, num_new)
            if not self.kv_cache.allocate_slots(request, num_new + lookahead, cached):
                lookahead = 0
                if not self.kv_cache.allocate_slots(request, num_new, cached):
                    return None
            self._lookahead[request.request_id] = lookahead
            self.kv_cache.record_lookup(request, num_cached_tokens)
            request.num_computed_tokens = num_cached_tokens
            dropped = self._dropped.pop(request.request_id, 0)
            self.num_recomputed_tokens += max(dropped - num_cached_tokens, 0)
        self._run(request, out)
        return num_new

    def _start_blend(self, request: Request, out: SchedulerOutput, budget: int) -> int | None:
        """Admits a blended prompt once it holds its chunks' KV, with blocks for all of it and
        their copies into them; returns its first chunk of tokens (the rest follow as
        running prefill chunks, each blended in turn). None while it waits: for blocks or a
        sequence slot, or for its missing chunks, which this step computes as far as the budget
        and sequence slots go (each a sequence of its own, a long one over several steps)."""
        kv, request_id, num_tokens = self.kv_cache, request.request_id, request.num_tokens
        if len(self.running) >= self.config.max_num_seqs:
            return None
        segments = self._segments.get(request_id)
        if segments is None:
            segments = kv.find_segments(request)
            if not kv.hold_segments(request, segments):
                return None
            self._segments[request_id] = segments
        missing = [(i, s) for i, s in enumerate(segments) if not s.computed]
        if missing:
            room = self.config.max_num_seqs - len(self.running)
            for i, segment in missing[:room]:
                num_new = min(segment.num_tokens - segment.num_filled, budget)
                if num_new == 0:
                    break
                first = segment.start + segment.num_filled
                out.scheduled.append(ScheduledRequest(
                    f"{request_id}/chunk{i}", request.prompt_token_ids[first:first + num_new],
                    segment.num_filled, segment.blocks, sample=False))
                self._filling.append((segment, num_new))
                self.num_chunk_fill_tokens += num_new
                budget -= num_new
            return None
        if not kv.allocate_slots(request, num_tokens):
            return None
        kv.copy_segments(request, segments)
        self.num_blended_prompts += 1
        self.num_chunk_hit_tokens += sum(s.num_tokens for s in segments if not s.num_filled)
        self._run(request, out)
        return min(num_tokens, budget)

    def _release_chunks(self, keep: Request | None = None) -> bool:
        """Has a waiting blended prompt (not `keep`, none whose chunks this step computes)
        let go of its chunks' blocks for others short of them; it looks them up again when
        it next comes up. False when none holds any."""
        filling = {id(s) for s, _ in self._filling}
        for request_id, segments in self._segments.items():
            request = self.requests[request_id]
            if (request is not keep and request.status != RequestStatus.RUNNING
                    and not any(id(s) in filling for s in segments)):
                self.kv_cache.release_segments(request)
                del self._segments[request_id]
                return True
        return False

    def _run(self, request: Request, out: SchedulerOutput) -> None:
        """Moves an admitted request from waiting to running; tells the runner of it the
        first time."""
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if request.request_id not in self._started_ids:
            self._started_ids.add(request.request_id)
            if request.scheduled_time is None:  # a migrated request keeps its first
                request.scheduled_time = time.monotonic()
            out.new_requests.append(NewRequestData(
                request.request_id, request.prompt_token_ids, request.sampling_params,
                request.eos_token_ids, tuple(request.output_token_ids),
                request.generator_state, request.lora_name))
            request.generator_state = None

    def _defer_prefills_for(self, request: Request, chunks: dict[str, int]) -> int:
        """Takes back this step's prefill chunks of running requests that `request`
        outranks, last-ranked first, until one frees budget; returns the budget freed. The
        deferred keep their blocks and go on next step."""
        if not self.policy.preempts_for_waiting:
            return 0
        now = time.monotonic()
        for running in sorted(self.running, key=lambda r: self.policy.rank(r, now),
                              reverse=True):
            if (chunks.get(running.request_id, 0) > 0 and _has_prompt_left(running)
                    and self.policy.outranks(request, running, now)):
                return chunks.pop(running.request_id)
        return 0

    @staticmethod
    def _computes_next_block(request: Request, num_cached: int, pending: set[bytes]) -> bool:
        """Whether a request scheduled this step is computing the waiting request's next
        uncached block, which it should hit next step instead of computing twice."""
        hashes = request.block_hashes
        return num_cached < len(hashes) and hashes[num_cached] in pending

    def _last_ranked(self) -> Request | None:
        """The running request to preempt first: the one the policy ranks last, the newest
        among equals."""
        if not self.running:
            return None
        now = time.monotonic()
        return max(reversed(self.running), key=lambda r: self.policy.rank(r, now))

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
        """Counts the chunk as computed; a decode's drafts (which end its chunk) until the
        runner says which were accepted."""
        start = request.num_computed_tokens
        num_tokens = request.num_tokens
        known = min(num_new, num_tokens - start)
        pending = min(num_new - known, request.num_pending_tokens)
        drafts = request.spec_token_ids[:num_new - known - pending]
        end = start + known
        segments = self._segments.get(request.request_id)
        reused = () if segments is None else tuple(
            (max(s.start, start) - start, min(s.start + s.num_tokens, end) - start)
            for s in segments if s.start < end and s.start + s.num_tokens > start)
        sample = end + pending == num_tokens + request.num_pending_tokens
        request.num_computed_tokens += num_new
        request.num_pending_tokens += sample
        self.policy.on_scheduled(request, num_new)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_ids_slice(start, end) + [PENDING_TOKEN] * pending + drafts,
            num_computed_tokens=start,
            block_ids=list(self.kv_cache.get_block_ids(request.request_id)),
            sample=sample,
            num_evicted_tokens=request.num_evicted_tokens,
            num_draft_tokens=len(drafts),
            num_lookahead_tokens=self._lookahead.get(request.request_id, 0),
            reused_spans=reused,
        )

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        request.spec_token_ids = []
        blending = self._segments.pop(request.request_id, None) is not None
        if self._swaps(request):
            self.kv_cache.swap_out(request)
            self.num_swapped_preemptions += 1
            request.blended |= blending  # its blended KV goes on; the rest, plainly
        else:
            self.kv_cache.free(request)
            self._dropped[request.request_id] = request.num_computed_tokens
            request.num_computed_tokens = request.num_evicted_tokens = 0
        out.preempted_request_ids.append(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _swaps(self, request: Request) -> bool:
        """Whether to keep the request's KV on the host rather than recompute it."""
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.kv_cache.can_swap_out(request):
            return False
        num_tokens = request.num_computed_tokens
        return mode == "swap" or self.costs.prefers_swap(
            num_tokens, self.kv_cache.num_blocks_for(num_tokens))

    def update_from_output(self, scheduled: SchedulerOutput,
                           result: ModelRunnerOutput) -> list[Request]:
        """Appends each request's new tokens, uncounts the drafts the model rejected, and
        finishes the requests that hit a token-level stop (tokens after it are dropped);
        keeps the next step's drafts. Returns the requests that got a token."""
        self.kv_cache.end_step(result.failed_promotions)
        self._end_blends()
        sampled = dict(zip(result.request_ids, result.sampled_token_ids, strict=True))
        for scheduled_request in scheduled.scheduled:
            request = self.requests.get(scheduled_request.request_id)
            if request is None:
                continue
            request.num_pending_tokens -= scheduled_request.sample
            num_drafts = scheduled_request.num_draft_tokens
            if num_drafts and request.request_id in sampled:
                accepted = len(sampled[request.request_id]) - 1
                request.num_computed_tokens -= num_drafts - accepted
                self.num_draft_tokens += num_drafts
                self.num_accepted_tokens += accepted
            self.kv_cache.cache_computed_blocks(request)
        # A streaming window bounds the cache, not the stream.
        max_len = None if self.kv_cache.window_blocks else self.config.max_model_len
        updated = []
        for request_id, token_ids in sampled.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.spec_token_ids:
                self.drafts.observe(request, token_ids)
            for token_id in token_ids:
                request.output_token_ids.append(token_id)
                status = check_stop(request, max_len)
                if status is not None:
                    self._finish(request, status)
                    break
            if request_id in result.failed_requests and not request.is_finished:
                request.error = result.failed_requests[request_id]
                self._finish(request, RequestStatus.FINISHED_ABORTED)
            request.spec_token_ids = result.draft_token_ids.get(request_id, [])
            updated.append(request)
        return updated

    def _end_blends(self) -> None:
        """Registers the chunks computed this step. Running blended prompts let go of their
        chunks (copied in by now), and are blended once their prompt is computed."""
        for segment, num_new in self._filling:
            segment.num_filled += num_new
        self.kv_cache.cache_segments([s for s, _ in self._filling
                                      if s.num_filled == s.num_tokens])
        self._filling = []
        for request_id in list(self._segments):
            request = self.requests[request_id]
            if request.status == RequestStatus.RUNNING:
                self.kv_cache.release_segments(request)
                if request.num_computed_tokens >= request.num_prompt_tokens:
                    request.blended = True
                    del self._segments[request_id]

    def detach_request(self, request_id: str) -> Request | None:
        """Takes a running request out of this engine unfinished, to go on in another
        (migration): its blocks return to the pool and the runner drops its state. Call it
        after copying its KV out. None when it is not running here. A token that a step in
        flight samples for it is not its own: take that step in first to keep it."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.RUNNING:
            return None
        request.num_pending_tokens = 0
        self.running.remove(request)
        self.kv_cache.free(request)
        self.policy.on_finished(request)
        request.spec_token_ids = []
        del self.requests[request_id]
        self._started_ids.discard(request_id)
        self._finished_ids.add(request_id)
        return request

    def attach_request(self, request: Request, host_blocks: list[int] | None) -> None:
        """Queues, first in line, a request migrated from another engine: its computed
        tokens' KV waits in `host_blocks` to be swapped in, or, without them, is recomputed."""
        if host_blocks is None:
            request.num_computed_tokens = request.num_evicted_tokens = 0
        else:
            self.kv_cache.adopt_swapped(request, host_blocks)
        request.status = RequestStatus.PREEMPTED
        self.add_request(request, first_in_line=True)

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
        self.policy.on_finished(request)
        self._dropped.pop(request.request_id, None)
        self._segments.pop(request.request_id, None)
        request.status = status
        del self.requests[request.request_id]
        if request.request_id in self._started_ids:
            self._started_ids.discard(request.request_id)
            self._finished_ids.add(request.request_id)


def _has_prompt_left(request: Request) -> bool:
    """More than one token to compute: the request is (re)filling its prompt, not decoding."""
    return request.num_tokens_with_pending - request.num_computed_tokens > 1
