"""Trains a freshly made checkpoint on local text, so that its outputs mean something:
perplexity, quantization error and sampling quality are meaningless on random weights.

The data is the training split of the standard library's sources (`corpus.py`), as token
windows drawn from one seeded generator; the optimizer is AdamW with a warm-up and a cosine
decay. With the same seed, steps and thread count, the weights come out the same.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvserve.tools.corpus import corpus_tokens, heldout_windows


@dataclass(frozen=True)
class TrainingReport:
    steps: int
    batch_size: int
    seq_len: int
    learning_rate: float
    train_loss: float  # mean over the last tenth of the steps
    heldout_loss: float
    heldout_perplexity: float
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def train(folder: Path, steps: int, seed: int, batch_size: int = 16, seq_len: int = 256,
          learning_rate: float = 3e-3, progress: bool = False
          ) -> tuple[dict[str, torch.Tensor], TrainingReport]:
    """Trains the float32 checkpoint in `folder`; returns its trained tensors under their
    checkpoint names (a tied LM head left out) and a report with the held-out loss."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    start = time.perf_counter()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    data = corpus_tokens(tokenizer, "train", steps * batch_size * seq_len)
    if len(data) <= seq_len + 1:
        raise ValueError(f"seq_len ({seq_len}) must be below the corpus size ({len(data)})")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:  # linear warm-up, then cosine down to a tenth
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * done))

    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in tqdm(range(steps), desc="training", unit=" steps", disable=not progress):
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=gen)
        batch = torch.stack([data[s:s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr_schedule.step()
        losses.append(loss.item())
    heldout = heldout_loss(model, tokenizer, seq_len)
    tail = losses[-max(1, steps // 10):]
    report = TrainingReport(steps, batch_size, seq_len, learning_rate,
                            round(sum(tail) / len(tail), 4), round(heldout, 4),
                            round(math.exp(heldout), 2), round(time.perf_counter() - start, 1))
    tensors = {name: t.detach() for name, t in model.state_dict().items()
               if not (name == "lm_head.weight" and model.config.tie_word_embeddings)}
    return tensors, report


@torch.inference_mode()
def heldout_loss(model: torch.nn.Module, tokenizer: Any, seq_len: int,
                 num_windows: int = 64) -> float:
    """Mean next-token loss on the first windows of the held-out split: the same windows as
    `kvserve eval perplexity` scores by default."""
    windows = heldout_windows(tokenizer, seq_len, num_windows)
    model.eval()
    return float(model(input_ids=windows, labels=windows).loss)
