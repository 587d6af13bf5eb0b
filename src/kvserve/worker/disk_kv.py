"""The disk tier of prefix-cache KV: one file per block, named by the block's hash, in a
folder per model identity.

A file is written under a temporary name, flushed to disk and renamed into place, so a
process killed mid-write leaves at worst a temporary file, which the next start deletes.
Its header holds the payload's length and SHA-256: a start drops files of the wrong size,
and every read checks the checksum, so a damaged file is deleted and its block computed
again rather than served. The folder is named by a hash of the model's identity (its
config, the weight files' names, sizes and first and last MiB, the dtype and the KV block
layout; and the tensor-parallel rank), so no KV of another model, dtype, block size or
rank is ever read back.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import torch

from kvserve.config import ModelConfig

MAGIC = b"kvserve-kv-1\n"
_HEADER = struct.Struct("<Q32s")  # payload bytes, SHA-256 of the payload
_SUFFIX = ".kv"
_SAMPLE = 1 << 20


def model_identity(model: ModelConfig, block_size: int, rank: int = 0, num_ranks: int = 1
                   ) -> str:
    """A name for everything that decides what a KV block of this engine holds (under tensor
    parallelism, of this rank: its KV heads' part)."""
    digest = hashlib.sha256()
    folder = Path(model.path)
    digest.update((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as f:
            digest.update(f.read(_SAMPLE))
            f.seek(max(size - _SAMPLE, 0))
            digest.update(f.read(_SAMPLE))
    layout = (model.dtype, block_size, model.num_layers, model.num_kv_heads, model.head_dim)
    digest.update(repr(layout if num_ranks == 1 else (*layout, rank, num_ranks)).encode())
    return digest.hexdigest()[:32]


class DiskKVStore:
    def __init__(self, root: str | os.PathLike, identity: str, block_bytes: int) -> None:
        self.folder = Path(root) / identity
        self.folder.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.num_read = self.num_damaged = 0

    def _path(self, block_hash: bytes) -> Path:
        return self.folder / (block_hash.hex() + _SUFFIX)

    def scan(self) -> list[bytes]:
        """The hashes of the complete blocks on disk, least recently written first; deletes
        temporary files left by a killed writer and files of the wrong size."""
        found = []
        file_bytes = len(MAGIC) + _HEADER.size + self.block_bytes
        for path in self.folder.iterdir():
            complete = path.suffix == _SUFFIX and len(path.stem) == 64
            if not complete or path.stat().st_size != file_bytes:
                path.unlink(missing_ok=True)
            else:
                found.append((path.stat().st_mtime, bytes.fromhex(path.stem)))
        return [block_hash for _, block_hash in sorted(found)]

    def write(self, block_hash: bytes, block: torch.Tensor) -> None:
        payload = block.contiguous().view(torch.uint8).numpy().tobytes()
        assert len(payload) == self.block_bytes
        path = self._path(block_hash)
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        with temporary.open("wb") as f:
            f.write(MAGIC + _HEADER.pack(len(payload), hashlib.sha256(payload).digest()))
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)

    def read_into(self, block_hash: bytes, block: torch.Tensor) -> bool:
        """Fills `block` from its file; False (and the file deleted) when it is missing or
        damaged."""
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            return False
        head = len(MAGIC) + _HEADER.size
        if len(data) == head + self.block_bytes and data.startswith(MAGIC):
            length, checksum = _HEADER.unpack_from(data, len(MAGIC))
            payload = memoryview(data)[head:]
            if length == self.block_bytes and hashlib.sha256(payload).digest() == checksum:
                flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                block.copy_(flat.view(block.dtype).view(block.shape))
                self.num_read += 1
                return True
        self.num_damaged += 1
        path.unlink(missing_ok=True)
        return False

    def delete(self, block_hash: bytes) -> None:
        self._path(block_hash).unlink(missing_ok=True)
