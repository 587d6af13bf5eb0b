"""The mixture-of-experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE.

A router scores every expert for each token; the token's output is the sum of its top-k
experts' outputs, weighted by their softmax probabilities (rescaled to sum to 1 where the
model says so). Each expert runs once per step, over the rows routed to it, so a decode
step streams only the experts its tokens picked: a top-8-of-128 model reads a sixteenth of
its expert weights for one token.

Among tensor-parallel ranks every expert is split like a dense MLP (its columns); the router
is whole on each rank, so all ranks route alike, and the experts' partial outputs are summed
over the ranks once, after they are added up.

On CPU, where the C++ kernels run every layer of the block, the whole block is one call to
them (`MoEWeights` in kvserve/csrc/llama_decode.cpp, which the decode stack runs too): the
same ops in the same order, so the same bits, without the Python that issued five calls an
expert.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch import nn

from kvserve.config import MoEConfig
from kvserve.cpp_extension import cpu_kernels
from kvserve.layers.cpu_weights import linear_weights, runs_on_cpu_kernels
from kvserve.layers.fused import cpu_fused_kernels
from kvserve.layers.linear import Linear
from kvserve.models.mlp import MLP
from kvserve.worker.tensor_parallel import all_reduce, tp_group


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = Linear(hidden_size, [moe.num_experts], False, dtype)
        self.experts = nn.ModuleList(
            MLP(hidden_size, moe.intermediate_size, dtype, reduced=False)
            for _ in range(moe.num_experts))
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = MLP(hidden_size, shared, dtype, reduced=False) if shared else None
        self.shared_expert_gate = Linear(hidden_size, [1], False, dtype) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        on_kernels = self.on_cpu_kernels if cpu_fused_kernels(x) is not None else None
        out = on_kernels(x, x.shape[-1]) if on_kernels is not None else self._experts(x)
        if tp_group().size > 1:
            all_reduce(out)
        return out

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        """Routing, the routed experts and the shared expert, op by op."""
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        out = self._routed(x, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    @functools.cached_property
    def on_cpu_kernels(self) -> object | None:
        """The block as the C++ kernels run it (routing and shared expert included), where
        they are built and run every layer of the block, else None: taken once, after
        loading chose the layers' kernels, for the eager forward and the decode stack alike."""
        kernels = cpu_kernels()
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if kernels is None or not all(map(runs_on_cpu_kernels, linears)):
            return None
        shared, shared_gate = self.shared_expert, self.shared_expert_gate
        return kernels.MoEWeights(
            linear_weights(self.gate, kernels),
            [linear_weights(e.gate_up_proj, kernels) for e in self.experts],
            [linear_weights(e.down_proj, kernels) for e in self.experts],
            self.top_k, self.experts[0].down_proj.in_features, self.renormalize,
            *((None, None, None, 0) if shared is None or shared_gate is None else (
                linear_weights(shared.gate_up_proj, kernels),
                linear_weights(shared.down_proj, kernels),
                linear_weights(shared_gate, kernels), shared.down_proj.in_features)))

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
                ) -> torch.Tensor:
        """Sum over each row's experts of weight x expert(row): the (row, expert) pairs
        sorted by expert, each expert's rows gathered into one matmul. Reading the counts
        back is the one host sync of the block."""
        pairs = experts.flatten()
        order = torch.argsort(pairs, stable=True)
        rows = order // self.top_k
        scales = weights.flatten()[order].unsqueeze(1)
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                picked = rows[start:start + count]
                out.index_add_(0, picked, expert(x[picked]) * scales[start:start + count])
                start += count
        return out

    def token_linears(self, rows: int = 1) -> Iterator[tuple[Linear, float]]:
        """The layers `rows` tokens' pass multiplies through, each with how many times: the
        router, the shared expert, and the weights of the experts they pick (as the first
        one's): top-k for one token; for more, as many as that many tokens routed uniformly
        at random pick on average."""
        yield self.gate, 1
        for module in (self.shared_expert, self.shared_expert_gate):
            if module is not None:
                yield from ((m, 1) for m in module.modules() if isinstance(m, Linear))
        experts = len(self.experts)
        picked = self.top_k if rows == 1 else experts * (1 - (1 - self.top_k / experts) ** rows)
        yield from ((m, picked) for m in self.experts[0].modules() if isinstance(m, Linear))


def route(logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax weights of each row's top_k experts, in the logits' dtype (rescaled to sum
    to 1 with `renormalize`), and those experts, both [rows, top_k]. On CPU, one C++ call
    (csrc/moe_routing.cpp) that the decode stack makes too, where the torch ops below cost
    more than the router's matmul."""
    kernels = cpu_fused_kernels(logits)
    if kernels is not None:
        return kernels.route_experts(logits.contiguous(), top_k, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts
