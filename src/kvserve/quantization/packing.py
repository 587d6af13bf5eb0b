"""Bit packing of quantized weights in the layouts hub checkpoints use.

GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format: gptq`): `qweight` [in * bits / 32, out]
int32 packs the integers along the input dimension, `qzeros` [groups, out * bits / 32]
packs each group's zero points along the output dimension, storing zero - 1; `scales`
[groups, out] float16; `g_idx` [in] int32, the group of each input channel. Values are
laid out as one little-endian bit stream per column, which for 3 bits lets a value straddle
two words exactly as AutoGPTQ writes it.

AWQ (`version: gemm`): `qweight` [in, out * bits / 32] and `qzeros` [groups, out * bits / 32]
both pack along the output dimension, eight 4-bit values per word in the order 0 2 4 6 1 3
5 7, zeros stored as they are; `scales` [groups, out].
"""

from __future__ import annotations

import sys

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # logical value i sits in nibble AWQ_ORDER.index(i)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[n, m] integers in [0, 2^bits) -> [n * bits / 32, m] int32: each column a bit stream,
    value i at bits i * bits .. (i + 1) * bits - 1. Packed along the rows of the transpose
    (the [out, in] layout layers keep), whose words then transpose for a fraction of the
    values' cost."""
    n, m = values.shape
    if (n * bits) % 32:
        raise ValueError(f"{n} values of {bits} bits do not fill whole 32-bit words")
    rows = values.t().contiguous()
    return torch.cat([pack_streams(chunk, bits) for chunk in rows.split(_ROWS_PER_PASS)]
                     ).t().contiguous()


_ROWS_PER_PASS = 1024  # bounds the int64 temporaries of a large LM head


def pack_streams(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[m, n] integers in [0, 2^bits) -> [m, n * bits / 32] int32, each row one
    little-endian bit stream (the inverse of `unpack_streams`)."""
    m, n = values.shape
    if 32 % bits == 0:  # no value straddles two words: or whole values into place
        per_word = 32 // bits
        slots = values.view(m, n // per_word, per_word)
        words = slots[..., 0].to(torch.int64, copy=True)  # never the caller's values
        for i in range(1, per_word):
            words |= slots[..., i].long() << (i * bits)
    else:
        stream = (values.long().unsqueeze(-1) >> torch.arange(bits, device=values.device)) & 1
        words = (stream.reshape(m, -1, 32) << torch.arange(32, device=values.device)).sum(-1)
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack_rows`: [w, m] int32 -> [w * 32 / bits, m] uint8 (bits <= 8, as
    all quantized weights are: a quarter of the memory of int32 for a large LM head), as the
    transpose of a contiguous [m, w * 32 / bits]: layers keep the [out, in] layout, and
    transposing the words costs a fraction of transposing the values."""
    return unpack_streams(words.t().contiguous(), bits).t()


def unpack_streams(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[m, w] int32, each row one little-endian bit stream -> [m, w * 32 / bits] uint8."""
    m, w = words.shape
    if 8 % bits == 0:  # whole values per byte: shift them out of the stream's bytes, in uint8
        # (from int32 words, with an int32 per value, a 4-bit LM head unpacked 3.5x slower)
        stream = words.contiguous().view(torch.uint8).view(m, w, 4)
        if sys.byteorder == "big":
            stream = stream.flip(-1)
        shifts = torch.arange(8 // bits, dtype=torch.uint8, device=words.device) * bits
        values = (stream.unsqueeze(-1) >> shifts) & (2**bits - 1)
        return values.reshape(m, w * 32 // bits)
    unsigned = words.long() & 0xFFFFFFFF
    stream = (unsigned.unsqueeze(-1) >> torch.arange(32, device=words.device)) & 1
    stream = stream.reshape(m, -1, bits)
    return (stream << torch.arange(bits, device=words.device)).sum(dim=-1).to(torch.uint8)


def pack_gptq(intweight: torch.Tensor, zeros: torch.Tensor, bits: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """intweight [out, in] and zeros [groups, out] -> (qweight, qzeros) in GPTQ's layout."""
    return pack_rows(intweight.t(), bits), pack_rows((zeros - 1).t(), bits).t().contiguous()


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int, zero_offset: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, qzeros) -> intweight [out, in] and zeros [groups, out]; `zero_offset` is 1
    for files that store zero - 1 (checkpoint_format gptq), 0 for gptq_v2."""
    zeros = unpack_streams(qzeros, bits).long() + zero_offset
    return unpack_rows(qweight, bits).t(), zeros


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ's [rows, out / 8] int32 of 4-bit values -> [rows, out] uint8 in logical order."""
    shifts = 4 * torch.tensor([AWQ_ORDER.index(i) for i in range(8)], dtype=torch.int32)
    logical = (words.unsqueeze(-1) >> shifts) & 0xF  # logical value i from its nibble
    return logical.reshape(words.shape[0], -1).to(torch.uint8)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_awq`, for tests: [rows, out] 4-bit values -> [rows, out / 8]."""
    rows = values.long().reshape(values.shape[0], -1, 8)[..., AWQ_ORDER]
    words = (rows << (4 * torch.arange(8))).sum(dim=-1)
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)
