"""Helpers that drive a Scheduler on plain Python objects, with a pretend model."""

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.core.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvserve.core.scheduler.scheduler import Scheduler
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


def make_scheduler(num_blocks=16, block_size=4, budget=16, max_seqs=8, max_len=1024,
                   policy="chunked", prefix_caching=True, host_blocks=0,
                   preemption_mode="recompute", costs=None, offload_blocks=0, disk_blocks=0,
                   sink_blocks=0, window_blocks=0, **config):
    kv = KVCacheManager(num_blocks, block_size, prefix_caching, host_blocks, offload_blocks,
                        disk_blocks, sink_blocks, window_blocks)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             max_model_len=max_len, policy=policy,
                             preemption_mode=preemption_mode, **config)
    return Scheduler(config, kv, costs)


def add(sched, request_id, num_prompt=0, max_tokens=4, tokens=None, cache_salt=None,
        priority=0, tenant=None, **params):
    """Queues a request. Without `tokens`, its prompt of `num_prompt` tokens shares no block
    with any other id's."""
    if tokens is None:
        start = 1000 * sum(map(ord, request_id))
        tokens = list(range(start, start + num_prompt))
    request = Request(request_id, list(tokens), SamplingParams(**params), eos_token_ids=(2,),
                      max_tokens=max_tokens, cache_salt=cache_salt, priority=priority,
                      tenant=tenant)
    sched.add_request(request)
    return request


def step(sched, token=7, failed_promotions=()) -> SchedulerOutput:
    """Schedules, then pretends the model sampled `token` for every request that samples
    (and could not read the given disk blocks)."""
    out = sched.schedule()
    sampled = [s.request_id for s in out.scheduled if s.sample]
    sched.update_from_output(out, ModelRunnerOutput(
        sampled, [[token]] * len(sampled), failed_promotions=list(failed_promotions)))
    return out


def chunks(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request_id, len(s.token_ids)) for s in out.scheduled]
