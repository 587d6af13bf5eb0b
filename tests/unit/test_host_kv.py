"""Host KV blocks: a run of consecutive host blocks moves in one copy, whatever device
blocks it pairs with, and the round trip is exact."""

import torch

from kvserve.worker.host_kv import MAX_RUN_BLOCKS, HostKVCache, host_runs


def test_runs_follow_consecutive_host_blocks_only():
    assert host_runs([(7, 0), (3, 1), (9, 2), (4, 5)], host_side=1) == [(0, [7, 3, 9]), (5, [4])]
    assert host_runs([(0, 7), (1, 3)], host_side=0) == [(0, [7, 3])]
    long = [(i, i) for i in range(MAX_RUN_BLOCKS + 1)]
    assert [len(blocks) for _, blocks in host_runs(long, host_side=1)] == [MAX_RUN_BLOCKS, 1]


def test_scattered_device_blocks_round_trip_in_one_copy_each_way():
    device = torch.randn(2, 2, 3, 10, 4, 8)  # [layers, K/V, kv heads, blocks, size, dim]
    original = device.clone()
    host = HostKVCache(device, num_blocks=6)
    scattered = [8, 1, 5, 2]
    host.to_host([(d, h) for h, d in enumerate(scattered)])
    assert host.num_copies == 1
    torch.testing.assert_close(host.block(2), original[:, :, :, 5], rtol=0, atol=0)
    device.zero_()
    host.to_device([(h, d) for h, d in enumerate(scattered)])
    assert host.num_copies == 2 and host.num_blocks_copied == 8
    for block in range(10):
        expected = original[:, :, :, block] if block in scattered else torch.zeros(2, 2, 3, 4, 8)
        torch.testing.assert_close(device[:, :, :, block], expected, rtol=0, atol=0)
