"""What the engine hands back to callers: one RequestOutput per prompt."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the top-k plus the sampled token).
SampleLogprobs = list[dict[int, Logprob]]
# The same per prompt token, with None for the first, which nothing predicts.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: SampleLogprobs | None = None
    stop_reason: str | int | None = None
    # Why a completion that finished "abort" could not go on, when the engine ended it (its
    # grammar's parser stopped); None for one aborted by the caller.
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the generated tokens' logprobs, with `logprobs` asked for."""
        if self.logprobs is None:
            return None
        return sum(entry[token].logprob
                   for token, entry in zip(self.token_ids, self.logprobs, strict=True))


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    first_scheduled_time: float | None = None  # time.monotonic() of first admission
    first_token_time: float | None = None  # time.monotonic() when its first token came
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's queues, KV pool and prefix cache (counters since start)."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_peak: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the cache at admission
    prefix_cache_hits: int  # of those, tokens whose KV was found and reused (any tier)
    prefix_cache_host_hits: int = 0  # of the hits, tokens loaded from the host tier
    prefix_cache_disk_hits: int = 0  # and from the disk tier
    num_swapped_preemptions: int = 0  # preemptions that kept the KV in host memory
    num_recomputed_tokens: int = 0  # tokens computed again after recompute preemptions
    kv_host_blocks_used: int = 0  # of the swap space
    kv_host_blocks_total: int = 0
    step_seconds: float = 0.0  # in engine steps: scheduling, the model, detokenizing
    execute_seconds: float = 0.0  # of those, in the model runner (forward and sampling)
    num_draft_tokens: int = 0  # speculative tokens verified
    num_accepted_tokens: int = 0  # of those, the ones the model agreed with
    num_blended_prompts: int = 0  # prompts given as segments and blended (CacheBlend)
    blend_chunk_hit_tokens: int = 0  # their chunks' tokens whose KV was cached
    blend_chunk_fill_tokens: int = 0  # and those computed on their own first

    @property
    def host_seconds(self) -> float:
        """Step time outside the model runner: scheduling, bookkeeping, detokenizing. Work
        that overlapping the next step's scheduling with the device's step could hide."""
        return self.step_seconds - self.execute_seconds

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0
