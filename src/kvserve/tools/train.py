"""Trains a freshly made checkpoint on local text, so that its outputs mean something:
perplexity, quantization error and sampling quality are meaningless on random weights.

The data is the training split of the standard library's sources (`corpus.py`), as token
windows drawn from one seeded generator; the optimizer is AdamW with a warm-up and a cosine
decay. With the same seed, steps and thread count, the weights come out the same.

Given a teacher, the data is instead the teacher's greedy continuations of short training
windows, and the loss falls on the continuations only (sequence-level distillation): a
speculative draft is worth what it agrees with its target, and a small model trained on the
same text as its target agrees with it far less often than one trained on its outputs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvserve.tools.corpus import corpus_tokens, heldout_windows

DISTILL_PROMPT_LEN = 64  # tokens of training text that each teacher continuation follows
DISTILL_EPOCHS = 3  # how many times training sees each continuation, about
AGREEMENT_WINDOWS = 16  # held-out windows whose continuations score the agreement


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
    teacher: str | None = None
    # Share of the teacher's greedy tokens on held-out windows that the model predicts.
    teacher_agreement: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def train(folder: Path, steps: int, seed: int, batch_size: int = 16, seq_len: int = 256,
          learning_rate: float = 3e-3, teacher: Path | None = None, progress: bool = False
          ) -> tuple[dict[str, torch.Tensor], TrainingReport]:
    """Trains the float32 checkpoint in `folder`, on the corpus or on `teacher`'s
    continuations; returns its trained tensors under their checkpoint names (a tied LM head
    left out) and a report with the held-out loss (and the agreement with the teacher)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from transformers.core_model_loading import revert_weight_conversion

    start = time.perf_counter()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    gen = torch.Generator().manual_seed(seed)
    data = corpus_tokens(tokenizer, "train", steps * batch_size * seq_len)
    if teacher is None:
        batches = corpus_batches(data, steps, batch_size, seq_len, gen)
    else:  # one generation for the training data and the held-out windows that score it
        prompts = random_windows(data, max(batch_size, steps * batch_size // DISTILL_EPOCHS),
                                 DISTILL_PROMPT_LEN, gen)
        heldout_prompts = heldout_windows(tokenizer, DISTILL_PROMPT_LEN, AGREEMENT_WINDOWS)
        windows = teacher_continuations(teacher, tokenizer, torch.cat([prompts, heldout_prompts]),
                                        seq_len, progress)
        windows, heldout_continuations = windows[:len(prompts)], windows[len(prompts):]
        batches = distillation_batches(windows, steps, batch_size, gen)
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
    losses = []
    for input_ids, labels in tqdm(batches, total=steps, desc="training", unit=" steps",
                                  disable=not progress):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr_schedule.step()
        losses.append(loss.item())
    heldout = heldout_loss(model, tokenizer, seq_len)
    agreement = None if teacher is None else round(
        teacher_agreement(model, heldout_continuations), 4)
    tail = losses[-max(1, steps // 10):]
    report = TrainingReport(steps, batch_size, seq_len, learning_rate,
                            round(sum(tail) / len(tail), 4), round(heldout, 4),
                            round(math.exp(heldout), 2), round(time.perf_counter() - start, 1),
                            None if teacher is None else str(teacher), agreement)
    # transformers holds a mixture's experts stacked; the checkpoint names each one's.
    tensors = {name: t.detach()
               for name, t in revert_weight_conversion(model, model.state_dict()).items()
               if not (name == "lm_head.weight" and model.config.tie_word_embeddings)}
    return tensors, report


Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]  # (input ids, labels), [batch, seq_len]


def corpus_batches(data: torch.Tensor, steps: int, batch_size: int, seq_len: int,
                   gen: torch.Generator) -> Batches:
    """`steps` batches of windows of the training tokens `data`, every token a label."""
    for _ in range(steps):
        batch = random_windows(data, batch_size, seq_len, gen)
        yield batch, batch


def distillation_batches(windows: torch.Tensor, steps: int, batch_size: int,
                         gen: torch.Generator) -> Batches:
    """`steps` batches of teacher continuations, labelled past their prompts only."""
    for _ in range(steps):
        batch = windows[torch.randint(0, len(windows), (batch_size,), generator=gen)]
        labels = batch.clone()
        labels[:, :DISTILL_PROMPT_LEN] = -100  # the loss's ignore index
        yield batch, labels


def random_windows(data: torch.Tensor, num_windows: int, seq_len: int,
                   gen: torch.Generator) -> torch.Tensor:
    if len(data) <= seq_len + 1:
        raise ValueError(f"seq_len ({seq_len}) must be below the corpus size ({len(data)})")
    starts = torch.randint(0, len(data) - seq_len, (num_windows,), generator=gen)
    return torch.stack([data[s:s + seq_len] for s in starts.tolist()])


def teacher_continuations(teacher: Path, tokenizer: Any, prompts: torch.Tensor, seq_len: int,
                          progress: bool) -> torch.Tensor:
    """`prompts` [n, DISTILL_PROMPT_LEN] continued to `seq_len` tokens by the teacher's greedy
    decoding, in float32 whatever dtype serving would pick on this CPU: [n, seq_len]."""
    from kvserve import LLM, SamplingParams

    llm = LLM(str(teacher), dtype="float32", max_model_len=seq_len)
    if llm.get_tokenizer().get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"distill_from: {teacher}'s tokenizer differs from the model's "
                         f"({len(tokenizer)} tokens); a draft needs its target's tokenizer")
    params = SamplingParams(temperature=0.0, max_tokens=seq_len - prompts.shape[1],
                            ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts.tolist()], params,
                           use_tqdm=progress)
    return torch.cat([prompts, torch.tensor([o.outputs[0].token_ids for o in outputs])], 1)


@torch.inference_mode()
def teacher_agreement(model: torch.nn.Module, continuations: torch.Tensor) -> float:
    """Share of the continuations' tokens that are `model`'s greedy prediction: the share of
    greedy drafts its teacher would accept."""
    model.eval()
    predicted = model(input_ids=continuations).logits[:, DISTILL_PROMPT_LEN - 1:-1].argmax(-1)
    return float((predicted == continuations[:, DISTILL_PROMPT_LEN:]).float().mean())


@torch.inference_mode()
def heldout_loss(model: torch.nn.Module, tokenizer: Any, seq_len: int,
                 num_windows: int = 64) -> float:
    """Mean next-token loss on the first windows of the held-out split: the same windows as
    `kvserve eval perplexity` scores by default."""
    windows = heldout_windows(tokenizer, seq_len, num_windows)
    model.eval()
    return float(model(input_ids=windows, labels=windows).loss)
