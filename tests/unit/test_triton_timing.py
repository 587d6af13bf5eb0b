"""The first-call choice between kernels: timed once per key, never inside a graph capture."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from kvserve import triton_timing  # noqa: E402


@pytest.fixture
def timings(monkeypatch):
    """do_bench replaced by each candidate returning its own time, with its calls counted;
    no capture under way (a CPU build of torch has no CUDA to ask)."""
    calls = []
    monkeypatch.setattr(triton_timing.torch.cuda, "is_current_stream_capturing", lambda: False)

    def do_bench(call, warmup, rep):  # noqa: ANN001, ANN202
        calls.append(call)
        return call()

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(triton_timing, "_fastest", {})
    return calls


def test_the_fastest_candidate_is_timed_once_and_kept(timings):
    assert triton_timing.fastest("layer", [lambda: 3.0, lambda: 1.0, lambda: 2.0], 0) == 1
    assert len(timings) == 3
    assert triton_timing.fastest("layer", [lambda: 0.1, lambda: 9.0, lambda: 9.0], 0) == 1
    assert len(timings) == 3  # kept, not timed again
    assert triton_timing.fastest("other", [lambda: 0.1, lambda: 9.0], 1) == 0


def test_a_tie_goes_to_the_first_candidate(timings):
    assert triton_timing.fastest("tie", [lambda: 1.0, lambda: 1.0], 1) == 0


def test_inside_a_graph_capture_nothing_is_timed_or_kept(timings, monkeypatch):
    monkeypatch.setattr(triton_timing.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert triton_timing.fastest("captured", [lambda: 1.0, lambda: 2.0], untimed=1) == 1
    assert timings == [] and "captured" not in triton_timing._fastest
