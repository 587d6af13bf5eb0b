"""Turns a SchedulerOutput into the flat tensors of one forward pass, through buffers that
live as long as the runner.

Layout: every one-token request (a decode) first, then each multi-token chunk in turn, so
attention can batch the decodes. A decode with speculative drafts becomes one decode row per
token, each attending to the rows before it: verifying drafts costs what a batch of decodes
does, on every decode path (CUDA graphs, the CPU decode stack).
The buffers are allocated once, sized by the step limits. Each step fills their host side
with numpy (no per-token Python work) and copies what it used to the device once, without
waiting (from pinned memory on CUDA): nothing in a step waits for the device until the
sampled ids come back. Fixed device addresses are also what a captured CUDA graph replays
over.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import chain

import numpy as np
import torch

from kvserve.attention.backend import AttentionMetadata, PrefillChunk
from kvserve.core.scheduler.output import PENDING_TOKEN, ScheduledRequest
from kvserve.worker.blend import BlendedPrompt


@dataclass(slots=True, frozen=True)
class SampledIds:
    """A step's sampled tokens as the device holds them: one per sampling request, in the
    order of `request_ids`."""

    request_ids: list[str]
    token_ids: torch.Tensor


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # flat rows of each sampling request's last token (and drafts)
    sample_requests: list[ScheduledRequest]  # each has 1 + num_draft_tokens sample rows
    scheduled: list[ScheduledRequest]  # in row order: decodes (drafts split), then chunks
    query_start_host: np.ndarray  # first row of each of `scheduled`, then the row count
    blends: list[BlendedPrompt] = field(default_factory=list)  # its blended prompts
    # [rows] each row's LoRA adapter slot (-1: the base model), given while adapters are
    # loaded; `uses_lora`: whether any of prepare()'s rows has one
    lora_slots: torch.Tensor | None = None
    uses_lora: bool = False


class StagedTensor:
    """An int64 tensor on the device and its host staging twin, seen by numpy as `host`."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        staging = torch.zeros(shape, dtype=torch.int64, pin_memory=on_cuda)
        self.host = staging.numpy()
        self.staging = staging
        self.device = torch.zeros(shape, dtype=torch.int64, device=device) if on_cuda \
            else staging

    def upload(self, rows: int, cols: int | None = None, first: int = 0) -> torch.Tensor:
        """Copies rows `first` to `rows` (x `cols`) to the device; returns the device view
        of the leading `rows`."""
        index = (slice(rows),) if cols is None else (slice(rows), slice(cols))
        if self.device is not self.staging:
            copied = (slice(first, rows), *index[1:])
            self.device[copied].copy_(self.staging[copied], non_blocking=True)
        return self.device[index]


class InputBuffers:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, sliding_window: int | None, device: str) -> None:
        """`max_num_seqs` counts rows: a decode's drafts take one each."""
        dev = torch.device(device)
        self.block_size, self.sliding_window = block_size, sliding_window
        self.max_num_tokens = max_num_tokens
        self.max_seq_len = max_blocks_per_seq * block_size
        self.input_ids = StagedTensor((max_num_tokens,), dev)
        self.positions = StagedTensor((max_num_tokens,), dev)
        self.slot_mapping = StagedTensor((max_num_tokens,), dev)
        self.query_start_loc = StagedTensor((max_num_seqs + 1,), dev)
        self.seq_lens = StagedTensor((max_num_seqs,), dev)
        self.sample_rows = StagedTensor((max_num_seqs,), dev)
        # Rows whose token the previous step samples, and where its output holds it.
        self.pending_rows = StagedTensor((max_num_seqs,), dev)
        self.pending_sources = StagedTensor((max_num_seqs,), dev)
        self.lora_slots = StagedTensor((max_num_tokens,), dev)
        # Zeros at first, later stale entries of earlier steps: always valid block ids.
        self.block_tables = StagedTensor((max_num_seqs, max_blocks_per_seq), dev)
        self.decode_count = StagedTensor((1,), dev)  # a padded mixed step's, for its graph
        # Marks where the device stream took the last uploads: host staging is rewritten only
        # once they are done (a step that samples nothing lets the host run ahead).
        self.uploaded = torch.cuda.Event() if dev.type == "cuda" else None

    def _wait_for_uploads(self) -> None:
        if self.uploaded is not None and not self.uploaded.query():
            self.uploaded.synchronize()

    def _mark_uploads(self) -> None:
        if self.uploaded is not None:
            self.uploaded.record()

    def prepare(self, scheduled: list[ScheduledRequest], previous: SampledIds | None = None,
                lora_slot_of: dict[str, int] | None = None) -> ModelInputs:
        """`previous`: the output of the step in flight, which holds the `PENDING_TOKEN`s;
        `lora_slot_of`, while adapters are loaded: the adapter slot of each request that
        runs one."""
        self._wait_for_uploads()
        decodes = [s for s in scheduled if len(s.token_ids) == 1]
        drafted = [s for s in scheduled if s.num_draft_tokens]
        chunks = [s for s in scheduled if len(s.token_ids) > 1 and not s.num_draft_tokens]
        ordered = decodes + [row for s in drafted for row in _draft_rows(s)] + chunks
        num_decodes = sum(len(s.token_ids) == 1 for s in ordered)
        num_seqs = len(ordered)
        assert num_seqs <= len(self.seq_lens.host), "step exceeds the runner's sequence buffers"
        num_new = np.fromiter((len(s.token_ids) for s in ordered), np.int64, num_seqs)
        starts = np.fromiter((s.num_computed_tokens - s.num_evicted_tokens for s in ordered),
                             np.int64, num_seqs)
        query_start = self.query_start_loc.host[:num_seqs + 1]
        query_start[0] = 0
        np.cumsum(num_new, out=query_start[1:])
        num_tokens = int(query_start[-1])
        assert num_tokens <= self.max_num_tokens, "step exceeds the runner's token buffers"

        seq_lens = self.seq_lens.host[:num_seqs]
        np.add(starts, num_new, out=seq_lens)
        width = -(-int(seq_lens.max(initial=0)) // self.block_size)
        tables = self.block_tables.host
        for i, s in enumerate(ordered):
            blocks = s.block_ids[:width]
            tables[i, :len(blocks)] = blocks

        self.input_ids.host[:num_tokens] = np.fromiter(
            chain.from_iterable(s.token_ids for s in ordered), np.int64, num_tokens)
        seq_of_token = np.repeat(np.arange(num_seqs), num_new)
        positions = self.positions.host[:num_tokens]
        np.subtract(np.arange(num_tokens), query_start[seq_of_token], out=positions)
        positions += starts[seq_of_token]
        block_of_token = tables[seq_of_token, positions // self.block_size]
        np.add(block_of_token * self.block_size, positions % self.block_size,
               out=self.slot_mapping.host[:num_tokens])

        sampling = [i for i, s in enumerate(ordered) if s.sample]
        num_samples = len(sampling)
        self.sample_rows.host[:num_samples] = query_start[1:][sampling] - 1
        prefills = [PrefillChunk(i, int(query_start[i]), int(num_new[i]), int(seq_lens[i]))
                    for i in range(num_decodes, num_seqs)]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping.upload(num_tokens),
            query_start_loc=self.query_start_loc.upload(num_seqs + 1),
            seq_lens=self.seq_lens.upload(num_seqs),
            block_tables=self.block_tables.upload(num_seqs, width),
            num_decodes=num_decodes,
            seq_lens_host=seq_lens.copy(),
            prefills=prefills,
            sliding_window=self.sliding_window,
            decode_rows_share_sequences=bool(drafted),
        )
        input_ids = self.input_ids.upload(num_tokens)
        if previous is not None:
            self._fill_pending(input_ids, ordered, previous)
        lora_slots, uses_lora = None, False
        if lora_slot_of is not None:
            slots = self.lora_slots.host[:num_tokens]
            slots[:] = np.repeat([lora_slot_of.get(s.request_id, -1) for s in ordered],
                                 num_new)
            lora_slots, uses_lora = self.lora_slots.upload(num_tokens), bool((slots >= 0).any())
        inputs = ModelInputs(
            input_ids=input_ids,
            positions=self.positions.upload(num_tokens),
            attn_metadata=meta,
            sample_rows=self.sample_rows.upload(num_samples),
            sample_requests=[s for s in decodes + drafted + chunks if s.sample],
            scheduled=ordered,
            query_start_host=query_start.copy(),
            blends=[_blended(i, int(query_start[i]), s) for i, s in enumerate(ordered)
                    if s.reused_spans],
            lora_slots=lora_slots,
            uses_lora=uses_lora,
        )
        self._mark_uploads()
        return inputs

    def _fill_pending(self, input_ids: torch.Tensor, ordered: list[ScheduledRequest],
                      previous: SampledIds) -> None:
        """Copies, on the device, each pending token from the previous step's output into
        its row: the ids never visit the host."""
        rows = np.flatnonzero(self.input_ids.host[:len(input_ids)] == PENDING_TOKEN)
        if not len(rows):
            return
        source_of = {request_id: i for i, request_id in enumerate(previous.request_ids)}
        # Pending tokens are decodes, whose rows come first: row i is ordered[i].
        self.pending_rows.host[:len(rows)] = rows
        self.pending_sources.host[:len(rows)] = [source_of[ordered[r].request_id]
                                                 for r in rows]
        input_ids.index_copy_(0, self.pending_rows.upload(len(rows)),
                              previous.token_ids[self.pending_sources.upload(len(rows))])

    def padded_decode(self, num_seqs: int, batch_size: int, lora: bool = False) -> ModelInputs:
        """The inputs of a decode-only step whose first `num_seqs` rows `prepare()` has
        filled, padded to `batch_size` rows that write no KV (slot -1) and attend to nothing
        (length 0). The views cover fixed addresses and whole block-table rows, and claim the
        longest possible context for shapes: what a captured graph replays over. Only the
        padding rows are uploaded: `prepare()` uploaded (and filled, for pending tokens) the
        others, and its query starts are the same 0, 1, 2, .... With `lora`, the rows' adapter
        slots too (padding: none)."""
        self.seq_lens.host[num_seqs:batch_size] = 0
        self.query_start_loc.host[:batch_size + 1] = np.arange(batch_size + 1)
        rows = self._padded_rows(num_seqs, batch_size, lora)
        meta = AttentionMetadata(
            slot_mapping=rows.slot_mapping,
            query_start_loc=self.query_start_loc.upload(batch_size + 1),
            seq_lens=self.seq_lens.upload(batch_size, first=num_seqs),
            block_tables=self.block_tables.device[:batch_size],
            num_decodes=batch_size,
            seq_lens_host=np.full(batch_size, self.max_seq_len),
            prefills=[],
            sliding_window=self.sliding_window,
        )
        return self._padded_inputs(rows, meta, np.arange(batch_size + 1))

    def padded_mixed(self, num_seqs: int, num_decodes: int, num_tokens: int,
                     padded_tokens: int, lora: bool = False) -> ModelInputs:
        """The inputs of a step with chunks whose `num_seqs` sequences (`num_decodes`
        decodes first) and `num_tokens` rows `prepare()` has filled, at the fixed shape of
        `padded_tokens` rows and every sequence buffer, the decode count on the device
        (`AttentionMetadata.decode_count`): padding rows write no KV (slot -1), and the
        sequences past `num_seqs` start at row `num_tokens`, so they have none. Only the
        padding and the count are uploaded."""
        max_seqs = len(self.seq_lens.host)
        self.query_start_loc.host[num_seqs + 1:] = num_tokens
        self.decode_count.host[0] = num_decodes
        rows = self._padded_rows(num_tokens, padded_tokens, lora)
        meta = AttentionMetadata(
            slot_mapping=rows.slot_mapping,
            query_start_loc=self.query_start_loc.upload(max_seqs + 1, first=num_seqs + 1),
            seq_lens=self.seq_lens.device,
            block_tables=self.block_tables.device,
            num_decodes=0,
            seq_lens_host=np.full(max_seqs, self.max_seq_len),
            prefills=[],
            sliding_window=self.sliding_window,
            decode_count=self.decode_count.upload(1),
        )
        return self._padded_inputs(rows, meta, self.query_start_loc.host.copy())

    def _padded_rows(self, num_rows: int, size: int, lora: bool) -> PaddedRows:
        """Rows `num_rows` to `size` as padding: token 0 at position 0, no KV slot, no
        adapter. Uploads them; returns the device views of all `size` rows."""
        pad = slice(num_rows, size)
        self.input_ids.host[pad] = 0
        self.positions.host[pad] = 0
        self.slot_mapping.host[pad] = -1
        if lora:
            self.lora_slots.host[pad] = -1
        return PaddedRows(self.input_ids.upload(size, first=num_rows),
                          self.positions.upload(size, first=num_rows),
                          self.slot_mapping.upload(size, first=num_rows),
                          self.lora_slots.upload(size, first=num_rows) if lora else None)

    def _padded_inputs(self, rows: PaddedRows, meta: AttentionMetadata,
                       query_start_host: np.ndarray) -> ModelInputs:
        self._mark_uploads()
        return ModelInputs(input_ids=rows.input_ids, positions=rows.positions,
                           attn_metadata=meta, sample_rows=self.sample_rows.device[:0],
                           sample_requests=[], scheduled=[],
                           query_start_host=query_start_host, lora_slots=rows.lora_slots)


@dataclass(slots=True, frozen=True)
class PaddedRows:
    """The per-row inputs of a padded step, as device views of its size."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    lora_slots: torch.Tensor | None


def _blended(seq: int, first_row: int, scheduled: ScheduledRequest) -> BlendedPrompt:
    reused = np.zeros(len(scheduled.token_ids), dtype=bool)
    for start, end in scheduled.reused_spans:
        reused[start:end] = True
    return BlendedPrompt(seq, first_row, len(scheduled.token_ids), reused)


def _draft_rows(scheduled: ScheduledRequest) -> list[ScheduledRequest]:
    """A decode with drafts as one sampling decode row per token, in order."""
    return [replace(scheduled, token_ids=[token_id],
                    num_computed_tokens=scheduled.num_computed_tokens + i, sample=True,
                    num_draft_tokens=0)
            for i, token_id in enumerate(scheduled.token_ids)]
