"""The step loop: schedule, execute, update. Works on token ids only."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvserve.config import EngineConfig
from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.core.scheduler.output import StepShape, TokenLogprobs
from kvserve.core.scheduler.preemption import PreemptionCosts
from kvserve.core.scheduler.scheduler import Scheduler
from kvserve.request import Request
from kvserve.worker.executor import TensorParallelExecutor
from kvserve.worker.model_runner import ModelRunner


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
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = (ModelRunner(config) if config.tensor_parallel_size == 1
                       else TensorParallelExecutor(config))
        self.kv_cache = KVCacheManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            config.num_host_kv_blocks, config.num_offload_kv_blocks, config.num_disk_kv_blocks,
            config.sink_blocks, config.cache.streaming_window)
        if self.kv_cache.tiers is not None:
            self.kv_cache.tiers.add_disk_blocks(self.runner.disk_blocks())
        costs = PreemptionCosts(self.runner.swap_seconds_per_block())
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, costs)
        self.execute_seconds = 0.0  # in the model runner, which waits for the device
        # The last step had nothing to compute or copy: until a request is added, aborted
        # or moved, the next would not either.
        self.idle = False

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> CoreStep:
        """Runs one batch."""
        sched = self.scheduler.schedule()
        self.idle = sched.is_empty and not sched.transfers
        start = time.perf_counter()
        result = self.runner.execute_model(sched)
        seconds = time.perf_counter() - start
        self.execute_seconds += seconds
        self.scheduler.costs.observe_step(sched.num_scheduled_tokens, seconds)
        self.scheduler.drafts.observe_step(sched, seconds - result.draft_seconds)
        self.scheduler.drafts.observe_drafting(result.draft_step_seconds,
                                               result.num_draft_steps)
        updated = self.scheduler.update_from_output(sched, result)
        by_id = dict(zip(result.request_ids, result.logprobs, strict=True))
        if not self.scheduler.has_unfinished_requests():
            self.kv_cache.check_drained()
        return CoreStep(updated, [by_id[r.request_id] for r in updated], result.prompt_logprobs,
                        sched.shape)
