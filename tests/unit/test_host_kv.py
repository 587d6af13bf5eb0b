"""Host KV blocks: runs of consecutive host blocks, whatever device blocks they pair with,
and an exact round trip."""

import pytest
import torch

from kvserve.worker.host_kv import MAX_RUN_BLOCKS, HostKVCache, host_runs


def test_runs_follow_consecutive_host_blocks_only():
    assert host_runs([(7, 0), (3, 1), (9, 2), (4, 5)], host_side=1) == [(0, [7, 3, 9]), (5, [4])]
    assert host_runs([(0, 7), (1, 3)], host_side=0) == [(0, [7, 3])]
    long = [(i, i) for i in range(MAX_RUN_BLOCKS + 1)]
    assert [len(blocks) for _, blocks in host_runs(long, host_side=1)] == [MAX_RUN_BLOCKS, 1]


@pytest.mark.parametrize("gather_runs", [False, True])  # the CPU path, and CUDA's
def test_scattered_device_blocks_round_trip_exactly(gather_runs):
    device = torch.randn(2, 2, 3, 10, 4, 8)  # [layers, K/V, kv heads, blocks, size, dim]
    original = device.clone()
    host = HostKVCache(device, num_blocks=6)
    host.gather_runs = gather_runs
    scattered = [8, 1, 5, 2]
    host.to_host([(d, h) for h, d in enumerate(scattered)])
    torch.testing.assert_close(host.block(2), original[:, :, :, 5], rtol=0, atol=0)
    device.zero_()
    host.to_device([(h, d) for h, d in enumerate(scattered)])
    assert host.num_blocks_copied == 8
    assert host.num_copies == (2 if gather_runs else 8)  # one transfer per run each way
    for block in range(10):
        expected = original[:, :, :, block] if block in scattered else torch.zeros(2, 2, 3, 4, 8)
        torch.testing.assert_close(device[:, :, :, block], expected, rtol=0, atol=0)
