"""The engine's view of one sequence being generated."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """A sequence: its prompt, the tokens generated so far and how many have KV in the cache.

    `num_computed_tokens` counts tokens whose KV is written; the tokens still to compute are
    those after them, prompt then output (`token_ids_slice`). Preemption by recompute resets
    it to zero. A streaming request (attention sinks and a window) has dropped
    `num_evicted_tokens` of them from after its sinks, and its cached tokens sit at positions
    that many lower.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # when first admitted to the running batch
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens a step still in flight samples (async scheduling): the next step computes them
    # before their ids reach the host, from the device's copy.
    num_pending_tokens: int = 0
    num_evicted_tokens: int = 0  # leading window tokens dropped from a streaming cache
    num_preemptions: int = 0
    stop_reason: str | int | None = None
    error: str | None = None  # why the engine ended it early (finished aborted)
    cache_salt: str | None = None  # requests with different salts never share KV blocks
    lora_name: str | None = None  # the LoRA adapter it runs with; None: the base model
    lora_load: int = 0  # which loading of that adapter: a reloaded one never shares KV
    priority: int = 0  # under the priority policy, lower values are served first
    tenant: str | None = None  # under the fair policy, tenants share the token budget
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, chained
    # CacheBlend: the prompt is these segments' tokens in turn; all but the last are chunks
    # whose KV, computed on its own, is reused wherever they appear (see
    # core/scheduler/blend.py). `blended` once that happened (or was given up for a plain
    # prefill): a recompute after preemption is then a plain prefill.
    segment_lens: tuple[int, ...] = ()
    blended: bool = False
    generator_state: bytes | None = None  # a migrated request's seeded sampler, until resumed
    # Speculative decoding: the tokens drafted to follow, some of which the next step
    # verifies, a decayed count of how earlier drafts fared, and when a draft model next
    # drafts one token, just to measure, if none pay (see speculation.py).
    spec_token_ids: list[int] = field(default_factory=list)
    draft_hits: float = 0.0
    draft_trials: float = 0.0
    next_probe: int = 0  # output tokens
    probe_gap: int = 0

    @property
    def num_cached_tokens(self) -> int:
        """Computed tokens whose KV the cache still holds."""
        return self.num_computed_tokens - self.num_evicted_tokens

    @property
    def blend_key(self) -> str | None:
        """What sets a segmented prompt's KV apart from a plain prompt's of the same tokens:
        its segment boundaries."""
        return "blend:" + ",".join(map(str, self.segment_lens)) if self.segment_lens else None

    @property
    def tenant_key(self) -> str:
        return self.tenant or ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Its tokens once the step in flight has sampled: the tokens the scheduler plans for."""
        return self.num_tokens + self.num_pending_tokens

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


def num_kept_drafts(drafts: list[int], token_ids: list[int]) -> int:
    """How many leading drafts equal the tokens that came (as far as both go)."""
    return next((i for i, (d, t) in enumerate(zip(drafts, token_ids, strict=False)) if d != t),
                min(len(drafts), len(token_ids)))
