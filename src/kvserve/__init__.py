"""kvserve: an LLM inference and serving engine."""

from kvserve.entrypoints.llm import LLM
from kvserve.lora.request import LoRARequest
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
