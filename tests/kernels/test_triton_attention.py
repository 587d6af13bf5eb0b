"""The Triton attention kernels against the plain-torch backend, on steps built by the
runner's own input buffers. Without CUDA they run in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from kvserve.attention.backend import PrefillChunk, QKNorm  # noqa: E402
from kvserve.attention.torch_ref import TorchPagedAttention  # noqa: E402
from kvserve.attention.triton.backend import TritonPagedAttention  # noqa: E402
from kvserve.attention.triton.decode import merge_heads, paged_decode_attention  # noqa: E402
from kvserve.core.scheduler.output import ScheduledRequest  # noqa: E402
from kvserve.layers.norm import RMSNorm  # noqa: E402
from kvserve.layers.rotary import RotaryEmbedding  # noqa: E402
from kvserve.triton_splits import split_counters  # noqa: E402
from kvserve.worker.input_batch import InputBuffers  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bf16_close(roundings: int = 1) -> dict[str, float]:
    """One bfloat16 unit in the last place per rounding a value went through: Triton's
    interpreter truncates float32 to bfloat16 where a GPU rounds to nearest, and a GPU's fused
    multiply-adds and reduction order move float32 results across rounding boundaries."""
    return {"rtol": roundings * 2 ** -7, "atol": 0}


def make_step(seqs, num_heads, num_kv_heads, head_dim, block_size, window=None, seed=0,
              dtype=torch.float32, device=DEVICE):
    """seqs: (tokens already cached, new tokens) per sequence. Returns the step's inputs
    and a KV pool whose cached part is random, with blocks handed out in shuffled order."""
    return build_step(seqs, num_heads, num_kv_heads, head_dim, block_size, window, seed,
                      dtype, device)[:5]


def build_step(seqs, num_heads, num_kv_heads, head_dim, block_size, window=None, seed=0,
               dtype=torch.float32, device=DEVICE, spare=0):
    """make_step's, then the input buffers, with room for `spare` more rows and sequences."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-(cached + new) // block_size) + 1 for cached, new in seqs]  # one spare
    num_blocks = sum(per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    scheduled = []
    for i, ((cached, new), n) in enumerate(zip(seqs, per_seq, strict=True)):
        blocks = [order.pop() for _ in range(n)]
        scheduled.append(ScheduledRequest(f"r{i}", [7] * new, cached, blocks, sample=True))
    max_len = max(c + n for c, n in seqs)
    buffers = InputBuffers(sum(n for _, n in seqs) + spare, len(seqs) + spare,
                           -(-max_len // block_size) + 2, block_size, window, device)
    inputs = buffers.prepare(scheduled)
    num_tokens = inputs.input_ids.shape[0]
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=gen)
    qk = torch.randn(num_tokens, num_heads + num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    rotary = RotaryEmbedding(head_dim, max_len + 1, 10000.0, None).to(device)
    freqs = rotary(inputs.positions)
    return (qk.to(device, dtype), v.to(device, dtype), freqs, cache.to(device, dtype),
            inputs.attn_metadata, buffers)


def run_both(step, scale=0.3, softcap=None):
    qk, v, freqs, cache, meta = step
    ref_cache, our_cache = cache.clone(), cache.clone()
    expected = TorchPagedAttention(softcap).forward(qk.clone(), v, freqs, ref_cache, meta,
                                                    scale)
    got = TritonPagedAttention(num_programs=8, softcap=softcap).forward(
        qk.clone(), v, freqs, our_cache, meta, scale)
    return expected, got, ref_cache, our_cache


# Decodes then chunks: a fresh prompt, a chunk after cached context, a chunk of one block
# boundary's worth, contexts that are not multiples of the block size.
MIXED = [(0, 1), (5, 1), (37, 1), (130, 1), (0, 23), (41, 17), (16, 80)]


# Every pair of values of any two of head layout, block size and window, in 6 cases of 12.
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,window", [
    (8, 2, 64, 4, None), (8, 2, 64, 16, 24), (4, 4, 128, 4, 24), (4, 4, 128, 16, None),
    (6, 2, 16, 4, None), (6, 2, 16, 16, 24)])
def test_mixed_step_matches_the_torch_backend(num_heads, num_kv_heads, head_dim, block_size,
                                              window):
    step = make_step(MIXED, num_heads, num_kv_heads, head_dim, block_size, window)
    expected, got, ref_cache, our_cache = run_both(step)
    torch.testing.assert_close(our_cache, ref_cache, rtol=0, atol=1e-6)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_queries_at_some_positions_match_those_rows_of_the_full_step():
    """A blended prompt's recomputed tokens: a chunk of scattered positions beside a decode."""
    qk, v, freqs, cache, meta = make_step([(9, 1), (0, 70)], 4, 2, 32, 8, window=30)
    full = TorchPagedAttention().forward(qk.clone(), v, freqs, cache, meta, 0.3)  # all KV
    rows = torch.tensor([0, 1, 3, 40, 41, 64, 70], device=DEVICE)  # the decode, then the chunk
    positions = torch.cat([torch.tensor([9], device=DEVICE), rows[1:] - 1])
    narrowed = replace(meta, slot_mapping=meta.slot_mapping[rows],
                       query_start_loc=torch.tensor([0, 1, len(rows)], device=DEVICE),
                       prefills=[PrefillChunk(1, 1, len(rows) - 1, 70)],
                       query_positions=positions)
    got = TritonPagedAttention(num_programs=8).forward(qk[rows].clone(), v[rows], freqs[rows],
                                                       cache.clone(), narrowed, 0.3)
    torch.testing.assert_close(got, full[rows], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("seqs", [MIXED, [(0, 23), (41, 17)], [(3, 1)] * 9 + [(0, 5)]],
                         ids=["mixed", "chunks only", "9 decodes and a chunk"])
@pytest.mark.parametrize("num_programs", [1, 5, 40, 1000])
def test_a_step_padded_to_a_graphs_shape_matches_the_torch_backend(num_programs, seqs):
    """The decodes counted on the device by the decode launch, which covers as many
    sequences as the padded step could hold and splits each 1 to 16 ways as their number
    allows; the chunks in the varlen launch, which skips the decodes; sequences after the
    real ones with no rows, rows after the real ones that write no KV; programs taking
    several (tile, KV head) pairs each, or one, or none."""
    qk, v, freqs, cache, meta, buffers = build_step(seqs, 8, 2, 64, 16, spare=40)
    num_tokens, num_seqs = qk.shape[0], len(seqs)
    padded = buffers.padded_mixed(num_seqs, meta.num_decodes, num_tokens, num_tokens + 40)
    assert padded.attn_metadata.num_decodes == 0
    assert padded.attn_metadata.decode_count.tolist() == [meta.num_decodes]
    gen = torch.Generator().manual_seed(9)
    junk = [torch.randn(40, *x.shape[1:], generator=gen).to(DEVICE) for x in (qk, v)]
    pad_freqs = torch.cat([freqs, freqs[:1].expand(40, *freqs.shape[1:])])
    ref_cache, our_cache = cache.clone(), cache.clone()
    expected = TorchPagedAttention().forward(qk.clone(), v, freqs, ref_cache, meta, 0.3)
    got = TritonPagedAttention(num_programs).forward(
        torch.cat([qk, junk[0]]), torch.cat([v, junk[1]]), pad_freqs, our_cache,
        padded.attn_metadata, 0.3)
    torch.testing.assert_close(our_cache, ref_cache, rtol=0, atol=1e-6)
    torch.testing.assert_close(got[:num_tokens], expected, rtol=2e-5, atol=2e-5)


def test_prefill_only_and_decode_only_steps():
    for seqs in ([(0, 33), (9, 64)], [(3, 1), (200, 1), (64, 1)]):
        expected, got, _, _ = run_both(make_step(seqs, 4, 2, 32, 8))
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_bfloat16_tracks_the_torch_backend():
    expected, got, ref_cache, our_cache = run_both(make_step(MIXED, 8, 2, 64, 16,
                                                             dtype=torch.bfloat16))
    torch.testing.assert_close(our_cache, ref_cache, **bf16_close())
    if DEVICE == "cuda":  # Triton 3.9's interpreter gets bfloat16 dot products wrong
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_and_key_norms_run_in_the_rotary_pass(dtype):
    """Qwen3's per-head norms, fused into the rotary pass, against norming first."""
    qk, v, freqs, cache, meta = make_step(MIXED, 8, 2, 64, 16, dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    weights = [(1 + 0.3 * torch.randn(64, generator=gen)).to(DEVICE, dtype) for _ in "qk"]
    norms = [RMSNorm(64, 1e-6, dtype).to(DEVICE) for _ in "qk"]
    for norm, weight in zip(norms, weights, strict=True):
        norm.weight.copy_(weight)
    normed = torch.cat([norms[0](qk[:, :8]), norms[1](qk[:, 8:])], dim=1)
    ref_cache, our_cache = cache.clone(), cache.clone()
    expected = TorchPagedAttention().forward(normed, v, freqs, ref_cache, meta, 0.3)
    got = TritonPagedAttention(num_programs=8).forward(qk.clone(), v, freqs, our_cache, meta,
                                                       0.3, QKNorm(*weights, 1e-6))
    if dtype == torch.float32:
        torch.testing.assert_close(our_cache, ref_cache, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)
    else:
        # A norm rounded apart moves a rotated pair's small part by a few units in the last
        # place of the large one: bounded in absolute terms, at the values' scale (~1).
        torch.testing.assert_close(our_cache, ref_cache, rtol=2 ** -6, atol=2 ** -5)
        if DEVICE == "cuda":  # Triton 3.9's interpreter gets bfloat16 dot products wrong
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (16, 1, 128)])
def test_decode_splits_agree_and_an_empty_row_gives_zero(num_heads, num_kv_heads, head_dim):
    group = num_heads // num_kv_heads
    if group == 16:  # the merge then takes the group's heads in two loads
        assert merge_heads(group, 7, head_dim) == 8
    qk, _, _, cache, meta = make_step([(90, 1), (300, 1), (1, 1)], num_heads, num_kv_heads,
                                      head_dim, 16)
    q = qk[:, :num_heads]
    seq_lens = meta.seq_lens.clone()
    seq_lens[2] = 0  # a padding row, as in a replayed CUDA graph
    one = paged_decode_attention(q, cache, meta.block_tables, seq_lens, 0.3, None, 1)
    many = paged_decode_attention(q, cache, meta.block_tables, seq_lens, 0.3, None, 7)
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(one[2]) == 0 and torch.isfinite(one).all()
    assert not split_counters(q.device).any()  # the last split of each pair re-armed it
    again = paged_decode_attention(q, cache, meta.block_tables, seq_lens, 0.3, None, 7)
    assert torch.equal(again, many)


def test_a_negative_slot_writes_nothing():
    qk, v, freqs, cache, meta = make_step([(4, 1), (8, 1)], 4, 2, 32, 4)
    meta.slot_mapping[1] = -1
    before = cache.clone()
    TritonPagedAttention(num_programs=4).forward(qk, v, freqs, cache, meta, 0.3)
    written = (cache != before).any(dim=-1).nonzero().tolist()
    assert {tuple(w[2:]) for w in written} == {(int(meta.block_tables[0, 1]), 0)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_shapes_on_cuda():
    """llama3-8b's heads, long contexts, bfloat16, many splits."""
    seqs = [(1000, 1)] * 24 + [(3000, 1)] * 8 + [(0, 512), (2048, 256)]
    expected, got, ref_cache, our_cache = run_both(
        make_step(seqs, 32, 8, 128, 16, dtype=torch.bfloat16), scale=128 ** -0.5)
    torch.testing.assert_close(our_cache, ref_cache, **bf16_close())
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_softcapped_scores_match_the_torch_backend():
    """Gemma 2's cap, softcap * tanh(score / softcap), in the decode and varlen kernels, on
    scores several times the cap; and in the asynchronized softmax, which the cap keeps
    within its range."""
    step = make_step(MIXED, 4, 2, 32, 16, window=24)
    expected, got, _, _ = run_both(step, scale=1.0, softcap=5.0)
    qk, v, freqs, cache, meta = step
    uncapped = TorchPagedAttention().forward(qk.clone(), v, freqs, cache.clone(), meta, 1.0)
    assert not torch.allclose(expected, uncapped, atol=0.1)  # the cap changes the output
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)
    qk, _, _, cache, meta = make_step([(90, 1), (300, 1)], 4, 2, 32, 16, seed=3)
    q = qk[:, :4].clone()
    exact = paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 1.0, None, 4,
                                   softcap=5.0)
    unified = paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 1.0, None, 4,
                                     unified_max=5.0, softcap=5.0)
    torch.testing.assert_close(unified, exact, rtol=1e-5, atol=1e-5)


# The interpreter warns when the unified attempt overflows, which is what the fallback is for.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("unified_max,shift", [(0.0, 0.0), (2.0, 0.0), (0.0, 500.0)])
def test_unified_max_softmax_matches_the_exact_one(unified_max, shift):
    """Around the scores it is exact up to rounding; with scores pushed 500 above the unified
    maximum (exp would overflow) every split falls back to the exact computation."""
    qk, _, _, cache, meta = make_step([(90, 1), (300, 1), (17, 1)], 8, 2, 64, 16, seed=3)
    q = qk[:, :8].clone()
    if shift:  # make every score about `shift`: q . k = shift / scale on a constant key
        cache[0].fill_(1.0)
        q[:] = shift / (0.3 * 64)
    exact = paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 0.3, None, 4)
    unified = paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 0.3, None, 4,
                                     unified_max=unified_max)
    assert torch.isfinite(unified).all()
    torch.testing.assert_close(unified, exact, rtol=1e-5, atol=1e-5)
