"""Attention backends against a dense reference on random paged data."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kvserve.attention.backend import AttentionMetadata, PrefillChunk
from kvserve.attention.cpu_paged import CpuPagedAttention
from kvserve.attention.torch_ref import TorchPagedAttention
from kvserve.cpp_extension import cpu_kernels

BLOCK = 4


def paged_case(seq_lens, num_heads=6, num_kv_heads=2, head_dim=32, window=None, seed=0):
    """Random contexts scattered over a shuffled block pool, and dense copies of them."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK) for n in seq_lens) + 3
    cache = torch.randn(2, num_kv_heads, num_blocks, BLOCK, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, dense = [], []
    for n in seq_lens:
        ids = [order.pop() for _ in range(-(-n // BLOCK))]
        tables.append(ids)
        dense.append(cache[:, :, ids].reshape(2, num_kv_heads, -1, head_dim)[:, :, :n])
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        query_start_loc=torch.arange(len(seq_lens) + 1), seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        num_decodes=len(seq_lens), seq_lens_host=np.array(seq_lens), prefills=[],
        sliding_window=window)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    return q, cache, meta, dense


def dense_reference(q, dense, window, scale, softcap=None):
    outs = []
    for i, kv in enumerate(dense):
        k, v = kv[0], kv[1]
        if window is not None:
            k, v = k[:, -window:], v[:, -window:]
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = (q[i].unsqueeze(1) @ k.transpose(1, 2)) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        probs = torch.softmax(scores, dim=-1)
        outs.append((probs @ v).reshape(-1))
    return torch.stack(outs)


BACKENDS = {"torch": TorchPagedAttention}
if cpu_kernels() is not None:
    BACKENDS["cpu-kernel"] = lambda softcap=None: CpuPagedAttention(cpu_kernels(), softcap)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("window", [None, 5, 200])
def test_decode_matches_dense_attention(backend, window):
    """Contexts within one of the CPU kernel's 128-key partitions and across up to three."""
    q, cache, meta, dense = paged_case([1, 3, 4, 9, 17, 128, 129, 300], window=window)
    out = BACKENDS[backend]().decode(q, cache, meta, 0.25)
    torch.testing.assert_close(out, dense_reference(q, dense, window, 0.25), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.skipif("cpu-kernel" not in BACKENDS, reason="the CPU kernel did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_decodes_the_same_bits_alone_and_in_a_batch(dtype):
    """The kernel splits work by key counts across the batch, but a sequence's arithmetic
    depends on its own context only."""
    q, cache, meta, _ = paged_case([300, 3, 129, 17, 250], seed=3)
    q, cache = q.to(dtype), cache.to(dtype)
    backend = BACKENDS["cpu-kernel"]()
    batch = backend.decode(q, cache, meta, 0.25)
    for i in range(len(q)):
        one = replace(meta, block_tables=meta.block_tables[i:i + 1],
                      seq_lens=meta.seq_lens[i:i + 1], seq_lens_host=meta.seq_lens_host[i:i + 1],
                      num_decodes=1, query_start_loc=torch.arange(2))
        assert torch.equal(backend.decode(q[i:i + 1], cache, one, 0.25), batch[i:i + 1])


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(6, 2, 32), (14, 2, 64), (10, 2, 96), (4, 1, 128)])
def test_bfloat16_decode_matches_float32_attention_of_the_same_values(
        backend, num_heads, num_kv_heads, head_dim):
    """bfloat16 inputs, float32 arithmetic: only the output's rounding differs. Query groups
    of 3 to 7 heads, 1 to 4 runs of 32 head dimensions, and a context split over units."""
    q, cache, meta, dense = paged_case([1, 3, 4, 9, 17, 300], num_heads, num_kv_heads,
                                       head_dim)
    q16, cache16 = q.bfloat16(), cache.bfloat16()
    expected = dense_reference(q16.float(), [d.bfloat16().float() for d in dense], None, 0.25)
    out = BACKENDS[backend]().decode(q16, cache16, meta, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif("cpu-kernel" not in BACKENDS, reason="the CPU kernel did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_a_fused_decode_step_matches_the_reference_forward(dtype, window):
    """Rotary, cache write and attention in one kernel call: the same output and the same
    cache as the reference's separate ops, the last context across two key partitions."""
    lens = [1, 3, 4, 9, 17, 200]
    _, cache, meta, _ = paged_case(lens, window=window)
    tables = meta.block_tables
    slots = [int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK
             for i, n in enumerate(lens)]
    meta = replace(meta, slot_mapping=torch.tensor(slots))
    gen = torch.Generator().manual_seed(1)
    qk = torch.randn(len(lens), 6 + 2, 32, generator=gen).to(dtype)
    v = torch.randn(len(lens), 2, 32, generator=gen).to(dtype)
    angles = torch.randn(len(lens), 1, 16, generator=gen)
    freqs = torch.polar(torch.ones_like(angles), angles)
    ref_cache, fused_cache = cache.to(dtype).clone(), cache.to(dtype).clone()
    want = TorchPagedAttention().forward(qk.clone(), v, freqs, ref_cache, meta, 0.25)
    got = BACKENDS["cpu-kernel"]().forward(qk.clone(), v, freqs, fused_cache, meta, 0.25)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {
        "rtol": 2e-2, "atol": 2e-2}
    assert not torch.equal(ref_cache, cache.to(dtype))  # the new keys and values landed
    torch.testing.assert_close(fused_cache.float(), ref_cache.float(), **tolerance)
    torch.testing.assert_close(got.float(), want.float(), **tolerance)


@pytest.mark.skipif("cpu-kernel" not in BACKENDS, reason="the CPU kernel did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 70])
@pytest.mark.parametrize("head_dim", [16, 32, 64])
@pytest.mark.parametrize(("num_q", "ctx"), [(1, 1), (7, 7), (13, 150), (150, 150), (64, 200)])
def test_prefill_kernel_matches_the_reference(dtype, window, head_dim, num_q, ctx):
    """Chunks with and without earlier context, across the kernel's 6-row and 64-key tiles
    and the pool's 4-token blocks; head_dim 16 packs bfloat16 keys in half a scatter, 64
    keeps the output in AMX tiles."""
    backend = BACKENDS["cpu-kernel"]()
    if dtype not in backend.prefill_dtypes:
        pytest.skip(f"no prefill kernel for {dtype} on this CPU")
    _, cache, meta, dense = paged_case([ctx], head_dim=head_dim, seed=ctx + num_q)
    cache = cache.to(dtype)
    block_ids = meta.block_tables[0, :-(-ctx // BLOCK)]
    k, v = (dense[0][i, :, ctx - num_q:].transpose(0, 1).to(dtype) for i in (0, 1))
    q = torch.randn(num_q, 6, head_dim, generator=torch.Generator().manual_seed(5)).to(dtype)
    chunk = PrefillChunk(seq=0, query_start=0, num_query_tokens=num_q, context_len=ctx)
    want = TorchPagedAttention().prefill(q, k, v, cache, chunk, block_ids, window, 0.25)
    got = backend.prefill(q, k, v, cache, chunk, block_ids, window, 0.25)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {
        "rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), want.float(), **tolerance)


@pytest.mark.skipif("cpu-kernel" not in BACKENDS, reason="the CPU kernel did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("growth", [0.002, 0.05, 3.0])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_prefill_kernel_follows_scores_that_grow_along_the_context(dtype, growth, head_dim):
    """Each key tile's largest score passes the earlier ones, by less than the softmax's
    rescaling threshold (the reference stays), by more (it moves), or by far more; at head_dim
    64 with the output held in AMX tiles too."""
    backend = BACKENDS["cpu-kernel"]()
    if dtype not in backend.prefill_dtypes:
        pytest.skip(f"no prefill kernel for {dtype} on this CPU")
    ctx = 300
    _, cache, meta, dense = paged_case([ctx], head_dim=head_dim, seed=7)
    block_ids = meta.block_tables[0, :-(-ctx // BLOCK)]
    ramp = 1 + growth * torch.arange(ctx, dtype=torch.float32)
    for t in range(ctx):
        cache[0, :, block_ids[t // BLOCK], t % BLOCK] = ramp[t]
    cache = cache.to(dtype)
    k, v = (cache[i][:, block_ids].reshape(2, -1, head_dim)[:, :ctx].transpose(0, 1)
            for i in (0, 1))
    q = torch.full((ctx, 6, head_dim), 0.1, dtype=dtype)
    chunk = PrefillChunk(seq=0, query_start=0, num_query_tokens=ctx, context_len=ctx)
    want = TorchPagedAttention().prefill(q, k, v, cache, chunk, block_ids, None, 0.25)
    got = backend.prefill(q, k, v, cache, chunk, block_ids, None, 0.25)
    assert got.float().isfinite().all()
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {
        "rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), want.float(), **tolerance)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 9])
def test_queries_at_some_positions_match_those_rows_of_the_full_prefill(backend, dtype,
                                                                         window):
    """A blended prompt's recomputed tokens: scattered positions, the last one included."""
    attention = BACKENDS[backend]()
    if dtype not in getattr(attention, "prefill_dtypes", {dtype}):
        pytest.skip(f"no prefill kernel for {dtype} on this CPU")
    ctx = 130
    _, cache, meta, dense = paged_case([ctx], head_dim=32, seed=4)
    cache = cache.to(dtype)
    block_ids = meta.block_tables[0, :-(-ctx // BLOCK)]
    k, v = (dense[0][i].transpose(0, 1).to(dtype) for i in (0, 1))
    q = torch.randn(ctx, 6, 32, generator=torch.Generator().manual_seed(5)).to(dtype)
    full = attention.prefill(q, k, v, cache, PrefillChunk(0, 0, ctx, ctx), block_ids, window,
                             0.25)
    positions = torch.tensor([0, 3, 4, 5, 17, 63, 64, 65, 100, 128, 129])
    got = attention.prefill(q[positions], k[positions], v[positions], cache,
                            PrefillChunk(0, 0, len(positions), ctx), block_ids, window, 0.25,
                            positions)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {
        "rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), full[positions].float(), **tolerance)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_softcapped_decode_matches_dense_attention(backend, dtype, window):
    """Gemma 2's cap on scores large enough that it bites: softcap * tanh(score / softcap)
    where scores reach several times the cap, within one key partition and across three."""
    q, cache, meta, dense = paged_case([1, 3, 17, 129, 300], window=window)
    q, cache = (4 * q).to(dtype), cache.to(dtype)
    dense = [d.to(dtype).float() for d in dense]
    expected = dense_reference(q.float(), dense, window, 0.25, softcap=2.0)
    assert not torch.allclose(dense_reference(q.float(), dense, window, 0.25), expected,
                              atol=0.1)  # the cap changes the output
    out = BACKENDS[backend](softcap=2.0).decode(q, cache, meta, 0.25)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {
        "rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.float(), expected, **tolerance)


@pytest.mark.skipif("cpu-kernel" not in BACKENDS, reason="the CPU kernel did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 70])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_softcapped_prefill_and_fused_decode_match_the_reference(dtype, window, head_dim):
    """The prefill kernel caps raw scores before its online softmax (64-key tiles, AMX or
    not), and the fused decode step caps its scores too."""
    backend = BACKENDS["cpu-kernel"](softcap=2.0)
    if dtype not in backend.prefill_dtypes:
        pytest.skip(f"no prefill kernel for {dtype} on this CPU")
    ctx, num_q = 200, 150
    _, cache, meta, dense = paged_case([ctx], head_dim=head_dim, seed=9)
    cache = cache.to(dtype)
    block_ids = meta.block_tables[0, :-(-ctx // BLOCK)]
    k, v = (dense[0][i, :, ctx - num_q:].transpose(0, 1).to(dtype) for i in (0, 1))
    q = (4 * torch.randn(num_q, 6, head_dim, generator=torch.Generator().manual_seed(5))
         ).to(dtype)
    chunk = PrefillChunk(seq=0, query_start=0, num_query_tokens=num_q, context_len=ctx)
    reference = TorchPagedAttention(softcap=2.0)
    want = reference.prefill(q, k, v, cache, chunk, block_ids, window, 0.25)
    uncapped = TorchPagedAttention().prefill(q, k, v, cache, chunk, block_ids, window, 0.25)
    assert not torch.allclose(want.float(), uncapped.float(), atol=0.1)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {
        "rtol": 2e-2, "atol": 2e-2}
    got = backend.prefill(q, k, v, cache, chunk, block_ids, window, 0.25)
    torch.testing.assert_close(got.float(), want.float(), **tolerance)

    lens = [3, 17, 200]
    _, cache, meta, _ = paged_case(lens, head_dim=head_dim, window=window, seed=2)
    tables = meta.block_tables
    slots = [int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK
             for i, n in enumerate(lens)]
    meta = replace(meta, slot_mapping=torch.tensor(slots))
    gen = torch.Generator().manual_seed(1)
    qk = (4 * torch.randn(len(lens), 6 + 2, head_dim, generator=gen)).to(dtype)
    v = torch.randn(len(lens), 2, head_dim, generator=gen).to(dtype)
    angles = torch.randn(len(lens), 1, head_dim // 2, generator=gen)
    freqs = torch.polar(torch.ones_like(angles), angles)
    want = reference.forward(qk.clone(), v, freqs, cache.to(dtype).clone(), meta, 0.25)
    got = backend.forward(qk.clone(), v, freqs, cache.to(dtype).clone(), meta, 0.25)
    torch.testing.assert_close(got.float(), want.float(), **tolerance)


@pytest.mark.skipif("cpu-kernel" not in BACKENDS, reason="the CPU kernel did not build")
def test_prefill_kernel_writes_into_the_rows_it_is_given():
    """A step's output rows take the chunk's attention in place; other rows stay, and an
    `out` of the wrong width is refused by name."""
    if torch.float32 not in BACKENDS["cpu-kernel"]().prefill_dtypes:
        pytest.skip("no float32 prefill kernel on this CPU")
    kernel = cpu_kernels()
    ctx = 70
    _, cache, meta, _ = paged_case([ctx], head_dim=32, seed=3)
    block_ids = meta.block_tables[0, :-(-ctx // BLOCK)]
    q = torch.randn(ctx, 6, 32, generator=torch.Generator().manual_seed(2))
    want = kernel.prefill_attention(q, cache, block_ids, ctx, 0.25, 0)
    step = torch.full((ctx + 5, 6 * 32), 7.0)
    kernel.prefill_attention(q, cache, block_ids, ctx, 0.25, 0, out=step[5:])
    assert torch.equal(step[5:], want) and (step[:5] == 7.0).all()
    with pytest.raises(RuntimeError, match="out, when given"):
        kernel.prefill_attention(q, cache, block_ids, ctx, 0.25, 0, out=step[5:, :32])


def test_kernel_builds_on_this_machine():
    """CI machines have a compiler; a silent fallback to the slow path would hide a break."""
    assert cpu_kernels() is not None
