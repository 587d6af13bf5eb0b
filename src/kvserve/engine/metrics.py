"""Engine metrics in Prometheus form: request latencies, token counts, queue and KV usage.

Fed by the serving loop after every step, from the engine's own thread; `prometheus_client`
metrics are thread-safe, so `/metrics` reads them from the HTTP thread at any time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import EngineStats, RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                    80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# Priorities and tenants beyond this many distinct values each share the label "other", so
# that a client that sends a fresh `priority` or `user` with every request cannot grow
# /metrics without bound.
MAX_CLASS_LABELS = 100


@dataclass(slots=True)
class RequestTimes:
    """Monotonic timestamps of one caller request, for its latency histograms."""

    arrival: float
    num_completions: int
    labels: tuple[str, str, str]  # model, priority, tenant: of the per-class histograms
    first_token: float | None = None
    num_output_tokens: int = 0


class BoundedLabels:
    """The first `limit` distinct values of a client-chosen label; later ones read "other"."""

    def __init__(self, limit: int = MAX_CLASS_LABELS) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value not in self._seen and len(self._seen) >= self._limit:
            return "other"
        self._seen.add(value)
        return value


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self._model = model_name
        self.finished = Counter("kvserve_requests_finished",
                                "Finished sequences (one per completion) by reason",
                                labelnames=["model_name", "finish_reason"],
                                registry=self.registry)
        self.ttft = Histogram("kvserve_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, **labels)
        self.tpot = Histogram("kvserve_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=_TPOT_BUCKETS, **labels)
        self.e2e = Histogram("kvserve_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS, **labels)
        self.queue_time = Histogram("kvserve_request_queue_time_seconds",
                                    "Arrival to first scheduled step",
                                    buckets=LATENCY_BUCKETS, **labels)
        by_class = {"labelnames": ["model_name", "priority", "tenant"],
                    "registry": self.registry}
        self.class_ttft = Histogram(
            "kvserve_class_time_to_first_token_seconds",
            "Time to first token by priority and tenant", buckets=LATENCY_BUCKETS, **by_class)
        self.class_queue_time = Histogram(
            "kvserve_class_request_queue_time_seconds",
            "Arrival to first scheduled step by priority and tenant", buckets=LATENCY_BUCKETS,
            **by_class)
        self.class_tpot = Histogram(
            "kvserve_class_time_per_output_token_seconds",
            "Mean time per output token after the first by priority and tenant",
            buckets=_TPOT_BUCKETS, **by_class)
        self._priority_label = BoundedLabels()
        self._tenant_label = BoundedLabels()
        self.running = Gauge("kvserve_num_requests_running", "Sequences in the running batch",
                             **labels)
        self.waiting = Gauge("kvserve_num_requests_waiting", "Sequences waiting to be scheduled",
                             **labels)
        self.kv_used = Gauge("kvserve_kv_blocks_used", "KV cache blocks in use", **labels)
        self.kv_total = Gauge("kvserve_kv_blocks_total", "KV cache blocks in the pool", **labels)
        self.kv_host_used = Gauge("kvserve_kv_host_blocks_used",
                                  "Swap-space KV blocks holding preempted requests' KV", **labels)
        self.prompt_tokens = Counter("kvserve_prompt_tokens", "Prefilled prompt tokens",
                                     **labels)
        self.generation_tokens = Counter("kvserve_generation_tokens", "Generated tokens",
                                         **labels)
        # Counters that mirror the engine's own running totals, keyed by EngineStats field.
        self._totals = {
            "num_preemptions": Counter("kvserve_preemptions", "Sequences preempted", **labels),
            "prefix_cache_host_hits": Counter(
                "kvserve_prefix_cache_host_hits",
                "Prompt tokens whose KV was loaded from the host tier", **labels),
            "prefix_cache_disk_hits": Counter(
                "kvserve_prefix_cache_disk_hits",
                "Prompt tokens whose KV was loaded from the disk tier", **labels),
            "num_swapped_preemptions": Counter(
                "kvserve_swapped_preemptions", "Preemptions that swapped the KV to host memory",
                **labels),
            "num_recomputed_tokens": Counter(
                "kvserve_recomputed_tokens", "Tokens computed again after recompute preemptions",
                **labels),
            "prefix_cache_queries": Counter(
                "kvserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                **labels),
            "prefix_cache_hits": Counter(
                "kvserve_prefix_cache_hits", "Prompt tokens whose KV the prefix cache held",
                **labels),
            "num_draft_tokens": Counter(
                "kvserve_spec_decode_draft_tokens", "Speculative tokens verified", **labels),
            "num_accepted_tokens": Counter(
                "kvserve_spec_decode_accepted_tokens",
                "Speculative tokens the model agreed with", **labels),
            "num_blended_prompts": Counter(
                "kvserve_blend_prompts", "Prompts given as segments and blended", **labels),
            "blend_chunk_hit_tokens": Counter(
                "kvserve_blend_chunk_hit_tokens",
                "Blended prompts' chunk tokens whose KV was cached", **labels),
            "blend_chunk_fill_tokens": Counter(
                "kvserve_blend_chunk_fill_tokens",
                "Blended prompts' chunk tokens computed on their own first", **labels),
        }
        self._last_totals = dict.fromkeys(self._totals, 0)
        self._times: dict[str, RequestTimes] = {}

    def on_arrival(self, request_id: str, arrival: float, num_completions: int,
                   priority: int = 0, tenant: str | None = None,
                   num_output_tokens: int = 0) -> None:
        """A request this engine now serves; one migrated in brings `num_output_tokens`,
        and its first token, counted where it was produced, is not counted again."""
        self._times[request_id] = RequestTimes(
            arrival, num_completions,
            (self._model, self._priority_label(str(priority)), self._tenant_label(tenant or "")),
            time.monotonic() if num_output_tokens else None, num_output_tokens)

    def on_migrated_out(self, request_id: str) -> None:
        """A request that goes on in another engine, which counts the rest of it."""
        self._times.pop(request_id, None)

    def on_abort(self, request_id: str) -> None:
        times = self._times.pop(request_id, None)
        if times is not None:
            self.finished.labels(self._model, "abort").inc(times.num_completions)

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            times = self._times.get(out.request_id)
            if times is None:
                continue
            num_tokens = sum(len(o.token_ids) for o in out.outputs)
            self.generation_tokens.labels(self._model).inc(num_tokens - times.num_output_tokens)
            times.num_output_tokens = num_tokens
            if times.first_token is None and num_tokens:
                times.first_token = now
                self.ttft.labels(self._model).observe(now - times.arrival)
                self.class_ttft.labels(*times.labels).observe(now - times.arrival)
                self.prompt_tokens.labels(self._model).inc(len(out.prompt_token_ids))
                if out.first_scheduled_time is not None:
                    queued = out.first_scheduled_time - times.arrival
                    self.queue_time.labels(self._model).observe(queued)
                    self.class_queue_time.labels(*times.labels).observe(queued)
            if out.finished:
                del self._times[out.request_id]
                self._observe_finished(out, times, now)
        stats = self.observe_state(engine)
        for name, counter in self._totals.items():  # only here: one thread increments
            total = getattr(stats, name)
            counter.labels(self._model).inc(total - self._last_totals[name])
            self._last_totals[name] = total

    def _observe_finished(self, out: RequestOutput, times: RequestTimes, now: float) -> None:
        self.e2e.labels(self._model).observe(now - times.arrival)
        longest = max(len(o.token_ids) for o in out.outputs)
        if times.first_token is not None and longest > 1:
            tpot = (now - times.first_token) / (longest - 1)
            self.tpot.labels(self._model).observe(tpot)
            self.class_tpot.labels(*times.labels).observe(tpot)
        for completion in out.outputs:
            self.finished.labels(self._model, completion.finish_reason or "abort").inc()

    def observe_state(self, engine: LLMEngine) -> EngineStats:
        """Sets the queue and KV gauges; called after each step and at each scrape."""
        stats = engine.stats()
        self.running.labels(self._model).set(stats.num_running)
        self.waiting.labels(self._model).set(stats.num_waiting)
        self.kv_used.labels(self._model).set(stats.kv_blocks_used)
        self.kv_total.labels(self._model).set(stats.kv_blocks_total)
        self.kv_host_used.labels(self._model).set(stats.kv_host_blocks_used)
        return stats
