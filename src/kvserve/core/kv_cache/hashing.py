"""Content hashes of full KV blocks, chained so that one hash names a block's whole prefix.

Two blocks share a hash only when every token up to and including theirs is the same and so
are the request's extra keys (its `cache_salt` and LoRA adapter): those go into the first
block's hash, and the chain carries them to every later one. SHA-256 keeps collisions out of
reach, which matters once different tenants' salts are all that keeps their KV apart.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int],
               extra_keys: tuple[str, ...] = ()) -> BlockHash:
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        digest.update(b"\0" + key.encode())
    return digest.digest()


def salt_keys(cache_salt: str | None) -> tuple[str, ...]:
    return () if cache_salt is None else ("salt:" + cache_salt,)


def request_extra_keys(request: Request) -> tuple[str, ...]:
    """What besides the tokens changes this request's KV, or whom it may be shared with. A
    blended prompt's KV is an approximation of its prefill's: it is only ever shared with
    prompts blended from the same segments."""
    keys = salt_keys(request.cache_salt)
    if request.lora_name is not None:
        keys = (*keys, f"lora:{request.lora_name}#{request.lora_load}")
    if request.blend_key is not None:
        keys = (*keys, request.blend_key)
    return keys


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extends `request.block_hashes` to cover every full block of its tokens so far."""
    hashes = request.block_hashes
    for index in range(len(hashes), request.num_tokens // block_size):
        tokens = request.token_ids_slice(index * block_size, (index + 1) * block_size)
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens,
                                 request_extra_keys(request) if index == 0 else ()))
    return hashes


def chunk_block_hashes(token_ids: list[int], block_size: int,
                       extra_keys: tuple[str, ...] = ()) -> list[BlockHash]:
    """The hashes of a chunk's KV blocks computed on its own from position 0: its full
    blocks hash as a prompt of those tokens would (so the two share KV), and a partial last
    block gets a hash of its own, which no prompt's full block can have."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids), block_size):
        tokens = token_ids[start:start + block_size]
        keys = extra_keys if start == 0 else ()
        if len(tokens) < block_size:
            keys = (*keys, "partial")
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens, keys))
    return hashes


def prompt_block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None
                        ) -> list[BlockHash]:
    """The hashes a prompt's full blocks will have on any engine, for routing it before it
    reaches one."""
    request = Request("", token_ids, SamplingParams(), cache_salt=cache_salt)
    return update_block_hashes(request, block_size)
