"""Executes a SchedulerOutput: one forward over every scheduled token, then sampling.

It owns the model weights, the KV block pool tensors and the per-request sampling state; it
makes no scheduling decisions.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import torch

from kvserve.attention.selector import get_attention_backend
from kvserve.attention.torch_ref import apply_rotary
from kvserve.config import EngineConfig
from kvserve.core.scheduler.output import (
    ChunkCopy,
    KVTransfers,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from kvserve.lora.batch import LoRABatch
from kvserve.lora.manager import LoRAManager
from kvserve.models.loader import load_model
from kvserve.worker.blend import SelectiveRecompute
from kvserve.worker.cpu_allocator import retain_freed_memory
from kvserve.worker.cpu_decode import CpuDecodeStack
from kvserve.worker.cuda_graphs import StepGraphs
from kvserve.worker.disk_kv import DiskKVStore, model_identity
from kvserve.worker.draft_model import DraftModel, load_draft_model
from kvserve.worker.forward_context import forward_context
from kvserve.worker.host_kv import HostKVCache
from kvserve.worker.input_batch import InputBuffers, ModelInputs, SampledIds
from kvserve.worker.kv_pool import allocate_kv_pool, blocks_in_device_memory
from kvserve.worker.pending_output import PendingOutput
from kvserve.worker.prompt_logprobs import prompt_logprobs
from kvserve.worker.sampler import Sampler, SamplingState
from kvserve.worker.speculative import Drafter, can_draft
from kvserve.worker.structured_output import GrammarMatchers, grammar_errors
from kvserve.worker.tensor_parallel import smallest_over_ranks, tp_group


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model.shard(config.tensor_parallel_size)
        self.device = config.device
        if self.device == "cpu":
            retain_freed_memory()
        self.model = load_model(mc, get_attention_backend(config.device, mc.head_dim,
                                                          mc.attn_logit_softcapping),
                                config.device, config.scheduler.max_model_len)
        spec = config.speculative
        draft_weights = (load_draft_model(config)
                         if spec is not None and spec.draft is not None else None)
        # The startup adapters before the pool is sized, so that it leaves them room, and
        # before graphs are captured, so that they are captured once.
        self.loras = LoRAManager(self.model, config.max_loras)
        for name, path in config.lora_modules.items():
            self.loras.add(name, path)
        self.lora_slots: dict[str, int] = {}  # request id -> its adapter's slot
        self.block_size = config.cache.block_size
        self.num_blocks = self._num_pool_blocks()
        self.kv_cache = allocate_kv_pool(self.model, mc, self.num_blocks, self.block_size,
                                         self.device)
        num_host = config.num_host_kv_blocks + config.num_offload_kv_blocks
        self.host_kv_cache = HostKVCache(self.kv_cache, num_host) if num_host else None
        self.disk_kv = None
        if config.num_disk_kv_blocks:
            assert config.cache.kv_offload_dir is not None
            group = tp_group()
            self.disk_kv = DiskKVStore(config.cache.kv_offload_dir,
                                       model_identity(mc, self.block_size, group.rank,
                                                      group.size),
                                       config.kv_bytes_per_block)
        sched = config.scheduler
        self.inputs = InputBuffers(sched.max_num_tokens_per_step,
                                   sched.max_num_seqs * (1 + config.num_speculative_tokens),
                                   -(-sched.max_model_len // self.block_size), self.block_size,
                                   mc.sliding_window, self.device)
        self.graphs = self._step_graphs()
        self.cpu_decode = CpuDecodeStack.build(self.model, config.enforce_eager)
        self.sampler = Sampler(config.seed, self.device,
                               GrammarMatchers(config.tokenizer_path, mc.vocab_size))
        self.states: dict[str, SamplingState] = {}
        self.drafter = Drafter(spec) if spec is not None and spec.draft is None else None
        self.draft_model = (DraftModel(config, draft_weights, self.num_blocks, self.sampler)
                            if draft_weights is not None else None)
        # Request id -> the distributions its pending drafts were drawn from (draft model,
        # requests that sample), until the step that verifies them.
        self.draft_probs: dict[str, torch.Tensor] = {}
        self.in_flight: PendingOutput | None = None  # the last step, if it sampled on device

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(sched).result()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> PendingOutput:
        """Runs the step; with async scheduling its sampled ids stay on the device when no
        request needs them on the host to sample (`Sampler.samples_on_device`), and the
        next step may be launched before they come back."""
        previous, self.in_flight = self.in_flight, None
        for request_id in sched.finished_request_ids:
            self.states.pop(request_id, None)
            self.lora_slots.pop(request_id, None)
        for request_id in (*sched.finished_request_ids, *sched.preempted_request_ids):
            self.draft_probs.pop(request_id, None)
            drafter = self.drafter or self.draft_model
            if drafter is not None:
                drafter.forget(request_id)
        for new in sched.new_requests:
            self.states[new.request_id] = self.sampler.new_state(
                new.sampling_params, new.prompt_token_ids, new.eos_token_ids,
                new.output_token_ids, new.generator_state)
            if new.lora_name is not None:
                self.lora_slots[new.request_id] = self.loras.slots[new.lora_name]
        failed = self._transfer(sched.transfers) if sched.transfers else []
        if sched.is_empty:
            return PendingOutput(ModelRunnerOutput([], [], failed_promotions=failed))
        inputs = self.inputs.prepare(sched.scheduled,
                                     previous.sampled if previous is not None else None,
                                     self.lora_slots if self.loras.adapters else None)
        lora = self.loras.batch(inputs.lora_slots) if inputs.uses_lora else None
        hidden = self._fast_forward(inputs, lora)
        if hidden is None:
            blend = (SelectiveRecompute(inputs.blends, inputs.attn_metadata, inputs.positions,
                                        lora, self.config.cache.blend_recompute_ratio)
                     if inputs.blends else None)
            with forward_context(inputs.attn_metadata, lora, blend):
                hidden = self.model(inputs.input_ids, inputs.positions)
            if blend is not None:
                hidden = blend.restore(hidden)
        scored = prompt_logprobs(self.model, hidden, inputs, self.states)
        if not inputs.sample_requests:
            return PendingOutput(ModelRunnerOutput([], [], prompt_logprobs=scored,
                                                   failed_promotions=failed))
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        requests = inputs.sample_requests
        request_ids = [s.request_id for s in requests]
        states = [self.states[i] for i in request_ids]
        if self.config.async_scheduling and all(map(Sampler.samples_on_device, states)):
            self.in_flight = PendingOutput(
                ModelRunnerOutput(request_ids, [], failed_promotions=failed,
                                  logprobs=[None] * len(requests), prompt_logprobs=scored),
                SampledIds(request_ids, self.sampler.token_ids(logits, states)), states)
            return self.in_flight
        if previous is not None:
            previous.result()  # its tokens join the states this step samples from
        new_tokens, logprobs = self._sample(logits, requests, states)
        for state, token_ids in zip(states, new_tokens, strict=True):
            state.output_token_ids += token_ids
        output = ModelRunnerOutput(
            request_ids=request_ids,
            sampled_token_ids=new_tokens,
            failed_promotions=failed,
            failed_requests=grammar_errors(request_ids, states),
            logprobs=logprobs,
            prompt_logprobs=scored,
        )
        if self.drafter is not None:
            output.draft_token_ids = self.drafter.propose(request_ids, states)
        elif self.draft_model is not None:
            start = time.perf_counter()
            drafting = [i for i, (s, st) in enumerate(zip(requests, states, strict=True))
                        if s.num_lookahead_tokens and can_draft(st)]
            if drafting:
                proposal = self.draft_model.propose(
                    [requests[i] for i in drafting], [states[i] for i in drafting],
                    [requests[i].num_lookahead_tokens for i in drafting])
                output.draft_token_ids = proposal.drafts
                self.draft_probs.update(proposal.probs)
                output.draft_seconds = time.perf_counter() - start
                output.draft_step_seconds = proposal.decode_seconds
                output.num_draft_steps = proposal.num_decode_steps
        return PendingOutput(output)

    def _sample(self, logits: torch.Tensor, requests: list[ScheduledRequest],
                states: list[SamplingState]
                ) -> tuple[list[list[int]], list[TokenLogprobs | None]]:
        """Each request's new tokens and the logprobs of a single one: request i's logits are
        its 1 + num_draft_tokens rows from the first not yet taken."""
        # Drafts proposed last step are verified now or dropped (the scheduler took none).
        draft_probs = [self.draft_probs.pop(s.request_id, None) for s in requests]
        if not any(s.num_draft_tokens for s in requests):
            sampled = self.sampler(logits, states)
            return [[t] for t in sampled.token_ids], sampled.logprobs
        first_rows = np.cumsum([0] + [1 + s.num_draft_tokens for s in requests])
        plain = [i for i, s in enumerate(requests) if not s.num_draft_tokens]
        drafted = [i for i, s in enumerate(requests) if s.num_draft_tokens]
        new_tokens: list[list[int]] = [[] for _ in requests]
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if plain:
            sampled = self.sampler(logits[first_rows[plain]], [states[i] for i in plain])
            for i, token_id, lp in zip(plain, sampled.token_ids, sampled.logprobs, strict=True):
                new_tokens[i], logprobs[i] = [token_id], lp
        rows = np.concatenate([np.arange(first_rows[i], first_rows[i + 1]) for i in drafted])
        verified = self.sampler.verify(
            logits[rows], [states[i] for i in drafted],
            [requests[i].token_ids[1:] for i in drafted], [draft_probs[i] for i in drafted])
        for i, token_ids in zip(drafted, verified, strict=True):
            new_tokens[i] = token_ids
        return new_tokens, logprobs

    def add_lora(self, name: str, path: str) -> None:
        self.loras.add(name, path)
        self._recapture_graphs()

    def remove_lora(self, name: str) -> None:
        self.loras.remove(name)
        self._recapture_graphs()

    def _recapture_graphs(self) -> None:
        """Graphs hold the adapters' packed weights and slot count: a change of adapters
        captures them again."""
        if self.graphs is not None:
            self.graphs = None  # its memory goes back before the new graphs take theirs
            self.graphs = self._step_graphs()

    def _transfer(self, transfers: KVTransfers) -> list[bytes]:
        """Makes the step's KV copies in the order `KVTransfers` gives; returns the hashes of
        disk blocks that could not be read."""
        for copy in transfers.chunks:
            self._copy_chunk(copy)
        for block_ids, num_positions in transfers.shift:
            self._shift_keys(block_ids, num_positions)
        host, disk = self.host_kv_cache, self.disk_kv
        if host is None:
            return []
        if transfers.spill or transfers.promote:
            host.wait()
        if disk is not None:
            for host_block, block_hash in transfers.spill:
                disk.write(block_hash, host.block(host_block))
            for block_hash in transfers.delete:
                disk.delete(block_hash)
        host.to_host(transfers.to_host)
        failed = [block_hash for block_hash, host_block in transfers.promote
                  if disk is None or not disk.read_into(block_hash, host.block(host_block))]
        host.to_device(transfers.to_device)
        return failed

    def swap_seconds_per_block(self) -> float:
        """The measured cost of moving a block to host memory and back, per block and way
        (0 without swap space)."""
        return self.host_kv_cache.seconds_per_block() if self.host_kv_cache is not None else 0.0

    def disk_blocks(self) -> list[bytes]:
        """The hashes of the blocks the disk tier holds from earlier runs."""
        return self.disk_kv.scan() if self.disk_kv is not None else []

    def delete_disk_blocks(self, block_hashes: list[bytes]) -> None:
        """Deletes these blocks' files (under tensor parallelism: parts whose block another
        rank lacks)."""
        for block_hash in block_hashes:
            self.disk_kv.delete(block_hash)

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the given device blocks in host memory, block-major as host blocks lie:
        [blocks, layers, K/V, kv heads, block_size, head_dim]."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        return self.kv_cache.index_select(3, ids).permute(3, 0, 1, 2, 4, 5).cpu()

    def write_host_blocks(self, host_blocks: list[int], kv: torch.Tensor) -> None:
        """Fills host blocks with KV from `read_kv_blocks` (of another engine)."""
        assert self.host_kv_cache is not None
        self.host_kv_cache.wait()
        self.host_kv_cache.blocks[torch.tensor(host_blocks, dtype=torch.long)] = kv.to(
            self.host_kv_cache.blocks.dtype)

    def generator_state(self, request_id: str) -> bytes | None:
        """The state of a request's seeded generator, for it to resume elsewhere."""
        state = self.states.get(request_id)
        if state is None or state.generator is None:
            return None
        return state.generator.get_state().numpy().tobytes()

    def _shift_keys(self, block_ids: list[int], num_positions: int) -> None:
        """Moves the cached keys of `block_ids` `num_positions` back: rotary embeddings turn
        each key by its position, so turning it by -num_positions re-positions it exactly
        (up to rounding, which float32 keeps negligible over a window's shifts)."""
        ids = torch.tensor(block_ids, device=self.kv_cache.device)
        keys = self.kv_cache[:, 0]  # [layers, kv heads, blocks, block_size, head_dim]
        rotation = self.model.key_turns(-num_positions)[:, None, None, None]
        keys.index_copy_(2, ids, apply_rotary(keys.index_select(2, ids), rotation))

    def _copy_chunk(self, copy: ChunkCopy) -> None:
        """Copies a chunk's KV (every layer) to its place in a blended prompt's blocks,
        turning its keys by the chunk's new first position: rotary embeddings compose, so a
        key computed at position i becomes the key at position + i."""
        size = self.block_size
        src = np.arange(copy.num_tokens)
        dst = src + copy.position
        src_slots = np.asarray(copy.src_blocks)[src // size] * size + src % size
        dst_slots = np.asarray(copy.dst_blocks)[dst // size] * size + dst % size
        device = self.kv_cache.device
        src_t = torch.from_numpy(src_slots).to(device)
        dst_t = torch.from_numpy(dst_slots).to(device)
        layers, _, heads, _, _, head_dim = self.kv_cache.shape
        flat = self.kv_cache.view(layers, 2, heads, -1, head_dim)
        rotation = self.model.key_turns(copy.position)[:, None, None]
        flat[:, 0].index_copy_(2, dst_t, apply_rotary(flat[:, 0].index_select(2, src_t),
                                                      rotation))
        flat[:, 1].index_copy_(2, dst_t, flat[:, 1].index_select(2, src_t))

    def _fast_forward(self, inputs: ModelInputs, lora: LoRABatch | None
                      ) -> torch.Tensor | None:
        """The step's hidden states from a CUDA graph or (decode-only steps without
        adapters) the CPU decode stack; None for a step to run eagerly."""
        if self.graphs is not None:
            return self.graphs.run(inputs)
        if lora is None and self.cpu_decode is not None:
            return self.cpu_decode.run(inputs)
        return None

    def _num_pool_blocks(self) -> int:
        """The pool's size: the config's, or on a GPU what the loaded weights leave of
        gpu_memory_utilization (the same on every tensor-parallel rank: the least)."""
        if not self.config.sized_by_device_memory:
            return self.config.num_kv_blocks
        gc.collect()  # an engine dropped before this one holds no memory
        torch.cuda.empty_cache()  # nor do the loader's freed blocks
        free, total = torch.cuda.mem_get_info(self.device)
        return smallest_over_ranks(blocks_in_device_memory(self.config, free, total),
                                   self.device)

    def _step_graphs(self) -> StepGraphs | None:
        """Steps replay CUDA graphs where the config lets them (`replays_graphs`); graphs need
        a backend that takes padding rows (the Triton one). Elsewhere, the padded path runs
        eagerly."""
        backend = self.model.layers[0].self_attn.backend
        if not self.config.replays_graphs or not backend.takes_padding_rows:
            return None
        return StepGraphs(self.model, self.inputs, self.config.scheduler.max_num_seqs,
                          self.config.graph_tokens,
                          self.loras.num_slots if self.loras.adapters else 0,
                          capture=torch.device(self.device).type == "cuda")
