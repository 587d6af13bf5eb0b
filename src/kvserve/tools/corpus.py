"""Local text for the test models: the Python standard library's sources, which every
machine with Python has. Split by file, in path order: every 20th file is held out for
evaluation, the rest is for training."""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path
from typing import Any

import torch

HELD_OUT_EVERY = 20
BYTES_PER_TOKEN = 4  # about, for the byte-level BPE on Python source: sizes the text read


@functools.cache
def stdlib_files() -> tuple[Path, ...]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return tuple(sorted(f for f in stdlib.rglob("*.py") if "site-packages" not in f.parts))


def split_files(split: str) -> list[Path]:
    """The files of `split`: "train" or "heldout"."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, got {split!r}")
    held_out = split == "heldout"
    return [f for i, f in enumerate(stdlib_files()) if (i % HELD_OUT_EVERY == 0) == held_out]


def read_texts(files: list[Path], max_bytes: int) -> list[str]:
    """The files' text in order, up to about `max_bytes` (whole files)."""
    texts, total = [], 0
    for file in files:
        if total >= max_bytes:
            break
        text = file.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
    return texts


def corpus_tokens(tokenizer: Any, split: str, max_tokens: int) -> torch.Tensor:
    """About `max_tokens` token ids of `split`, files joined by the end-of-text token."""
    texts = read_texts(split_files(split), max_tokens * BYTES_PER_TOKEN)
    separator = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids += encoded + [separator]
    return torch.tensor(ids[:max_tokens])


def heldout_windows(tokenizer: Any, context: int, num_windows: int) -> torch.Tensor:
    """The first `num_windows` (or as many as the split holds) non-overlapping windows of
    `context` tokens of the held-out split: [windows, context]. What training reports and
    `kvserve eval perplexity` scores."""
    data = corpus_tokens(tokenizer, "heldout", context * num_windows)
    return data[:len(data) // context * context].view(-1, context)
