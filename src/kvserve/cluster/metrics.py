"""One /metrics for a cluster: every replica's metric families with a `replica` label, plus
the cluster's total under `replica="all"` (counters, gauges and histogram buckets add up), and
the front end's own counters."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvserve.engine.metrics import LATENCY_BUCKETS

TOTAL = "all"


def merge_replica_families(per_replica: dict[int, list[Metric]]) -> list[Metric]:
    """The families of all replicas, each sample labelled with its replica, and their sums."""
    merged: dict[str, Metric] = {}
    totals: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
    for replica, families in sorted(per_replica.items()):
        for family in families:
            out = merged.setdefault(family.name, Metric(family.name, family.documentation,
                                                        family.type))
            for sample in family.samples:
                out.add_sample(sample.name, {**sample.labels, "replica": str(replica)},
                               sample.value)
                if not sample.name.endswith("_created"):
                    key = (family.name, sample.name, tuple(sorted(sample.labels.items())))
                    totals[key] = totals.get(key, 0.0) + sample.value
    for (family_name, sample_name, labels), value in totals.items():
        merged[family_name].add_sample(sample_name, {**dict(labels), "replica": TOTAL}, value)
    return list(merged.values())


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


class ClusterMetrics:
    """The front end's own metrics: routing, replica failures and re-runs, migrations."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.routed = Counter("kvserve_cluster_routed_requests", "Requests sent to each replica",
                              ["model_name", "replica"], registry=self.registry)
        self.replica_failures = Counter(
            "kvserve_cluster_replica_failures", "Times a replica's process died",
            ["model_name", "replica"], registry=self.registry)
        self.rerun = Counter(
            "kvserve_cluster_rerun_requests",
            "Requests a dead replica had not started, sent to another replica",
            ["model_name"], registry=self.registry)
        self.failed = Counter(
            "kvserve_cluster_failed_requests",
            "Requests ended with an error because their replica died while running them",
            ["model_name"], registry=self.registry)
        self.recovery = Histogram(
            "kvserve_cluster_replica_recovery_seconds",
            "From a replica's death to its restarted process serving again",
            ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry)

        self.migrations = Counter(
            "kvserve_cluster_migrations",
            "Running requests moved between replicas, by outcome (done; skipped: finished "
            "or preempted first; failed: a replica died)",
            ["model_name", "outcome"], registry=self.registry)
        self.downtimes: deque[float] = deque(maxlen=10_000)  # the latest, for percentiles
        self.downtime = Histogram(
            "kvserve_cluster_migration_downtime_seconds",
            "From the source stopping a migrating request to its first output from the "
            "destination: the stall its client sees", ["model_name"],
            buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self, per_replica: dict[int, list[Metric]]) -> bytes:
        registry = CollectorRegistry()
        registry.register(_Families(merge_replica_families(per_replica)))
        return generate_latest(registry) + generate_latest(self.registry)
