"""Text in, RequestOutputs out: validation, tokenization, n-way fan-out, detokenization and
stop strings around an EngineCore."""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.config import EngineConfig
from kvserve.core.scheduler.output import TokenLogprobs
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.engine_core import EngineCore
from kvserve.errors import CheckpointError
from kvserve.outputs import CompletionOutput, EngineStats, Logprob, PromptLogprobs, RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


@dataclass
class CompletionState:
    """One of a request's n completions."""

    request: Request
    detokenizer: IncrementalDetokenizer
    output: CompletionOutput


@dataclass
class ParentRequest:
    """A caller's request: one prompt, `n` completions, each its own engine Request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    priority: int = 0
    tenant: str | None = None
    sequences: list[CompletionState] = field(default_factory=list)
    first_token_time: float | None = None
    # One entry per prompt token (None for the first, which nothing predicts), when asked for.
    prompt_logprobs: PromptLogprobs | None = None

    def to_output(self) -> RequestOutput:
        outputs = [s.output for s in self.sequences]
        scheduled = [s.request.scheduled_time for s in self.sequences]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             finished=all(o.finished for o in outputs),
                             prompt_logprobs=self.prompt_logprobs,
                             first_scheduled_time=min((t for t in scheduled if t is not None),
                                                      default=None),
                             first_token_time=self.first_token_time)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"model: cannot load the tokenizer from {path!r}: {e}") from None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model.path)
        self.core = EngineCore(config)
        self._parents: dict[str, ParentRequest] = {}
        self._child_to_parent: dict[str, tuple[ParentRequest, CompletionState]] = {}
        self._ids = itertools.count()
        self.step_seconds = 0.0

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize(self, prompt: PromptType, field_name: str = "prompt"
                 ) -> tuple[str | None, list[int]]:
        """The prompt's text (if given as text) and its validated token ids."""
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and "prompt" in prompt:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise ValueError(f"{field_name}.prompt must be a string")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{field_name} must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple) or not ids:
                raise ValueError(f"{field_name}.prompt_token_ids must be a non-empty list")
            vocab = self.config.model.vocab_size
            for t in ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise ValueError(f"{field_name}.prompt_token_ids: token id {t!r} is out of "
                                     f"the vocabulary [0, {vocab})")
            return prompt.get("prompt"), list(ids)
        raise ValueError(f"{field_name} must be a string or a dict with 'prompt' or "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    def apply_chat_template(self, conversation: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            field_name: str = "messages") -> list[int]:
        """The token ids of a conversation rendered by the checkpoint's chat template."""
        if not conversation:
            raise ValueError(f"{field_name} must not be empty")
        if not self.tokenizer.chat_template:
            raise ValueError(f"{field_name}: the model has no chat template")
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                return_dict=False)
        except Exception as e:  # noqa: BLE001 (template errors surface as the caller's error)
            raise ValueError(f"{field_name}: the chat template rejected it: {e}") from None
        return list(ids)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      field_name: str = "prompt") -> int:
        """Validates the request against the context and the KV pool; returns max_tokens.
        With a streaming window the cache, not the sequence, is bounded: any length goes."""
        num_prompt = len(prompt_token_ids)
        if not num_prompt:
            raise ValueError(f"{field_name} must not be empty")
        kv = self.core.kv_cache
        if kv.window_blocks:
            max_tokens = sys.maxsize if params.max_tokens is None else params.max_tokens
        else:
            room = self.max_model_len - num_prompt
            if room < 1:
                raise ValueError(f"{field_name} has {num_prompt} tokens; the context limit "
                                 f"(max_model_len) is {self.max_model_len}, leaving no room "
                                 "to generate")
            max_tokens = room if params.max_tokens is None else params.max_tokens
            if max_tokens > room:
                raise ValueError(f"max_tokens ({max_tokens}) plus the prompt ({num_prompt} "
                                 f"tokens) exceeds the context limit (max_model_len) of "
                                 f"{self.max_model_len}")
        needed = kv.max_blocks_per_request(num_prompt + max_tokens)
        if needed > kv.pool.num_blocks:
            raise ValueError(f"{field_name} with max_tokens needs {needed} KV blocks but the pool "
                             f"(kv_cache_memory) holds {kv.pool.num_blocks}")
        return max_tokens

    def prepare_request(self, prompt: PromptType, params: SamplingParams,
                        request_id: str | None = None, field_name: str = "prompt"
                        ) -> tuple[ParentRequest, int]:
        """Tokenizes and validates a prompt; returns it with its max_tokens, ready for
        `add_validated`. Raises ValueError naming `field_name` and the broken limit."""
        text, ids = self.tokenize(prompt, field_name)
        max_tokens = self.check_request(ids, params, field_name)
        options = prompt if isinstance(prompt, dict) else {}
        for name in ("cache_salt", "tenant"):
            value = options.get(name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{field_name}.{name} must be a non-empty string")
        priority = options.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"{field_name}.priority must be an integer, got {priority!r}")
        return ParentRequest(request_id or self.new_request_id(), text, ids,
                             options.get("cache_salt"), priority,
                             options.get("tenant")), max_tokens

    def add_request(self, prompt: PromptType, params: SamplingParams,
                    request_id: str | None = None) -> str:
        parent, max_tokens = self.prepare_request(prompt, params, request_id)
        self.add_validated(parent, params, max_tokens)
        return parent.request_id

    def add_validated(self, parent: ParentRequest, params: SamplingParams,
                      max_tokens: int) -> None:
        if parent.request_id in self._parents:
            raise ValueError(f"request_id {parent.request_id!r} is already in use")
        self._parents[parent.request_id] = parent
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(parent.prompt_token_ids)
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = replace(params, seed=params.seed + index)
            request = Request(
                request_id=f"{parent.request_id}-{index}" if params.n > 1 else parent.request_id,
                prompt_token_ids=parent.prompt_token_ids,
                sampling_params=child_params,
                eos_token_ids=self.config.model.eos_token_ids,
                max_tokens=max_tokens,
                cache_salt=parent.cache_salt,
                priority=parent.priority,
                tenant=parent.tenant,
            )
            seq = CompletionState(request, IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, params.stop, params.min_tokens),
                CompletionOutput(index, "", [], logprobs=[] if params.logprobs is not None
                                 else None))
            parent.sequences.append(seq)
            self._child_to_parent[request.request_id] = (parent, seq)
            self.core.add_request(request)

    def abort_request(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        ids = [s.request.request_id for s in parent.sequences]
        self.core.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for child_id in ids:
            self._child_to_parent.pop(child_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> EngineStats:
        scheduler, kv = self.core.scheduler, self.core.kv_cache
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_blocks_used=kv.num_used_blocks, kv_blocks_total=kv.pool.num_blocks,
            kv_blocks_peak=kv.peak_used_blocks, num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            prefix_cache_host_hits=kv.tier_hits("host"),
            prefix_cache_disk_hits=kv.tier_hits("disk"),
            num_swapped_preemptions=scheduler.num_swapped_preemptions,
            num_recomputed_tokens=scheduler.num_recomputed_tokens,
            kv_host_blocks_used=kv.num_used_host_blocks,
            kv_host_blocks_total=kv.host_pool.num_blocks if kv.host_pool is not None else 0,
            step_seconds=self.step_seconds,
            execute_seconds=self.core.execute_seconds)

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the updated state of every request that changed."""
        start = time.perf_counter()
        step = self.core.step()
        for request_id, (position, entries) in step.prompt_logprobs.items():
            parent = self._child_to_parent[request_id][0]
            scored = parent.prompt_logprobs
            if scored is not None:  # n > 1 completions score the same prompt alike
                for offset, entry in enumerate(entries, start=position):
                    scored[offset] = self._logprob_dict(parent.prompt_token_ids[offset], entry)
        touched: dict[str, ParentRequest] = {}
        stopped: list[str] = []
        for request, lp in zip(step.updated, step.logprobs, strict=True):
            parent, seq = self._child_to_parent[request.request_id]
            new_ids = request.output_token_ids[len(seq.output.token_ids):]
            seq.output.token_ids.extend(new_ids)
            if lp is not None and seq.output.logprobs is not None:
                seq.output.logprobs.append(self._logprob_dict(new_ids[-1], lp))
            stop = seq.detokenizer.update(new_ids)
            seq.output.text = seq.detokenizer.text
            if stop is not None and not request.is_finished:
                request.stop_reason = stop
                stopped.append(request.request_id)
            touched[parent.request_id] = parent
            if parent.first_token_time is None:
                parent.first_token_time = time.monotonic()
        self.core.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        outputs = []
        for parent in touched.values():
            for seq in parent.sequences:
                if seq.request.is_finished and seq.output.finish_reason is None:
                    seq.output.finish_reason = seq.request.status.finish_reason
                    seq.output.stop_reason = seq.request.stop_reason
            out = parent.to_output()
            if out.finished:
                del self._parents[parent.request_id]
                for seq in parent.sequences:
                    self._child_to_parent.pop(seq.request.request_id, None)
            outputs.append(out)
        self.step_seconds += time.perf_counter() - start
        return outputs

    def _logprob_dict(self, sampled: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        top_ids, top_values, chosen, rank = lp
        entries = {t: Logprob(v, i + 1, self.tokenizer.decode([t]))
                   for i, (t, v) in enumerate(zip(top_ids, top_values, strict=True))}
        if sampled not in entries:
            entries[sampled] = Logprob(chosen, rank, self.tokenizer.decode([sampled]))
        return entries
