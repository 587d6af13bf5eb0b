"""Validated requests in, RequestOutputs out: n-way fan-out, detokenization and stop strings
around an EngineCore."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from kvserve.config import EngineConfig
from kvserve.core.scheduler.output import StepShape, TokenLogprobs
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.engine_core import CoreStep, EngineCore
from kvserve.engine.input_processor import (
    CompletionState,
    InputProcessor,
    ParentRequest,
    PromptType,
    RequestLimits,
)
from kvserve.models.loader import load_tokenizer
from kvserve.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class MigratedRequest:
    """A request detached from one engine to go on in another: the caller's request with its
    completions so far (engine Requests, detokenizers and outputs), and the KV of each
    unfinished completion's computed blocks from its `first_blocks` entry on, by the
    completion's request id; the earlier blocks were sent ahead while it still ran."""

    parent: ParentRequest
    first_blocks: dict[str, int]
    kv: dict[str, torch.Tensor]


def engine_tokenizer(config: EngineConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer, or the `tokenizer` option's, which must fit the model's
    vocabulary."""
    if config.tokenizer is None:
        return load_tokenizer(config.model.path, config.chat_template)
    tokenizer = load_tokenizer(config.tokenizer, config.chat_template, "tokenizer")
    if len(tokenizer) > config.model.vocab_size:
        raise ValueError(f"tokenizer: its {len(tokenizer)} tokens do not fit the model's "
                         f"vocabulary of {config.model.vocab_size}")
    return tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = engine_tokenizer(config)
        self.core = EngineCore(config)
        self.inputs = InputProcessor(self.tokenizer, self.request_limits(),
                                     config.sampling_defaults)
        self.lora_names: set[str] = set()
        self._lora_loads: dict[str, int] = {}  # name -> times loaded, for the KV's hashes
        for name in config.lora_modules:  # the runner loaded them as it started
            self._register_lora(name)
        self._parents: dict[str, ParentRequest] = {}
        self._child_to_parent: dict[str, tuple[ParentRequest, CompletionState]] = {}
        self.step_seconds = 0.0
        self._settled: list[RequestOutput] = []  # of a step taken in early, not yet returned
        # Each step's work and seconds while tracing (see `trace_steps`), for fitting a
        # simulator's step cost to the engine as it serves.
        self._step_trace: list[tuple[StepShape, float]] | None = None
        # When the last step ended with more to run at once (the serving loop steps again
        # without waiting), else None.
        self._busy_end: float | None = None

    def trace_steps(self, on: bool) -> list[tuple[StepShape, float]]:
        """Returns the steps traced so far, and starts a new trace if `on` (else stops). A
        step's seconds are its period: its own time, and, where the step before left work
        to run at once, the serving loop's time since that one ended (handing outputs out,
        taking requests in), which every step of a busy engine pays too."""
        traced, self._step_trace = self._step_trace or [], [] if on else None
        return traced

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def request_limits(self) -> RequestLimits:
        kv = self.core.kv_cache
        return RequestLimits(self.max_model_len, self.config.model.vocab_size, kv.block_size,
                             kv.pool.num_blocks,
                             kv.sink_blocks + kv.window_blocks if kv.window_blocks else 0,
                             blending=kv.enable_prefix_caching)

    def add_request(self, prompt: PromptType, params: SamplingParams,
                    request_id: str | None = None) -> str:
        parent, max_tokens = self.inputs.prepare_request(prompt, params, request_id)
        self.add_validated(parent, params, max_tokens)
        return parent.request_id

    def add_validated(self, parent: ParentRequest, params: SamplingParams,
                      max_tokens: int) -> None:
        child_ids = ([f"{parent.request_id}-{index}" for index in range(params.n)]
                     if params.n > 1 else [parent.request_id])
        # Checked before anything is added: one child refused after another was queued
        # would leave that one running for no caller.
        for request_id in (parent.request_id, *child_ids):
            if request_id in self._parents or request_id in self._child_to_parent:
                raise ValueError(f"request_id {request_id!r} is already in use")
        if parent.lora_name is not None and parent.lora_name not in self.lora_names:
            raise ValueError(f"lora_name {parent.lora_name!r} is not a loaded adapter "
                             f"(loaded: {sorted(self.lora_names)})")
        self._parents[parent.request_id] = parent
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(parent.prompt_token_ids)
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                # Each child its own seed, wrapped to stay the 64-bit integer seeds are.
                seed = (params.seed + index + 2**63) % 2**64 - 2**63
                child_params = replace(params, seed=seed)
            request = Request(
                request_id=child_ids[index],
                prompt_token_ids=parent.prompt_token_ids,
                sampling_params=child_params,
                eos_token_ids=self.config.model.eos_token_ids,
                max_tokens=max_tokens,
                cache_salt=parent.cache_salt,
                lora_name=parent.lora_name,
                lora_load=self._lora_loads.get(parent.lora_name, 0),
                segment_lens=parent.segment_lens,
                priority=parent.priority,
                tenant=parent.tenant,
            )
            seq = CompletionState(request, IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, params.stop, params.min_tokens,
                params.include_stop_str_in_output),
                CompletionOutput(index, "", [], logprobs=[] if params.logprobs is not None
                                 else None))
            parent.sequences.append(seq)
            self._child_to_parent[request.request_id] = (parent, seq)
            self.core.add_request(request)

    def add_lora(self, name: str, path: str) -> None:
        """Loads a PEFT LoRA adapter that requests then pick by `lora_name`."""
        self.core.runner.add_lora(name, path)
        self._register_lora(name)

    def _register_lora(self, name: str) -> None:
        self.lora_names.add(name)
        self._lora_loads[name] = self._lora_loads.get(name, 0) + 1

    def remove_lora(self, name: str) -> None:
        """Unloads an adapter no unfinished request runs with, freeing its slot."""
        if name not in self.lora_names:
            raise ValueError(f"lora_name {name!r} is not a loaded adapter "
                           f"(loaded: {sorted(self.lora_names)})")
        users = sum(1 for r in self.core.scheduler.requests.values() if r.lora_name == name)
        if users:
            raise ValueError(f"lora_name {name!r} is in use by {users} unfinished requests")
        self.core.runner.remove_lora(name)
        self.lora_names.discard(name)

    def abort_request(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        ids = [s.request.request_id for s in parent.sequences]
        self.core.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for child_id in ids:
            self._child_to_parent.pop(child_id, None)

    def export_kv(self, request_id: str, first_blocks: dict[str, int] | None = None,
                  full_only: bool = False) -> dict[str, torch.Tensor] | None:
        """A copy of the KV of a request's unfinished completions (n > 1 has several), by
        their request ids: each one's computed blocks from its `first_blocks` entry on (with
        `full_only`, only the full ones, which no step writes again; none in a streaming
        window, which moves them as it slides). None when the request cannot migrate: one of
        its unfinished completions is not running."""
        self._settle()
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        requests = self._unfinished(parent)
        if not requests or any(r.status != RequestStatus.RUNNING for r in requests):
            return None
        kv, first_blocks = self.core.kv_cache, first_blocks or {}
        exported = {}
        for request in requests:
            blocks = kv.computed_block_ids(request)
            if full_only:
                blocks = [] if kv.window_blocks else \
                    blocks[:request.num_cached_tokens // kv.block_size]
            first = first_blocks.get(request.request_id, 0)
            exported[request.request_id] = self.core.runner.read_kv_blocks(blocks[first:])
        return exported

    @staticmethod
    def _unfinished(parent: ParentRequest) -> list[Request]:
        return [seq.request for seq in parent.sequences if not seq.request.is_finished]

    def receive_kv(self, kv: dict[str, torch.Tensor]) -> dict[str, list[int]]:
        """Host blocks holding the KV sent ahead of a migrating request's completions; a
        completion's is left out when it does not fit in the swap space (it then brings all
        of its KV when it comes)."""
        received = {}
        for child_id, blocks in kv.items():
            host_blocks = self._to_host(blocks)
            if host_blocks:
                received[child_id] = host_blocks
        return received

    def _to_host(self, kv: torch.Tensor) -> list[int] | None:
        """Swap-space blocks now holding the KV blocks `kv` (none for none); None when too
        few are free."""
        if not len(kv):
            return []
        host_blocks = self.core.kv_cache.allocate_host_blocks(len(kv))
        if host_blocks is not None:
            self.core.runner.write_host_blocks(host_blocks, kv)
        return host_blocks

    def detach(self, request_id: str, sent_ahead: dict[str, int]) -> MigratedRequest | None:
        """Stops a running request here and returns all it needs to go on in another engine,
        each unfinished completion's KV after the `sent_ahead` blocks included; None when it
        cannot migrate (see `export_kv`), or a completion has fewer blocks than were sent
        ahead (preempted since)."""
        kv = self.export_kv(request_id, sent_ahead)
        if kv is None:
            return None
        parent = self._parents[request_id]
        requests = self._unfinished(parent)
        num_blocks = self.core.kv_cache.num_blocks_for
        if any(num_blocks(r.num_cached_tokens) < sent_ahead.get(r.request_id, 0)
               for r in requests):
            return None
        for request in requests:
            request.generator_state = self.core.runner.generator_state(request.request_id)
            self.core.scheduler.detach_request(request.request_id)
        del self._parents[request_id]
        for seq in parent.sequences:
            self._child_to_parent.pop(seq.request.request_id, None)
        return MigratedRequest(parent, {r.request_id: sent_ahead.get(r.request_id, 0)
                                        for r in requests}, kv)

    def attach(self, migrated: MigratedRequest, received: dict[str, list[int]]) -> None:
        """Goes on with a request detached from another engine; `received` holds, by
        completion, the host blocks of the KV it sent ahead. Each completion's KV is swapped
        in when it is scheduled, or recomputed when the swap space cannot take it."""
        parent = migrated.parent
        if parent.request_id in self._parents:
            raise ValueError(f"request_id {parent.request_id!r} is already in use")
        kv = self.core.kv_cache
        for child_id in received.keys() - migrated.kv.keys():  # finished before it left
            kv.free_host_blocks(received[child_id])
        self._parents[parent.request_id] = parent
        for seq in parent.sequences:
            seq.detokenizer.attach(self.tokenizer)
            self._child_to_parent[seq.request.request_id] = (parent, seq)
        for request in self._unfinished(parent):
            sent = received.get(request.request_id, [])
            tail = None
            if len(sent) == migrated.first_blocks[request.request_id]:
                tail = self._to_host(migrated.kv[request.request_id])
            if tail is None:  # recomputed there instead
                kv.free_host_blocks(sent)
            self.core.scheduler.attach_request(request, None if tail is None else sent + tail)

    def has_unfinished_requests(self) -> bool:
        return bool(self._settled) or self.core.has_unfinished_requests()

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
            execute_seconds=self.core.execute_seconds,
            num_draft_tokens=scheduler.num_draft_tokens,
            num_accepted_tokens=scheduler.num_accepted_tokens,
            num_blended_prompts=scheduler.num_blended_prompts,
            blend_chunk_hit_tokens=scheduler.num_chunk_hit_tokens,
            blend_chunk_fill_tokens=scheduler.num_chunk_fill_tokens)

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the updated state of every request that changed."""
        start = time.perf_counter()
        outputs, self._settled = self._settled, []
        step = self.core.step()
        outputs += self._outputs(step)
        end = time.perf_counter()
        self.step_seconds += end - start
        if self._step_trace is not None and step.shape.num_tokens:
            since = start if self._busy_end is None else self._busy_end
            self._step_trace.append((step.shape, end - since))
        self._busy_end = (end if self.has_unfinished_requests() and not self.core.idle
                          else None)
        return outputs

    def _settle(self) -> None:
        """Takes in the step in flight under async scheduling; its outputs come with the
        next `step()`."""
        step = self.core.settle()
        if step is not None:
            self._settled += self._outputs(step)

    def _outputs(self, step: CoreStep) -> list[RequestOutput]:
        """Detokenizes a step's new tokens and applies stop strings."""
        for request_id, (position, entries) in step.prompt_logprobs.items():
            if request_id not in self._child_to_parent:
                continue  # aborted while its step was in flight
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
            # Only a stop token has finished it as stopped yet (stop strings are found here).
            stop = seq.detokenizer.update(
                new_ids, request.status == RequestStatus.FINISHED_STOPPED)
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
                    seq.output.error = seq.request.error
            if parent.final_only and not parent.finished:
                continue
            out = parent.to_output()
            if out.finished:
                del self._parents[parent.request_id]
                for seq in parent.sequences:
                    self._child_to_parent.pop(seq.request.request_id, None)
            outputs.append(out)
        return outputs

    def _logprob_dict(self, sampled: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        top_ids, top_values, chosen, rank = lp
        entries = {t: Logprob(v, i + 1, self.tokenizer.decode([t]))
                   for i, (t, v) in enumerate(zip(top_ids, top_values, strict=True))}
        if sampled not in entries:
            entries[sampled] = Logprob(chosen, rank, self.tokenizer.decode([sampled]))
        return entries
