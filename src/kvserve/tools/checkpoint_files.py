"""Writing Hugging Face checkpoint files: safetensors weights, sharded with an index past a
size, and JSON."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm


def write_weights(out: Path, tensors: Iterator[tuple[str, torch.Tensor]],
                  dtype: torch.dtype | None, max_shard_bytes: int, progress: bool) -> None:
    """Writes `tensors` as `model.safetensors`, or as shards of at most `max_shard_bytes`
    with HF's index, replacing any weights already there. Floating tensors are cast to
    `dtype` (None keeps each one's); integer tensors (packed quantized weights) never are."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    written: list[Path] = []
    weight_map: dict[str, int] = {}
    for name, tensor in tqdm(tensors, desc="weights", unit=" tensors", disable=not progress):
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            written.append(_save_shard(out, len(written), shards.pop()))
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        weight_map[name] = len(written)
        size += nbytes
        total += nbytes
    written.append(_save_shard(out, len(written), shards.pop()))
    for stale in out.glob("model*.safetensors*"):
        if stale not in written:
            stale.unlink()
    if len(written) == 1:
        written[0].rename(out / "model.safetensors")
        return
    count = len(written)
    final = [out / f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for src, dst in zip(written, final, strict=True):
        src.rename(dst)
    write_json(out / "model.safetensors.index.json", {
        "metadata": {"total_size": total},
        "weight_map": {name: final[i].name for name, i in weight_map.items()},
    })


def _save_shard(out: Path, index: int, tensors: dict[str, torch.Tensor]) -> Path:
    path = out / f"model.part{index}.safetensors.tmp"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
