"""How many of a decode's drafts to verify: as many as raise the tokens the step yields per
second, by this engine's own measurements.

A draft row costs what a decode row does, and the i-th draft is kept with probability
alpha^i, alpha being the request's acceptance rate. Both are measured as the engine runs:
decode-only steps fit seconds = fixed + per_row * rows; each request's acceptance is a
decayed count of how its drafts fared against the tokens it went on to produce, whether or
not they were verified (a draft that was not verified is compared with the one token the step
produced), so a request whose drafts stopped paying off keeps being measured for free and
drafts again when they would pay. A new request starts from the engine-wide rate. Until the
fit has seen steps of different sizes, a row is taken to cost a tenth of a batch-1 step
(about what one does on a 2-core CPU for a 135M-parameter model).

A draft model's drafts also cost its decode steps, one per draft, measured too: the
scheduler asks for as many as are worth that cost as well. A request that is asked for none
is still asked for one now and then, so that its acceptance stays measured: `PROBE_INTERVAL`
tokens after it last drafted, then at gaps that double up to `MAX_PROBE_INTERVAL`, since
each probe runs the draft model over every token since the last (with a never-right draft,
probing every 16 tokens cost 2 % of a 78M model's decode time on a 2-core CPU).
"""

from __future__ import annotations

from kvserve.core.scheduler.output import StepShape
from kvserve.request import Request, num_kept_drafts

_DECAY = 0.95  # per draft scored: a request's acceptance follows its last ~20 drafts
_ENGINE_DECAY = 0.995  # the engine-wide rate follows the last ~200
_PRIOR_WEIGHT = 2.0  # drafts' worth of the engine-wide rate in a request's estimate
_COST_DECAY = 0.98  # per step
_PRIOR_FIXED_ROWS = 9.0  # fixed cost / per-row cost until measured
PROBE_INTERVAL = 16
MAX_PROBE_INTERVAL = 256


class DraftPolicy:
    def __init__(self) -> None:
        # Decayed sums over decode-only steps for the least-squares fit of seconds on rows.
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._hits = self._trials = 0.0  # engine-wide
        self.draft_step_seconds = 0.0  # a draft model's decode step, once measured

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        if shape.num_prefill_tokens or not shape.num_decodes:
            return
        rows = shape.num_decodes
        d = _COST_DECAY
        self._n = d * self._n + 1
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds

    def observe_drafting(self, seconds: float, num_steps: int) -> None:
        """Folds in the seconds a draft model took for `num_steps` decode steps."""
        if num_steps:
            rate = seconds / num_steps
            old = self.draft_step_seconds
            self.draft_step_seconds = rate if not old else old + 0.2 * (rate - old)

    def step_cost(self) -> tuple[float, float]:
        """(fixed, per row) seconds of a decode-only step (in any unit before one is seen)."""
        n = self._n
        if not n:
            return _PRIOR_FIXED_ROWS, 1.0
        mean_rows, mean_seconds = self._x / n, self._y / n
        var = self._xx / n - mean_rows ** 2
        if var > 0.1:
            per_row = (self._xy / n - mean_rows * mean_seconds) / var
            fixed = mean_seconds - per_row * mean_rows
            if per_row > 0 and fixed > 0:
                return fixed, per_row
        per_row = mean_seconds / (_PRIOR_FIXED_ROWS + mean_rows)
        return _PRIOR_FIXED_ROWS * per_row, per_row

    def observe(self, request: Request, new_token_ids: list[int]) -> None:
        """Scores the request's drafts against the tokens the step gave it."""
        drafts = request.spec_token_ids
        hits = num_kept_drafts(drafts, new_token_ids)
        trials = hits + (hits < min(len(drafts), len(new_token_ids)))
        if trials:
            request.draft_hits = _DECAY ** trials * request.draft_hits + hits
            request.draft_trials = _DECAY ** trials * request.draft_trials + trials
            self._hits = _ENGINE_DECAY ** trials * self._hits + hits
            self._trials = _ENGINE_DECAY ** trials * self._trials + trials

    def num_to_verify(self, request: Request, num_decodes: int) -> int:
        """The number of the request's drafts, in a step of `num_decodes` decodes, that
        maximizes its expected tokens per second."""
        return self._best(request, num_decodes, len(request.spec_token_ids), 0.0)

    def num_to_propose(self, request: Request, num_decodes: int, most: int) -> int:
        """How many tokens (up to `most`) a draft model should draft for the request's next
        step: those worth their verification and their draft step."""
        wanted = self._best(request, num_decodes, most,
                            self.draft_step_seconds if self._n else 0.0)
        produced = request.num_output_tokens
        if wanted:
            request.probe_gap, request.next_probe = 0, produced + PROBE_INTERVAL
        elif produced >= request.next_probe:
            request.probe_gap = min(2 * request.probe_gap or PROBE_INTERVAL,
                                    MAX_PROBE_INTERVAL)
            request.next_probe = produced + request.probe_gap
            return 1
        return wanted

    def _best(self, request: Request, num_decodes: int, most: int, per_draft: float) -> int:
        prior = (self._hits + 1) / (self._trials + 2)
        alpha = ((request.draft_hits + _PRIOR_WEIGHT * prior)
                 / (request.draft_trials + _PRIOR_WEIGHT))
        fixed, per_row = self.step_cost()
        best, best_rate, expected = 0, 0.0, num_decodes
        for k in range(most + 1):
            rate = expected / (fixed + per_row * (num_decodes + k) + per_draft * k)
            if rate > best_rate:
                best, best_rate = k, rate
            expected += alpha ** (k + 1)
        return best
