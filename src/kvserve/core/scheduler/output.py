"""The plain data that crosses between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.sampling_params import SamplingParams

PENDING_TOKEN = -1


@dataclass(slots=True, frozen=True)
class NewRequestData:
    """Sent the first time a request is scheduled; the runner keeps it until the request ends.
    A request migrated from another engine brings the tokens it generated there and its
    seeded generator's state, so its sampling goes on as if it had not moved."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...] = ()
    generator_state: bytes | None = None
    lora_name: str | None = None


@dataclass(slots=True, frozen=True)
class ScheduledRequest:
    """Compute KV for `token_ids`, the request's tokens from `num_computed_tokens` on; when
    `sample` is set they end the request's known tokens, so the runner samples the next one.
    The last `num_draft_tokens` of them are speculative drafts that follow the known tokens:
    the runner samples after each, and keeps the drafts up to the first one sampled
    otherwise. A draft model may draft `num_lookahead_tokens` after the step's new tokens,
    in slots the block table holds for them. A streaming request's cache has dropped
    `num_evicted_tokens`: its tokens go that many positions lower, in the cache and for the
    rotary embedding. A blended prompt (CacheBlend) comes whole, with `reused_spans`: the
    [start, end) token ranges whose KV was copied in from chunks computed on their own; the
    runner recomputes only some of those tokens in context. Under async scheduling a token
    the step in flight samples is `PENDING_TOKEN` here: the runner takes it from that
    step's output on the device."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    num_evicted_tokens: int = 0
    num_draft_tokens: int = 0
    num_lookahead_tokens: int = 0
    reused_spans: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True, frozen=True)
class ChunkCopy:
    """A chunk's KV, computed from position 0 into `src_blocks`, copied to the tokens
    `position .. position + num_tokens - 1` of a request whose block table is `dst_blocks`,
    its keys turned by `position` to match."""

    src_blocks: list[int]
    dst_blocks: list[int]
    position: int
    num_tokens: int


@dataclass(slots=True)
class KVTransfers:
    """KV block work for the runner to do before the step's forward, in this order: chunk
    copies of blended prompts (into fresh blocks, from held ones), key shifts of sliding
    windows, spills (host block -> file), deletes, device -> host (requests preempted by
    swap, cached blocks evicted from the pool), promotions (file -> host block), host ->
    device (requests resuming, prefix hits in the host tier)."""

    chunks: list[ChunkCopy] = field(default_factory=list)
    shift: list[tuple[list[int], int]] = field(default_factory=list)  # (device blocks, tokens)
    spill: list[tuple[int, bytes]] = field(default_factory=list)  # (host block, block hash)
    delete: list[bytes] = field(default_factory=list)  # files beyond the disk tier's size
    to_host: list[tuple[int, int]] = field(default_factory=list)  # (device, host) blocks
    promote: list[tuple[bytes, int]] = field(default_factory=list)  # (block hash, host block)
    to_device: list[tuple[int, int]] = field(default_factory=list)  # (host, device) blocks

    def __bool__(self) -> bool:
        return bool(self.spill or self.delete or self.to_host or self.promote
                    or self.to_device or self.shift or self.chunks)


@dataclass(slots=True, frozen=True)
class StepShape:
    """What a step computes, in the terms its cost grows with: decode rows, prompt tokens,
    and the cached tokens the decode rows attend to."""

    num_decodes: int
    num_prefill_tokens: int
    num_context_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.num_decodes + self.num_prefill_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: list[str] = field(default_factory=list)
    transfers: KVTransfers = field(default_factory=KVTransfers)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def shape(self) -> StepShape:
        """A decode's drafts count as decodes: each is a decode row of the forward."""
        decodes = [s for s in self.scheduled if len(s.token_ids) - s.num_draft_tokens == 1]
        rows = sum(len(s.token_ids) for s in decodes)
        return StepShape(rows, self.num_scheduled_tokens - rows,
                         sum(len(s.token_ids) * s.num_computed_tokens
                             + len(s.token_ids) * (len(s.token_ids) - 1) // 2
                             for s in decodes))


# One token's logprobs: (top-k token ids, their logprobs, the token's logprob, its rank).
TokenLogprobs = tuple[list[int], list[float], float, int]


@dataclass(slots=True)
class ModelRunnerOutput:
    """The new tokens of each sampling request: one, or with speculative decoding the drafts
    it accepted and one more; and the drafts proposed for each request's next step."""

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # of the sampled tokens
    # Request id -> (the prompt position p of the first entry, the logprobs of prompt tokens
    # p, p + 1, ...) for requests that asked for prompt logprobs and ran prompt chunks.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    failed_promotions: list[bytes] = field(default_factory=list)  # unreadable disk blocks
    # Request id -> why it cannot go on: its grammar's parser stopped on its last token.
    failed_requests: dict[str, str] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_seconds: float = 0.0  # a draft model took, of the step's time
    draft_step_seconds: float = 0.0  # of which its decode steps after the first drafts took
    num_draft_steps: int = 0
