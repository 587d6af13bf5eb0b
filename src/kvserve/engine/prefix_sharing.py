"""Global prefix sharing for offline batches (BatchLLM): an admission order in which requests
that share a prompt head run together.

A trie over the prompts' full KV blocks finds every shared head of the batch up front. Its
depth-first order keeps each group adjacent, so the first request computes the shared KV,
the rest hit it while it is hot, and the group releases it once done; interleaved groups
instead evict each other's heads and compute them again. Among the requests and subgroups
under one head, those with the most tokens to decode per prompt token go first, so that
their decodes run beside the later requests' prefill chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _Node:
    children: dict[tuple, _Node] = field(default_factory=dict)
    requests: list[int] = field(default_factory=list)  # whose full blocks end here
    best_ratio: float = 0.0  # the highest decode-to-prompt ratio in this subtree


def sharing_order(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                  block_size: int, salts: Sequence[str | None] | None = None) -> list[int]:
    """The indices of `prompts` in the order to admit them. Requests with different salts
    never share KV, so they never share a group either."""
    ratios = [m / len(p) for p, m in zip(prompts, max_tokens, strict=True)]
    root = _Node()
    preorder = [root]
    for index, prompt in enumerate(prompts):
        keys = [("salt", salts[index] if salts else None)]
        keys += [tuple(prompt[start:start + block_size])
                 for start in range(0, len(prompt) - block_size + 1, block_size)]
        node = root
        for key in keys:
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node()
                preorder.append(child)
            node = child
        node.requests.append(index)
    for node in reversed(preorder):  # children before parents
        node.best_ratio = max([ratios[i] for i in node.requests]
                              + [c.best_ratio for c in node.children.values()], default=0.0)
    order: list[int] = []
    stack: list[_Node | int] = [root]
    while stack:
        item = stack.pop()
        if isinstance(item, int):
            order.append(item)
            continue
        entries: list[tuple[float, _Node | int]] = [(ratios[i], i) for i in item.requests]
        entries += [(c.best_ratio, c) for c in item.children.values()]
        entries.sort(key=lambda entry: -entry[0])  # stable: ties keep the callers' order
        stack.extend(entry for _, entry in reversed(entries))
    return order
