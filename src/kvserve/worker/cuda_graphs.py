"""Steps replayed from CUDA graphs.

A step launches a few hundred small kernels; issued one by one from Python that costs more
than the GPU's work (on an H100, a step with a prefill chunk took about 30 ms eagerly,
whatever the chunk's size). The forward is captured once per padded shape over the runner's
persistent input buffers, and a step replays the smallest graph that holds it:
- decode-only steps by batch size (1, 2, 4, 8, then steps of 8 up to `max_num_seqs`), with
  split-K decode attention; padding rows carry slot -1 (no KV write) and length 0 (zero
  attention), so they touch nothing;
- steps with prefill chunks by token count (16, 32, 64, then steps of 64 up to 512, then of
  128 up to `max_graph_tokens`): the decode launch covers as many sequences as the step
  could hold and reads the decode count from the device, splitting the decodes as their
  number allows, and the varlen launch, whose grid depends only on the rows and the
  sequence buffers, takes the chunks; padding rows write no KV, and padding sequences have
  no rows.
While LoRA adapters are loaded, every graph runs their kernels over the rows' adapter slots
(a row of the base model has none), so steps with and without adapters replay the same
graphs; they are captured again when adapters come or go.
Larger steps and steps with blended prompts run eagerly.

Without `capture` (CPU tests) the same padded forwards run eagerly, so everything but the
capture itself is exercised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from tqdm import tqdm

from kvserve.lora.batch import LoRABatch
from kvserve.worker.forward_context import forward_context
from kvserve.worker.input_batch import InputBuffers, ModelInputs

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


def graph_token_sizes(max_tokens: int) -> list[int]:
    """Padded token counts of steps with chunks: up to 1/8 of padding from 128 tokens on."""
    sizes = [s for s in (16, 32) if s < max_tokens]
    sizes += [*range(64, min(max_tokens, 513), 64), *range(640, max_tokens, 128)]
    return sorted({*(s for s in sizes if s < max_tokens), max_tokens})


class PaddedForwards:
    """One forward per padded size, captured in a graph or (without capture) run eagerly.
    `pad(inputs, size)` sets the buffers' padding for a step (`None`: a step of nothing) and
    returns the padded inputs; with `lora_slots` adapter slots, those give each row's."""

    def __init__(self, model: torch.nn.Module, sizes: list[int],
                 pad: Callable[[ModelInputs | None, int], ModelInputs],
                 lora_slots: int = 0) -> None:
        self.model, self.sizes, self.pad = model, sizes, pad
        self.lora_slots = lora_slots
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def padded_size(self, rows: int) -> int | None:
        """The smallest size that holds `rows`; None if none does."""
        return next((s for s in self.sizes if s >= rows), None)

    def run(self, inputs: ModelInputs, size: int) -> torch.Tensor:
        """Hidden states of the step's rows, from the forward of `size` rows."""
        padded = self.pad(inputs, size)
        rows = inputs.input_ids.shape[0]
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:rows]
        return self._forward(padded)[:rows]

    def _forward(self, padded: ModelInputs) -> torch.Tensor:
        # A LoRABatch of its own each time: a captured one must not reuse what an earlier
        # forward computed from the slots.
        lora = (LoRABatch(padded.lora_slots, self.lora_slots)
                if padded.lora_slots is not None else None)
        with forward_context(padded.attn_metadata, lora):
            return self.model(padded.input_ids, padded.positions)

    def capture(self, pool: tuple[int, int] | None, desc: str) -> tuple[int, int] | None:
        """Captures every size, the largest first, into `pool` (None: a new one): the smaller
        graphs then fit in the memory the first one took. Returns the pool."""
        for size in tqdm(sorted(self.sizes, reverse=True), desc=desc, unit=" graphs"):
            padded = self.pad(None, size)
            self._forward(padded)  # warm-up: compile, autotune
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(padded)
            pool = graph.pool()
            self.graphs[size] = graph
        return pool


class StepGraphs:
    def __init__(self, model: torch.nn.Module, buffers: InputBuffers, max_num_seqs: int,
                 max_graph_tokens: int, lora_slots: int = 0, capture: bool = True) -> None:
        """`max_graph_tokens`: the largest step with chunks that replays a graph (0: such
        steps run eagerly); `lora_slots`: the loaded adapters' slots (0: none)."""
        self.lora_slots = lora_slots
        lora = lora_slots > 0
        self.decodes = PaddedForwards(
            model, graph_batch_sizes(max_num_seqs),
            lambda inputs, size: buffers.padded_decode(
                inputs.attn_metadata.num_decodes if inputs is not None else 0, size, lora),
            lora_slots)
        self.mixed = PaddedForwards(
            model, graph_token_sizes(max_graph_tokens) if max_graph_tokens else [],
            lambda inputs, size: buffers.padded_mixed(
                len(inputs.scheduled) if inputs is not None else 0,
                inputs.attn_metadata.num_decodes if inputs is not None else 0,
                inputs.input_ids.shape[0] if inputs is not None else 0, size, lora),
            lora_slots)
        if capture:
            self._capture_all()

    def forwards_for(self, inputs: ModelInputs) -> tuple[PaddedForwards, int] | None:
        """The forwards that run this step and their size; None if it must run eagerly."""
        meta = inputs.attn_metadata
        if (inputs.lora_slots is not None) != (self.lora_slots > 0):
            return None  # captured for another set of adapters: the runner recaptures
        if not meta.prefills:
            forwards, rows = self.decodes, meta.num_decodes
        elif inputs.blends:
            return None
        else:
            forwards, rows = self.mixed, inputs.input_ids.shape[0]
        size = forwards.padded_size(rows)
        return None if size is None else (forwards, size)

    def run(self, inputs: ModelInputs) -> torch.Tensor | None:
        """The step's hidden states from its graph; None if it must run eagerly."""
        found = self.forwards_for(inputs)
        return None if found is None else found[0].run(inputs, found[1])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # loading's cached blocks would come back during capture
        free_before = torch.cuda.mem_get_info()[0]
        # Steps with chunks first: their activations are the larger.
        pool = self.mixed.capture(None, "capturing CUDA graphs of steps with chunks")
        self.decodes.capture(pool, "capturing CUDA graphs of decode steps")
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info("captured %d CUDA graphs for decode batches of %d-%d rows and %d for steps "
                    "with chunks of up to %d tokens, using %.0f MiB", len(self.decodes.graphs),
                    self.decodes.sizes[0], self.decodes.sizes[-1], len(self.mixed.graphs),
                    max(self.mixed.sizes, default=0), used / 2**20)
