"""Synthetic workloads: random token prompts with fixed or uniformly drawn lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def fixed(num_prompts: int, prompt_len: int, output_len: int, vocab_size: int,
          seed: int = 0) -> Workload:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab_size, (prompt_len,), generator=gen).tolist()
               for _ in range(num_prompts)]
    return Workload(f"fixed {num_prompts}x{prompt_len}->{output_len}", prompts,
                    [output_len] * num_prompts)


def variable(num_prompts: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
             vocab_size: int, seed: int = 0) -> Workload:
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(prompt_range[0], prompt_range[1] + 1, (num_prompts,),
                                generator=gen).tolist()
    output_lens = torch.randint(output_range[0], output_range[1] + 1, (num_prompts,),
                                generator=gen).tolist()
    prompts = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    return Workload(f"variable {num_prompts}x[{prompt_range[0]},{prompt_range[1]}]"
                    f"->[{output_range[0]},{output_range[1]}]", prompts, output_lens)


def shared_prefix(num_groups: int, group_size: int, prefix_len: int, suffix_len: int,
                  output_len: int, vocab_size: int, seed: int = 0) -> Workload:
    """Groups of prompts that share a head (a system prompt, few-shot examples, a document)
    and differ in a short tail, shuffled so that the groups interleave."""
    if prefix_len + suffix_len < 1:
        raise ValueError("--prefix-len plus --suffix-len must be >= 1: the prompts would be "
                         "empty")
    gen = torch.Generator().manual_seed(seed)
    heads = [torch.randint(3, vocab_size, (prefix_len,), generator=gen).tolist()
             for _ in range(num_groups)]
    prompts = [head + torch.randint(3, vocab_size, (suffix_len,), generator=gen).tolist()
               for head in heads for _ in range(group_size)]
    order = torch.randperm(len(prompts), generator=gen).tolist()
    return Workload(f"{num_groups} groups x {group_size}, {prefix_len} shared + {suffix_len} "
                    f"-> {output_len}", [prompts[i] for i in order],
                    [output_len] * len(prompts))


def alternating(num_prompts: int, prompt_len: int, long_output: int, short_output: int,
                vocab_size: int, seed: int = 0) -> Workload:
    """Long and short generations in turn: round-robin over two replicas sends every long
    one to the first, a load that only moving requests can even out."""
    work = fixed(num_prompts, prompt_len, 0, vocab_size, seed)
    outputs = [long_output if i % 2 == 0 else short_output for i in range(num_prompts)]
    return Workload(f"{num_prompts} x {prompt_len} -> {long_output} and {short_output} in "
                    "turn", work.prompts, outputs)


@dataclass(frozen=True)
class ChatScript:
    """Conversations replayed turn by turn: one system prompt shared by every chat (as one
    application's users share it) and a user message per chat and turn."""

    system: str
    user_messages: list[list[str]]  # [chat][turn]


def chat_script(num_chats: int, num_turns: int, system_words: int, user_words: int,
                seed: int = 0) -> ChatScript:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
             for _ in range(500)]

    def text(num_words: int) -> str:
        return " ".join(rng.choice(words) for _ in range(num_words))

    system = text(system_words)
    return ChatScript(system, [[text(user_words) for _ in range(num_turns)]
                               for _ in range(num_chats)])
