"""Swap or recompute: what a preempted request's KV costs to keep, against what it costs to
compute again, from this engine's own measurements.

Swapping costs two copies of the request's blocks (out now, in when it resumes) at the
host-copy rate the runner measured at start. Recomputing costs a prefill of every token it
had computed, at the per-token rate of recent prefill-heavy steps. Until a step has been
measured, swapping is assumed cheaper: a copy moves each token's KV once, a prefill
recomputes it through every weight of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

# Steps with fewer tokens are dominated by fixed costs (weights streamed once per step),
# which would overstate what each recomputed token costs.
MIN_TOKENS_TO_MEASURE = 64
_SMOOTHING = 0.2


@dataclass
class PreemptionCosts:
    swap_seconds_per_block: float  # one block copied one way
    prefill_seconds_per_token: float | None = None

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Folds a finished step into the per-token prefill rate."""
        if num_tokens < MIN_TOKENS_TO_MEASURE:
            return
        rate = seconds / num_tokens
        old = self.prefill_seconds_per_token
        self.prefill_seconds_per_token = rate if old is None else old + _SMOOTHING * (rate - old)

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.swap_seconds_per_block

    def recompute_seconds(self, num_tokens: int) -> float | None:
        rate = self.prefill_seconds_per_token
        return None if rate is None else num_tokens * rate

    def prefers_swap(self, num_tokens: int, num_blocks: int) -> bool:
        recompute = self.recompute_seconds(num_tokens)
        return recompute is None or self.swap_seconds(num_blocks) <= recompute
