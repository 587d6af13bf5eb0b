"""The step loop: schedule, execute, update. Works on token ids only."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvserve.config import EngineConfig
from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.core.scheduler.output import SchedulerOutput, StepShape, TokenLogprobs
from kvserve.core.scheduler.preemption import PreemptionCosts
from kvserve.core.scheduler.scheduler import Scheduler
from kvserve.request import Request
from kvserve.worker.executor import TensorParallelExecutor
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.pending_output import PendingOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CoreStep:
    """What a step produced: the requests that got a token, with that token's logprobs, and
    the prompt logprobs computed (request id -> first position scored, entries), and the
    work it did."""

    updated: list[Request]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]]
    shape: StepShape


class EngineCore:
    """Async scheduling (`config.async_scheduling`): while the device runs step N, the host
    schedules and launches step N+1, then takes in N's output, so the device never waits for
    the host between steps. Step N+1 computes the tokens N samples from N's output on the
    device; a request that N finishes wastes its row of N+1, which is dropped. A step whose
    requests need their previous tokens on the host to sample (see
    `Sampler.samples_on_device`) is taken in before the next is scheduled, as without."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        config.check_device()
        self.runner = (ModelRunner(config) if config.tensor_parallel_size == 1
                       else TensorParallelExecutor(config))
        self.kv_cache = KVCacheManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            config.num_host_kv_blocks, config.num_offload_kv_blocks, config.num_disk_kv_blocks,
            config.sink_blocks, config.cache.streaming_window)
        if self.kv_cache.tiers is not None:
            self.kv_cache.tiers.add_disk_blocks(self.runner.disk_blocks())
        log_kv_pool(config, self.runner.num_blocks)
        costs = PreemptionCosts(self.runner.swap_seconds_per_block())
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, costs)
        self.execute_seconds = 0.0  # in the model runner, which waits for the device
        # The last step had nothing to compute or copy: until a request is added, aborted
        # or moved, the next would not either.
        self.idle = False
        self._in_flight: _Launched | None = None
        self._last_end = 0.0  # perf_counter when the last output was taken in

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> CoreStep:
        """Takes in one step's output, launching the next first when it can."""
        fresh = self._in_flight is None
        launched = self._in_flight or self._launch()
        self._in_flight = None
        if not launched.output.done:
            self._in_flight = self._launch()
        step = self._take_in(launched)
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            self._take_in(self._in_flight)  # all it computes was for requests now finished
            self._in_flight = None
        if not self.scheduler.has_unfinished_requests():
            self.kv_cache.check_drained()
        # A step scheduled before the last output was taken in says nothing of what the
        # scheduler would find now.
        self.idle = (fresh and self._in_flight is None and launched.sched.is_empty
                     and not launched.sched.transfers)
        return step

    def settle(self) -> CoreStep | None:
        """Takes in the step in flight, if any, so that requests, their KV and the runner
        agree (before a request migrates, say)."""
        if self._in_flight is None:
            return None
        launched, self._in_flight = self._in_flight, None
        return self._take_in(launched)

    def _launch(self) -> _Launched:
        sched = self.scheduler.schedule()
        start = time.perf_counter()
        return _Launched(sched, self.runner.launch(sched), start)

    def _take_in(self, launched: _Launched) -> CoreStep:
        sched = launched.sched
        result = launched.output.result()
        # The device's time for the step: from its launch, or from when the device finished
        # the step before, if later (launches queue behind it).
        end = time.perf_counter()
        seconds = end - max(launched.start, self._last_end)
        self._last_end = end
        self.execute_seconds += seconds
        shape = sched.shape
        self.scheduler.costs.observe_step(shape.num_tokens, seconds)
        self.scheduler.drafts.observe_step(shape, seconds - result.draft_seconds)
        self.scheduler.drafts.observe_drafting(result.draft_step_seconds,
                                               result.num_draft_steps)
        updated = self.scheduler.update_from_output(sched, result)
        by_id = dict(zip(result.request_ids, result.logprobs, strict=True))
        return CoreStep(updated, [by_id[r.request_id] for r in updated], result.prompt_logprobs,
                        shape)


@dataclass(slots=True)
class _Launched:
    sched: SchedulerOutput
    output: PendingOutput
    start: float  # perf_counter at launch


def log_kv_pool(config: EngineConfig, num_blocks: int) -> None:
    """The pool's size, which kv_cache_memory or its default sets (see
    `EngineConfig.num_kv_blocks`; on CUDA, `kv_pool.blocks_in_device_memory`), in tokens
    and in requests of max_model_len at once."""
    tokens, longest = num_blocks * config.cache.block_size, config.scheduler.max_model_len
    logger.info("KV cache: %d tokens in %d blocks (%.1f MiB%s), %.2fx requests of %d tokens "
                "(max_model_len) at once", tokens, num_blocks,
                num_blocks * config.pool_bytes_per_block / 2**20,
                " per rank" if config.tensor_parallel_size > 1 else "", tokens / longest, longest)
    if tokens < longest and not config.cache.streaming_window:
        logger.warning("KV cache: the pool holds fewer tokens than max_model_len (%d < %d); "
                       "a request whose prompt and max_tokens need more is refused. Raise "
                       "%s or lower max_model_len", tokens, longest,
                       "gpu_memory_utilization" if config.sized_by_device_memory
                       else "kv_cache_memory")
