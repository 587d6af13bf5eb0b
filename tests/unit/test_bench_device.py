"""How the kernel benchmarks time a call: alone on CPU, replayed from a CUDA graph on CUDA."""

from __future__ import annotations

import pytest
import torch

from kvserve.benchmarks.device import copies_past_cache, device_seconds, past_cache_copies


def test_on_cpu_each_call_runs_alone_after_a_first_use():
    runs = []
    seconds = device_seconds([lambda: runs.append("a"), lambda: runs.append("b")], "cpu", 5)
    assert seconds >= 0 and runs == ["a", "a", "b", "a", "b", "a"]
    assert copies_past_cache(1, "cpu") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_calls_replay_from_one_graph_over_weights_past_the_l2():
    x = torch.zeros(1, device="cuda")
    seconds = device_seconds([lambda: x.add_(1)] * 3, "cuda", 4)
    torch.cuda.synchronize()
    assert seconds > 0 and x.item() == 3 + 4 * 3  # the warm-up, then 4 replays of 3 calls
    l2 = torch.cuda.get_device_properties("cuda").L2_cache_size
    layer = torch.nn.Linear(256, 256, device="cuda")
    copies = past_cache_copies(layer.forward, l2 // 8, "cuda")
    assert len(copies) == 32
    assert len({c.__self__.weight.data_ptr() for c in copies}) == 32
