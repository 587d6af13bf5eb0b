"""A small model with the same tokenizer that drafts tokens for a larger one (speculative
decoding with a draft model).

It keeps a KV pool of its own with the target's block ids, so one block table serves both.
Every step it runs over the very tokens the target's step computed (`mirror`), which keeps
its KV in step with the target's through chunked prefill, prefix-cache hits and recompute.
After the target has sampled, `propose` runs k greedy decode steps from each request's new
last token, writing its KV into the slots the scheduler allocated ahead for them; the next
mirror rewrites those slots with the tokens that were kept. Its drafts are a function of the
context, which is what the sampler's rejection sampling needs to keep the target's
distribution.
"""

from __future__ import annotations

import torch

from kvserve.attention.selector import get_attention_backend
from kvserve.config import EngineConfig
from kvserve.core.scheduler.output import ScheduledRequest
from kvserve.cpp_extension import cpu_kernels
from kvserve.models.loader import load_model
from kvserve.worker.cpu_decode import CpuDecodeStack
from kvserve.worker.forward_context import forward_context
from kvserve.worker.input_batch import InputBuffers, ModelInputs


class DraftModel:
    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        assert config.speculative is not None and config.speculative.draft is not None
        cfg = config.speculative.draft
        self.device = config.device
        self.model = load_model(cfg, get_attention_backend(config.device, cfg.head_dim),
                                config.device)
        block_size = config.cache.block_size
        self.kv_cache = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, num_blocks,
                                    block_size, cfg.head_dim, dtype=cfg.dtype,
                                    device=config.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_cache = self.kv_cache[i]
        sched = config.scheduler
        self.max_model_len = sched.max_model_len
        max_blocks = -(-(sched.max_model_len + sched.draft_lookahead) // block_size)
        self.inputs = InputBuffers(sched.max_num_seqs, sched.max_num_seqs, max_blocks,
                                   block_size, cfg.sliding_window, config.device)
        kernels = cpu_kernels()
        self.stack = (CpuDecodeStack(self.model, kernels)
                      if kernels is not None and not config.enforce_eager
                      and CpuDecodeStack.covers(self.model) else None)

    def _hidden(self, inputs: ModelInputs) -> torch.Tensor:
        hidden = self.stack.run(inputs) if self.stack is not None else None
        if hidden is None:
            with forward_context(inputs.attn_metadata):
                hidden = self.model(inputs.input_ids, inputs.positions)
        return hidden

    def mirror(self, inputs: ModelInputs) -> None:
        """Writes the draft's KV for the tokens of the target's step."""
        self._hidden(inputs)

    def propose(self, requests: list[ScheduledRequest], token_ids: list[list[int]],
                num_drafts: list[int]) -> tuple[dict[str, list[int]], int]:
        """Up to `num_drafts[i]` greedy drafts after `token_ids[i]`, the tokens request i's
        step ended with (its last has no KV yet), within the slots its block table holds.
        Returns request id -> drafts, and the number of draft decode steps run."""
        rows = []
        for s, tokens, count in zip(requests, token_ids, num_drafts, strict=True):
            position = s.num_computed_tokens + len(s.token_ids) - s.num_draft_tokens \
                + len(tokens) - 1
            count = min(count, len(s.block_ids) * self.inputs.block_size - position,
                        self.max_model_len - position - 1)
            if count > 0:
                rows.append((s, position, count, [tokens[-1]]))
        num_steps = max((count for _, _, count, _ in rows), default=0)
        for step in range(num_steps):
            active = [row for row in rows if row[2] > step]
            inputs = self.inputs.prepare([
                ScheduledRequest(s.request_id, [drafts[-1]], position + step, s.block_ids, True)
                for s, position, _, drafts in active])
            logits = self.model.compute_logits(self._hidden(inputs)[inputs.sample_rows])
            for (_, _, _, drafts), token_id in zip(active, logits.argmax(dim=-1).tolist(),
                                                   strict=True):
                drafts.append(token_id)
        return {s.request_id: drafts[1:] for s, _, _, drafts in rows}, num_steps
