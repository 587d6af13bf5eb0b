"""The baseline: Hugging Face `generate` on the same checkpoint and device, padded static
batches. `static_cache` switches transformers to a preallocated cache, which it compiles
with torch.compile on CUDA: its fastest single-model mode."""

from __future__ import annotations

import time

import torch

from kvserve.benchmarks.device import synchronize
from kvserve.benchmarks.workloads import Workload


def hf_cannot_run(model: str, dtype: torch.dtype) -> str | None:
    """Why transformers cannot run this checkpoint as a reference, or None when it can.

    A quantization method transformers does not know (SqueezeLLM) it skips with a warning,
    and would then run the packed tensors as if they were dense weights; one it knows may need
    a package this environment lacks (GPTQ needs optimum)."""
    from transformers import AutoConfig
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, AutoHfQuantizer

    quantization = getattr(AutoConfig.from_pretrained(model), "quantization_config", None)
    if quantization is None:
        return None
    method = quantization.get("quant_method")
    if method not in AUTO_QUANTIZER_MAPPING:
        return f"transformers does not implement quant_method {method!r}"
    try:
        AutoHfQuantizer.from_config(quantization).validate_environment(dtype=dtype,
                                                                       device_map=None)
    except (ImportError, RuntimeError, ValueError) as e:
        return f"transformers cannot load this {method} checkpoint here: {e}"
    return None


def load_hf(model: str, dtype: torch.dtype, device: str = "cpu"):  # noqa: ANN201
    """transformers on the checkpoint, or None, with the reason printed, where it cannot run
    it: the command goes on without that reference, as it does without a peer it cannot run."""
    from transformers import AutoModelForCausalLM

    if (reason := hf_cannot_run(model, dtype)) is not None:
        print(f"  skipping hf: {reason}", flush=True)
        return None
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()


@torch.inference_mode()
def hf_generate_batch(hf, prompts: list[list[int]], max_new_tokens: int,  # noqa: ANN001
                      temperature: float = 0.0, static_cache: bool = False,
                      streamer: object = None) -> None:
    """Left-pads the batch and decodes exactly max_new_tokens for every row (EOS ignored);
    temperature > 0 samples from the whole distribution (no top-k/top-p), as kvserve does.
    `streamer` is generate's: handed the prompt, then each step's tokens."""
    width = max(len(p) for p in prompts)
    pad = hf.config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                        device=hf.device)
    cache = {"cache_implementation": "static"} if static_cache else {}
    hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, pad_token_id=pad, **_sampling(temperature),
                streamer=streamer, **cache)
    synchronize(hf.device)


class _FirstTokenClock:
    """A `generate` streamer that notes when the first new token comes: generate hands it the
    prompt first, then each step's tokens."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.monotonic()

    def end(self) -> None:
        pass


def hf_request_times(hf, prompt: list[int], max_new_tokens: int,  # noqa: ANN001
                     static_cache: bool = False) -> tuple[float, float]:
    """Seconds from the start of one greedy request to its first new token and to its last."""
    clock = _FirstTokenClock()
    synchronize(hf.device)
    start = time.monotonic()
    hf_generate_batch(hf, [prompt], max_new_tokens, static_cache=static_cache, streamer=clock)
    assert clock.first is not None, "generate made no token"
    return clock.first - start, time.monotonic() - start


def _sampling(temperature: float) -> dict[str, object]:
    if temperature == 0.0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": None, "top_p": None}


def hf_run(hf, work: Workload, batch_size: int, temperature: float = 0.0,  # noqa: ANN001
           static_cache: bool = False) -> float:
    """Seconds to run the workload in arrival order, `batch_size` prompts per generate."""
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        hf_generate_batch(hf, work.prompts[i:i + batch_size],
                          max(work.output_lens[i:i + batch_size]), temperature, static_cache)
    return time.perf_counter() - start
