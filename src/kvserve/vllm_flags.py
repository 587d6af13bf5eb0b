"""vLLM's engine and server flags that kvserve has no flag of its own for, so that a `vllm
serve` command line runs as `kvserve serve` unchanged where its meaning holds here, and is
refused by name, with what kvserve does instead, where it does not; the same for the
keywords of vLLM's `LLM(...)`, and what kvserve has for the fields of its `SamplingParams`
that kvserve's lacks.

A flag kvserve already satisfies (`--trust-remote-code`, `--kv-cache-dtype auto`) is taken
with a note that says why it changes nothing; one asking for what kvserve does not do
(`--kv-cache-dtype fp8`, `--quantization awq`) is a usage error. Flags whose meaning kvserve
has under its own name are aliases in `engine_args` (`-tp`, `--enable-chunked-prefill`).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ANY = None  # every value holds


@dataclass(frozen=True)
class VllmFlag:
    names: tuple[str, ...]
    # The values whose meaning kvserve already has: ANY (and every flag without a value)
    # holds whatever it is given, () never holds.
    holds: tuple[str, ...] | None
    why: str  # what kvserve does, which makes the flag hold or not
    takes_value: bool = True


VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(("--trust-remote-code",), ANY, "kvserve runs its own implementation of each "
             "architecture and no code from a checkpoint", takes_value=False),
    VllmFlag(("--disable-log-requests", "--enable-log-requests"), ANY, "kvserve logs each "
             "HTTP request's line (uvicorn's access log), never its prompt or output",
             takes_value=False),
    VllmFlag(("--max-log-len",), ANY, "kvserve never logs a prompt"),
    VllmFlag(("--disable-log-stats",), ANY, "kvserve logs no periodic stats; /metrics has "
             "them", takes_value=False),
    VllmFlag(("--disable-frontend-multiprocessing",), ANY, "the HTTP front end and the engine "
             "share one process", takes_value=False),
    VllmFlag(("--enable-lora",), ANY, "adapters load with --lora-modules or POST "
             "/v1/load_lora_adapter", takes_value=False),
    VllmFlag(("--max-lora-rank",), ANY, "adapters of any rank load"),
    VllmFlag(("--guided-decoding-backend",), ANY, "structured output runs on llguidance"),
    VllmFlag(("--task", "--runner"), ("auto", "generate"), "kvserve serves text generation"),
    VllmFlag(("--tokenizer-mode",), ("auto",), "the tokenizer is the one transformers' "
             "AutoTokenizer loads from the checkpoint"),
    VllmFlag(("--load-format",), ("auto", "safetensors"), "kvserve loads safetensors "
             "checkpoints"),
    VllmFlag(("--kv-cache-dtype",), ("auto",), "the KV cache is kept in the model's dtype "
             "(--dtype)"),
    VllmFlag(("--pipeline-parallel-size", "-pp"), ("1",), "kvserve splits a model over "
             "devices by tensor parallelism (--tensor-parallel-size) and serves replicas "
             "with --data-parallel-size"),
    VllmFlag(("--quantization", "-q"), (), "kvserve reads the method from the checkpoint's "
             "quantization_config; `kvserve quantize` writes GPTQ, RTN and SqueezeLLM ones"),
    VllmFlag(("--cpu-offload-gb",), ("0",), "weights stay on the device; "
             "--kv-offload-host-gib offloads KV blocks to host memory"),
    VllmFlag(("--max-seq-len-to-capture",), (), "kvserve's --max-graph-tokens sets the "
             "largest step that replays a CUDA graph"),
    VllmFlag(("--num-scheduler-steps",), ("1",), "each step is scheduled on its own; "
             "--async-scheduling overlaps scheduling with the device"),
)


def _keyword(vllm: VllmFlag) -> str:
    return vllm.names[0].removeprefix("--").replace("-", "_")


def _holds(vllm: VllmFlag, value: Any) -> bool:
    return vllm.holds is ANY or value in vllm.holds


def take_vllm_options(options: dict[str, Any]) -> dict[str, Any]:
    """`LLM(...)`'s keywords with vLLM's ones turned into kvserve's: `enable_chunked_prefill`
    into `scheduler_policy`, those that change nothing dropped with a note; one that would
    change something kvserve does not do raises ValueError."""
    options = dict(options)
    if "speculative_config" in options:
        given = options.pop("speculative_config")
        if given is not None:
            options.update(speculative_options(given))
    if "enable_chunked_prefill" in options:
        if "scheduler_policy" in options:
            raise ValueError("give scheduler_policy or vLLM's enable_chunked_prefill, not both")
        chunked = options.pop("enable_chunked_prefill")
        options["scheduler_policy"] = "prefill_first" if chunked is False else "chunked"
    for vllm in VLLM_FLAGS:
        name = _keyword(vllm)
        if name not in options:
            continue
        value = options.pop(name)
        if value is None:  # vLLM's default: unset
            continue
        if vllm.takes_value and not _holds(vllm, str(value)):
            raise ValueError(f"vLLM's {name}={value!r} is not supported: {vllm.why}")
        logger.info("vLLM's %s=%r changes nothing: %s", name, value, vllm.why)
    return options


SPECULATIVE_KEYS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def speculative_options(config: Any) -> dict[str, Any]:
    """vLLM's `speculative_config` ({"method": "ngram", "num_speculative_tokens": 4} or
    {"model": DRAFT, ...}) as kvserve's options: `speculative_model` ("ngram" or the draft's
    folder) and those of SPECULATIVE_KEYS."""
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {config!r}")
    method, model = config.get("method"), config.get("model")
    if method == "ngram" and model is None:
        draft = "ngram"
    elif method in (None, "draft_model") and isinstance(model, str) and model:
        draft = model
    else:
        raise ValueError(f"speculative_config: method {method!r} with model {model!r} is not "
                         "supported: kvserve drafts by prompt lookup ({\"method\": \"ngram\"}) "
                         "or with a draft model ({\"model\": FOLDER})")
    unknown = sorted(set(config) - {"method", "model", *SPECULATIVE_KEYS})
    if unknown:
        raise ValueError(f"speculative_config: {unknown} are not supported; kvserve takes "
                         f"method, model and {', '.join(SPECULATIVE_KEYS)}")
    return {"speculative_model": draft, **{k: config[k] for k in SPECULATIVE_KEYS if k in config}}


class SpeculativeConfigAction(argparse.Action):
    """vLLM's `--speculative-config JSON`, set as kvserve's own speculative flags."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        try:
            config = json.loads(values)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentError(self, f"not valid JSON ({e}): {values!r}") from None
        try:
            options = speculative_options(config)
        except ValueError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        for name, value in options.items():
            setattr(namespace, name, value)


# vLLM's SamplingParams fields kvserve's lacks, and what it has instead.
VLLM_SAMPLING_FIELDS = {
    "best_of": "n samples n sequences and returns them all; there is no best_of",
    "guided_decoding": "structured_output=StructuredOutputParams(json=..., regex=..., "
                       "choice=..., grammar=...) constrains the output",
    "structured_outputs": "structured_output=StructuredOutputParams(json=..., regex=..., "
                          "choice=..., grammar=...) constrains the output",
    "logits_processors": "logit_bias and allowed_token_ids shape the logits; there are no "
                         "Python logits processors",
    "detokenize": "every output is detokenized",
    "spaces_between_special_tokens": "special tokens are decoded as the tokenizer decodes "
                                     "them",
    "output_kind": "LLM.generate returns finished outputs; AsyncLLM.generate streams them",
}


class _VllmFlagAction(argparse.Action):
    """Takes a vLLM flag whose meaning holds, with a note saying why it changes nothing;
    refuses one that does not hold, naming what kvserve does instead."""

    def __init__(self, option_strings: Sequence[str], dest: str, vllm: VllmFlag,
                 **kwargs: Any) -> None:
        self.vllm = vllm
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                         nargs=None if vllm.takes_value else 0, help=argparse.SUPPRESS,
                         **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        given = f"{option_string} {values}" if self.vllm.takes_value else option_string
        if not _holds(self.vllm, values):
            raise argparse.ArgumentError(self, f"vLLM's {given} is not supported: "
                                               f"{self.vllm.why}")
        logger.info("vLLM's %s changes nothing: %s", given, self.vllm.why)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the flags, left out of `--help` (the README lists them)."""
    parser.add_argument("--speculative-config", action=SpeculativeConfigAction,
                        dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)
    for vllm in VLLM_FLAGS:
        parser.add_argument(*vllm.names, action=_VllmFlagAction, vllm=vllm)
