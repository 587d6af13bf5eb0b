"""Decode-only steps replayed from CUDA graphs.

A decode step launches a few hundred small kernels; issued one by one from Python that
costs more than the GPU's work. The forward is captured once per padded batch size (1, 2,
4, 8, then steps of 8 up to `max_num_seqs`) over the runner's persistent input buffers, and
a step of B decodes replays the smallest graph of at least B rows. Padding rows carry slot
-1 (no KV write) and length 0 (zero attention), so they touch nothing. Steps with a prefill
chunk, or more decodes than the largest graph, run eagerly.

Without `capture` (CPU tests) the same padded forward runs eagerly, so everything but the
capture itself is exercised.
"""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from kvserve.worker.forward_context import forward_context
from kvserve.worker.input_batch import InputBuffers, ModelInputs

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, buffers: InputBuffers, max_num_seqs: int,
                 capture: bool = True) -> None:
        self.model, self.buffers = model, buffers
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def padded_size(self, inputs: ModelInputs) -> int | None:
        """The graph batch size for this step, or None if it must run eagerly."""
        meta = inputs.attn_metadata
        num_seqs = meta.num_decodes
        if meta.prefills or num_seqs > self.sizes[-1]:
            return None
        return next(s for s in self.sizes if s >= num_seqs)

    def run(self, inputs: ModelInputs, batch_size: int) -> torch.Tensor:
        """Hidden states of the step's decode rows, from the graph of `batch_size` rows."""
        num_seqs = inputs.attn_metadata.num_decodes
        padded = self.buffers.padded_decode(num_seqs, batch_size)
        if batch_size in self.graphs:
            self.graphs[batch_size].replay()
            return self.outputs[batch_size][:num_seqs]
        with forward_context(padded.attn_metadata):
            return self.model(padded.input_ids, padded.positions)[:num_seqs]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # loading's cached blocks would come back during capture
        free_before = torch.cuda.mem_get_info()[0]
        pool = None
        # Largest first: the smaller graphs then fit in the memory pool the first one made.
        for size in tqdm(sorted(self.sizes, reverse=True), desc="capturing CUDA graphs",
                         unit=" graphs"):
            padded = self.buffers.padded_decode(0, size)
            with forward_context(padded.attn_metadata):
                self.model(padded.input_ids, padded.positions)  # warm-up: compile, autotune
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self.model(padded.input_ids, padded.positions)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info("captured %d CUDA graphs for decode batches of %d-%d rows, using %.0f MiB",
                    len(self.graphs), self.sizes[0], self.sizes[-1], used / 2**20)
