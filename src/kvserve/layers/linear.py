"""Linear layers, loaded shard by shard and then prepared for the device's fastest GEMM.

While loading, the layer holds the checkpoint's tensors (`[out, in]`): fused projections
(QKV, gate+up) are one matrix whose row ranges come from separate tensors (`shard`s). After
loading, `prepare()` builds the execution form from them:
- on CPUs with AVX-512 or AVX2 (float32) or AVX512-BF16 (bfloat16), the weight packed in
  16-output blocks for the GEMM of `csrc/gemm.cpp`: 1.3x (float32) and 1.5x (bfloat16) faster
  than oneDNN's prepacked weight at batch 1 on AVX-512, 1.4-3x in float32 on an AVX2 EPYC,
  and within 10-20% of it at prefill sizes; where the CPU has AMX, bfloat16 runs on its tiles
  over the same blocks;
- on other CPUs with oneDNN, a prepacked oneDNN weight (float32 or bfloat16): 1.3-2.2x faster
  than `x @ W_t` in float32 for 1-64 rows on an AVX-512 machine, 2.5-4x in bfloat16 on one
  with AVX512-BF16, and never slower for prefill-sized inputs;
- on CUDA, the checkpoint's `[out, in]` layout with `F.linear`, which is what cuBLAS is
  tuned for; over a few rows, a split-K Triton kernel on the same weight where it times
  faster (`triton_linear.py`);
- elsewhere the contiguous transposed weight itself (`x @ W_t`), which on CPU is also up to 2x
  faster than `F.linear(x, W)` for 8-32 rows.
Shards of quantized checkpoints arrive as integers (`QuantizedWeight`: GPTQ, AWQ) or table
indices (`LutWeight`: SqueezeLLM) and run on the quantized kernel `quantization/kernels.py`
picks for the device, or, where none fits, as the dense weight they dequantize to.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.cpp_extension import cpu_kernels
from kvserve.layers.activation import silu_and_mul
from kvserve.lora.batch import LoRABatch
from kvserve.quantization.gptq import QuantizedWeight
from kvserve.quantization.kernels import QuantizedKernel, choose_kernel, num_programs
from kvserve.quantization.squeezellm import LutWeight
from kvserve.worker.forward_context import get_lora_batch
from kvserve.worker.tensor_parallel import all_reduce, rank_bounds, rank_slice, tp_group


@functools.cache
def _triton_linear() -> ModuleType | None:
    """The split-K kernel for a few rows on CUDA, where Triton is installed."""
    try:
        from kvserve.layers import triton_linear
    except ImportError:
        return None
    return triton_linear


@functools.cache
def _triton_lora() -> ModuleType | None:
    """The segmented LoRA kernels, where Triton is installed."""
    try:
        from kvserve.lora import triton_lora
    except ImportError:
        return None
    return triton_lora


def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks a weight of `dtype` on this CPU (bfloat16 needs AVX-512 or
    AVX-NE-CONVERT; elsewhere its reorder raises)."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


class Linear(nn.Module):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 dtype: torch.dtype, parallel: str | None = None) -> None:
        """`in_features` and `output_sizes` are this rank's; `parallel` says how a
        checkpoint's full tensors split among tensor-parallel ranks: "column" (by output
        rows: each shard's rows), "row" (by input columns; the outputs are then summed
        over the ranks) or "row_partial" (as "row", but the caller sums the outputs)."""
        super().__init__()
        self.in_features = in_features
        self.parallel = parallel
        self.output_sizes = list(output_sizes)
        out = sum(output_sizes)
        self.out_features = out
        self.weight = torch.empty(0, in_features, dtype=dtype)  # prepare() builds it here
        self.bias = torch.zeros(out, dtype=dtype) if bias else None
        self.shards: dict[int, torch.Tensor] = {}  # the weight's shards as loaded
        self.quantized: dict[int, QuantizedWeight | LutWeight] = {}  # or quantized ones
        self.kernel: QuantizedKernel | None = None  # chosen by prepare() for those shards
        self.gemm: ModuleType | None = None  # cpu_kernels(), where prepare() picks its GEMM
        # Until prepare(): then "blocked" (csrc/gemm.cpp), "packed" (oneDNN), "out_major"
        # (CUDA) or "transposed".
        self.form = "loading"
        # Every loaded adapter's A [in, slots x width] and scaled B [slots x width, out]
        # (see lora/batch.py), in the layer's GEMM form; None: no adapter targets it.
        self.lora: tuple[torch.Tensor, torch.Tensor] | None = None
        self.lora_columns = 0  # slots x width
        self.num_programs = 0  # the split-K kernel's aim on CUDA (see triton_linear.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, gated=False)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """This layer of silu(gate) * up, for the output of a [gate | up] layer. On CUDA,
        over a few rows, the split-K kernel computes the activation as it loads its input
        (`triton_linear`): no launch of its own."""
        return self._linear(gate_up, gated=True)

    def _linear(self, x: torch.Tensor, gated: bool) -> torch.Tensor:
        summed = self.parallel == "row" and tp_group().size > 1
        bias = None if summed else self.bias  # added once, after the ranks' sum
        batch = get_lora_batch() if self.lora is not None else None
        split_k = (_triton_linear() if self.form == "out_major" and self.kernel is None
                   and batch is None else None)
        rows = x.reshape(-1, x.shape[-1]) if split_k is not None else x
        if split_k is not None and split_k.split_k_runs(rows, self.weight, self.num_programs,
                                                        gated):
            out = split_k.split_k_linear(rows, self.weight, self.num_programs, gated)
            out = out.reshape(*x.shape[:-1], out.shape[-1])
            out = out if bias is None else out + bias
        else:
            x = silu_and_mul(x) if gated else x
            out = self._matmul(x, bias)
            if batch is not None:  # before the ranks' sum: a row-parallel rank's part is partial
                self._add_lora(x, out, batch)
        if summed:
            all_reduce(out)
            if self.bias is not None:
                out = out + self.bias
        return out

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is not None:
            out = self.kernel.matmul(x)
            return out if bias is None else out + bias
        if self.gemm is not None:
            return self.gemm.blocked_linear(x.contiguous(), self.weight, self.out_features, bias)
        if self.form == "packed":
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, bias,
                                                      "none", [], "")
        if self.form == "out_major":
            return F.linear(x, self.weight, bias)
        return x @ self.weight if bias is None else torch.addmm(bias, x, self.weight)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this [gate | up] layer's output. On the blocked GEMM it is one
        kernel, fused into the GEMM's store on AMX (unless an adapter adds to the gate/up
        output first): the same bits as the two steps."""
        assert len(self.output_sizes) == 2 and self.output_sizes[0] == self.output_sizes[1]
        fusable = (self.gemm is not None and self.kernel is None and self.bias is None
                   and (self.lora is None or get_lora_batch() is None))
        if fusable:
            return self.gemm.blocked_linear_silu_and_mul(x.contiguous(), self.weight,
                                                         self.output_sizes[0])
        return silu_and_mul(self(x))

    def set_lora(self, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Takes the adapters' packed A [in, slots x width] and B [slots x width, out]; on
        the blocked GEMM (as 16-output blocks, like the weight) where the layer runs on it."""
        if a is None or b is None:
            self.lora, self.lora_columns = None, 0
            return
        self.lora_columns = a.shape[1]
        if self.gemm is not None and all(self.gemm.gemm_supports(w.t()) for w in (a, b)):
            self.lora = (self.gemm.pack_weight([a.t()], a.dtype),
                         self.gemm.pack_weight([b.t()], b.dtype))
        else:
            self.lora = (a, b)

    def _add_lora(self, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> None:
        """out += ((x A) * mask) B: each row through its own adapter's columns only. On CUDA,
        Triton's kernels segmented by adapter compute the same without the other adapters'
        columns."""
        a, b = self.lora
        kernels = _triton_lora() if out.is_cuda else None
        if kernels is not None:
            kernels.add_lora(x, out, a, b, batch, self.num_programs)
            return
        mask = batch.mask(self.lora_columns // batch.num_slots, out.dtype)
        if self.gemm is not None and a.dim() != 2:  # packed
            shrunk = self.gemm.blocked_linear(x.contiguous(), a, self.lora_columns, None)
            out.add_(self.gemm.blocked_linear(shrunk.mul_(mask), b, self.out_features, None))
        else:
            out.addmm_((x @ a).mul_(mask), b)

    @property
    def weight_bytes(self) -> int:
        if self.kernel is not None:
            return self.kernel.num_bytes
        return self.weight.numel() * self.weight.element_size()

    def checkpoint_parts(self) -> list[tuple[str, int]]:
        """The (kind, shard) pieces a checkpoint must provide for this layer."""
        kinds = ["weight"] + (["bias"] if self.bias is not None else [])
        return [(kind, shard) for kind in kinds for shard in range(len(self.output_sizes))]

    def load(self, kind: str, shard: int,
             tensor: torch.Tensor | QuantizedWeight | LutWeight) -> None:
        """Takes a checkpoint tensor (`[out, in]` weight, quantized or not) as its shard, or
        copies an `[out]` bias into its range."""
        if self.form != "loading":
            raise ValueError("the layer has all its parts already (a tensor given twice?)")
        if self.parallel is not None and tp_group().size > 1:
            tensor = self._rank_share(kind, tensor)
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        expected = (size, self.in_features) if kind == "weight" else (size,)
        bias = self.bias
        if tuple(tensor.shape) != expected or (kind == "bias" and bias is None):
            raise ValueError(f"expected shape {list(expected)}, got {list(tensor.shape)}")
        if isinstance(tensor, QuantizedWeight | LutWeight):
            self.quantized[shard] = tensor
        elif kind == "weight":
            self.shards[shard] = tensor
        elif bias is not None:
            bias[start:start + size].copy_(tensor)

    def _rank_share(self, kind: str, tensor: torch.Tensor | QuantizedWeight | LutWeight
                    ) -> torch.Tensor | QuantizedWeight | LutWeight:
        """This rank's part of a full checkpoint tensor: its output rows (column-parallel), or
        its input columns of a row-parallel weight."""
        quantized = isinstance(tensor, QuantizedWeight | LutWeight)
        if self.parallel == "column" and quantized:
            return tensor.map_rows(lambda t: rank_slice(t, 0))
        if kind == "weight" and quantized:
            return tensor.input_slice(*rank_bounds(tensor.shape[1], 1))
        if self.parallel == "column" or kind == "weight":
            # A copy: the layer keeps it until prepare(), and must not keep the whole tensor.
            return rank_slice(tensor, 0 if self.parallel == "column" else 1).clone()
        return tensor

    def prepare(self) -> None:
        """Switches to the fastest execution form for the weight's device (see module doc).
        A quantized layer builds its dense weight only where no kernel runs it, or to time
        the kernels against it (once per layer shape)."""
        cpu = self.weight.device.type == "cpu"
        gemm = cpu_kernels() if cpu else None
        split_k = _triton_linear()
        if split_k is not None and split_k.kernel_choice() == "triton":
            self.form = "out_major"  # the split-K kernel on any device (see triton_linear.py)
        elif gemm is not None and gemm.gemm_supports(self.weight):
            self.gemm, self.form = gemm, "blocked"
        elif cpu and _onednn_packs(self.weight.dtype):
            self.form = "packed"
        elif self.weight.device.type == "cuda":
            self.form = "out_major"
        else:
            self.form = "transposed"
        if self.form == "out_major":
            self.num_programs = num_programs(self.weight.device)
        shards = self._quantized_shards()
        if not shards:
            assert len(self.shards) == len(self.output_sizes), "prepare() before load()"
            self._set_dense([self.shards[i] for i in range(len(self.shards))])
            self.shards = {}
            return
        dtype, device = self.weight.dtype, self.weight.device
        self.kernel = choose_kernel(shards, self._densify, self.in_features, dtype, device)
        if self.kernel is None:
            self._densify()
        else:
            self.quantized = {}
            self.weight = torch.empty(0, dtype=dtype, device=device)

    def _set_dense(self, rows: list[torch.Tensor]) -> None:
        """Takes the dense weight, as its row blocks [out_i, in] in output order (maybe in a
        narrower dtype, as the checkpoint holds it), in the layer's execution form and
        dtype."""
        dtype = self.weight.dtype
        if self.form == "blocked":
            widens = all(r.dtype == torch.bfloat16 for r in rows) and dtype == torch.float32
            if not widens and any(r.dtype != dtype for r in rows):
                rows = [r.to(dtype) for r in rows]
            self.weight = self.gemm.pack_weight(rows, dtype)  # read where they lie
            return
        weight = (rows[0] if len(rows) == 1 else torch.cat(rows)).to(dtype)
        if self.form == "packed":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        elif self.form == "out_major":
            self.weight = weight.contiguous()
        else:
            self.weight = weight.t().contiguous()

    def _quantized_shards(self) -> list[QuantizedWeight] | list[LutWeight]:
        """The quantized shards in output order."""
        if self.quantized and len(self.quantized) != len(self.output_sizes):
            raise ValueError("a fused layer mixes quantized and float shards")
        return [self.quantized[i] for i in range(len(self.quantized))]

    def _densify(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The layer's dense matmul, from the quantized shards' dequantized weight (built on
        the first call)."""
        if self.quantized:
            shards = self._quantized_shards()
            self.quantized = {}
            self._set_dense([q.dequantize().to(self.weight.device, self.weight.dtype)
                             for q in shards])
        return self.forward
