"""A step's output while its sampled ids may still be on their way from the device.

Under async scheduling the engine launches step N+1 before step N's ids reach the host: N's
ids go on to N+1 on the device (`SampledIds`), and to the host through one non-blocking copy
into pinned memory that `result()` waits for.
"""

from __future__ import annotations

import torch

from kvserve.core.scheduler.output import ModelRunnerOutput
from kvserve.worker.input_batch import SampledIds
from kvserve.worker.sampler import SamplingState


class PendingOutput:
    def __init__(self, output: ModelRunnerOutput, sampled: SampledIds | None = None,
                 states: list[SamplingState] | None = None) -> None:
        """`output` as known at launch; with `sampled`, its tokens are still to come (one
        per request of `sampled`, whose sampling `states` take them in)."""
        self._output = output
        self.sampled = sampled
        self._states = states or []
        self._host: torch.Tensor | None = None
        self._ready: torch.cuda.Event | None = None
        if sampled is None:
            return
        token_ids = sampled.token_ids
        if token_ids.device.type == "cuda":
            self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host.copy_(token_ids, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = token_ids

    @property
    def done(self) -> bool:
        """Whether the output was complete at launch (nothing left on the device)."""
        return self.sampled is None

    def result(self) -> ModelRunnerOutput:
        """The output, waiting for the sampled ids if they are not on the host yet."""
        if self._host is not None:
            if self._ready is not None:
                self._ready.synchronize()
            token_ids = self._host.tolist()
            self._host = None
            self._output.sampled_token_ids = [[t] for t in token_ids]
            for state, token_id in zip(self._states, token_ids, strict=True):
                state.output_token_ids.append(token_id)
        return self._output
