"""The per-class metrics' labels stay bounded whatever priorities and users clients send."""

from kvserve.engine.metrics import MAX_CLASS_LABELS, EngineMetrics


def test_fresh_priorities_and_tenants_share_the_label_other_past_the_limit() -> None:
    metrics = EngineMetrics("m")
    count = MAX_CLASS_LABELS + 5
    for i in range(count):
        metrics.on_arrival(f"r{i}", 0.0, 1, priority=i, tenant=f"user-{i}")
    labels = [metrics._times[f"r{i}"].labels for i in range(count)]
    assert labels[0] == ("m", "0", "user-0")
    assert labels[MAX_CLASS_LABELS - 1] == (
        "m", str(MAX_CLASS_LABELS - 1), f"user-{MAX_CLASS_LABELS - 1}")
    assert set(labels[MAX_CLASS_LABELS:]) == {("m", "other", "other")}
    # A value seen before the limit keeps its own label.
    metrics.on_arrival("again", 0.0, 1, priority=3, tenant="user-3")
    assert metrics._times["again"].labels == ("m", "3", "user-3")
