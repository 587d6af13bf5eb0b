"""The engine options as command-line flags, shared by `kvserve serve|generate` and every
`kvserve bench`: one table turns flags into `EngineConfig.create` keywords, and back into
flags for a server a benchmark starts as a subprocess."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvserve.arg_types import token_count
from kvserve.config import (
    GENERATION_SAMPLING_FIELDS,
    PREEMPTION_MODES,
    SCHEDULER_POLICIES,
    SCHEDULING_POLICIES,
    GiB,
)
from kvserve.vllm_flags import add_vllm_flags


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def _lora_module(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


MODEL_HELP = "HF checkpoint folder, or a Hugging Face Hub model id (org/name)"
# (flag, argparse options); each flag's dest is an `EngineConfig.create` keyword.
ENGINE_ARGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--dtype", dict(default="auto",
                     choices=["auto", "float32", "bfloat16", "float16", "float", "half"],
                     help="weights and compute dtype (float and half: vLLM's names of "
                          "float32 and float16); auto: bfloat16 on CUDA and on CPUs that "
                          "multiply it natively (AVX512-BF16 or AMX), else float32")),
    ("--max-num-batched-tokens", dict(type=token_count, default=2048,
                                      help="token budget of one step (default 2048)")),
    ("--max-num-seqs", dict(type=int, default=128,
                            help="most sequences running at once (default 128)")),
    ("--block-size", dict(type=int, default=16, help="tokens per KV block (default 16)")),
    ("--kv-cache-memory", dict(type=float, default=None,
                               help="KV cache size in GiB (default: on CUDA, what "
                                    "--gpu-memory-utilization leaves; on the CPU 2; either "
                                    "way no more than --max-num-seqs requests of "
                                    "--max-model-len tokens fill)")),
    ("--gpu-memory-utilization", dict(type=float, default=0.9,
                                      help="CUDA: the share of the GPU's memory that the "
                                           "weights, a step's activations and the KV cache "
                                           "take together, where --kv-cache-memory is not "
                                           "given (default 0.9)")),
    ("--max-model-len", dict(type=token_count, default=None,
                             help="context limit per request, e.g. 4096, 32k or 32K (32,768) "
                                  "(default: the model's context)")),
    ("--seed", dict(type=int, default=0)),
    ("--device", dict(default="cpu", help="cpu (default), cuda or cuda:N")),
    ("--scheduler-policy", dict(default="chunked", choices=SCHEDULER_POLICIES,
                                help="chunked: stall-free chunked prefill beside decodes "
                                     "(default); prefill_first: whole prompts before decodes "
                                     "(a baseline)")),
    ("--scheduling-policy", dict(default="fcfs", choices=SCHEDULING_POLICIES,
                                 help="who is served first: fcfs (arrival order, default); "
                                      "priority (the request's priority, lower first); fair "
                                      "(tenants, by the `user` field, share the token budget)")),
    ("--preemption-mode", dict(default="auto", choices=PREEMPTION_MODES,
                               help="when KV blocks run out, a preempted request's KV is "
                                    "swapped to host memory or dropped and recomputed; auto "
                                    "(default) picks whichever is measured cheaper")),
    ("--swap-space", dict(type=float, default=4.0,
                          help="host memory in GiB for the KV of swapped-out requests "
                               "(default 4)")),
    ("--kv-offload-host-gib", dict(type=float, default=0.0,
                                   help="host memory in GiB that keeps prefix-cache blocks "
                                        "evicted from the KV pool, to load back instead of "
                                        "recomputing (default 0: off)")),
    ("--kv-offload-dir", dict(default=None,
                              help="a folder for a disk tier below the host tier; a restart "
                                   "finds its blocks again (needs --kv-offload-host-gib)")),
    ("--kv-offload-disk-gib", dict(type=float, default=16.0,
                                   help="size cap of the disk tier in GiB (default 16)")),
    ("--streaming-window", dict(type=int, default=0,
                                help="StreamingLLM: keep each request's newest N KV blocks "
                                     "(and its attention sinks), so a stream runs past "
                                     "max_model_len with bounded KV (default 0: off; needs "
                                     "--no-enable-prefix-caching)")),
    ("--attention-sinks", dict(type=int, default=None,
                               help="tokens at a stream's start whose KV blocks always stay "
                                    "(default 4 with --streaming-window)")),
    ("--enable-prefix-caching", dict(action=argparse.BooleanOptionalAction, default=True,
                                     help="reuse the KV of prompt heads already computed "
                                          "(default on)")),
    ("--tensor-parallel-size", dict(type=int, default=1,
                                    help="split each layer over this many processes "
                                         "(torch.distributed: gloo on CPU, NCCL on CUDA, "
                                         "one GPU each)")),
    ("--enforce-eager", dict(action="store_true",
                             help="CUDA: run every step eagerly, never replaying CUDA graphs")),
    ("--max-graph-tokens", dict(type=int, default=1024,
                                help="CUDA: steps with prefill chunks of up to this many "
                                     "tokens replay CUDA graphs, larger ones run eagerly "
                                     "(default 1024; 0: all such steps run eagerly)")),
    ("--async-scheduling", dict(action=argparse.BooleanOptionalAction, default=None,
                                help="schedule each step while the device runs the one "
                                     "before (default: on for one CUDA device, off on the "
                                     "CPU, where steps do not overlap the host)")),
    ("--speculative-model", dict(default=None,
                                 help="speculative decoding: each decode step verifies drafted "
                                      "tokens, from prompt lookup (ngram) or a small model "
                                      "with the same tokenizer (its checkpoint folder); "
                                      "default: off")),
    ("--num-speculative-tokens", dict(type=int, default=None,
                                      help="most drafts a decode step verifies (default 4)")),
    ("--prompt-lookup-min", dict(type=int, default=None,
                                 help="ngram: the shortest suffix looked up (default 2)")),
    ("--prompt-lookup-max", dict(type=int, default=None,
                                 help="ngram: the longest suffix looked up (default 4)")),
    ("--lora-modules", dict(nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                            help="PEFT LoRA adapters to load, each served as model NAME")),
    ("--max-loras", dict(type=int, default=8, help="most LoRA adapters loaded at once "
                                                   "(default 8)")),
    ("--generation-config", dict(default="auto",
                                 help="the sampling defaults of requests that leave a field "
                                      "out: auto (default: the model's generation_config.json"
                                      ", its " + ", ".join(GENERATION_SAMPLING_FIELDS) + "), "
                                      "vllm (none: temperature 1, no top-p or top-k...) or a "
                                      "folder holding another generation_config.json")),
    ("--override-generation-config", dict(type=_json_object, default=None, metavar="JSON",
                                          help="sampling defaults set over the generation "
                                               "config's, as a JSON object in its names, e.g. "
                                               "'{\"temperature\": 0.5}'")),
    ("--chat-template", dict(default=None,
                             help="a Jinja chat template, or the file that holds one, in place "
                                  "of the tokenizer's own (for a model that has none, or a "
                                  "fixed one)")),
    ("--tokenizer", dict(default=None,
                         help="a folder or Hub id holding the tokenizer (and its chat "
                              "template), in place of the model's")),
    ("--revision", dict(default=None,
                        help="the Hugging Face Hub model's branch, tag or commit (default "
                             "main)")),
    ("--download-dir", dict(default=None,
                            help="where Hub models are downloaded (default: the Hub's cache, "
                                 "~/.cache/huggingface/hub)")),
    ("--blend-recompute-ratio", dict(type=float, default=0.15,
                                     help="CacheBlend: for a prompt given as segments, the "
                                          "share of reused chunk tokens recomputed in context "
                                          "(default 0.15)")),
)


# vLLM's short spellings of the same flags.
SHORT_FLAGS = {"--tensor-parallel-size": ("-tp",)}


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def add_engine_args(parser: argparse.ArgumentParser, model: str = "required") -> None:
    """Adds the engine options; the checkpoint is a positional argument (`model="positional"`,
    which takes `--model` too, as vLLM's older command lines give it), a required `--model`
    ("required") or an optional one ("optional")."""
    if model == "positional":
        either = parser.add_mutually_exclusive_group(required=True)
        either.add_argument("model", nargs="?", default=argparse.SUPPRESS, help=MODEL_HELP)
        either.add_argument("--model", dest="model", default=argparse.SUPPRESS,
                            help="the same, as a flag")
    else:
        parser.add_argument("--model", required=model == "required", default=None,
                            help=MODEL_HELP)
    for flag, options in ENGINE_ARGS:
        parser.add_argument(flag, *SHORT_FLAGS.get(flag, ()), **options)
    for flag, policy in (("--enable-chunked-prefill", "chunked"),
                         ("--no-enable-chunked-prefill", "prefill_first")):  # vLLM's
        parser.add_argument(flag, dest="scheduler_policy", action="store_const", const=policy,
                            help=argparse.SUPPRESS)
    add_vllm_flags(parser)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags as `LLM(...)` / `EngineConfig.create` keywords."""
    kwargs = {_dest(flag): getattr(args, _dest(flag)) for flag, _ in ENGINE_ARGS}
    if args.kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = int(args.kv_cache_memory * GiB)
    kwargs["swap_space"] = int(args.swap_space * GiB)
    kwargs["kv_offload_host"] = int(kwargs.pop("kv_offload_host_gib") * GiB)
    kwargs["kv_offload_disk"] = int(kwargs.pop("kv_offload_disk_gib") * GiB)
    kwargs["lora_modules"] = dict(kwargs["lora_modules"] or ())
    return {"model": args.model, **kwargs}


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The parsed engine options as flags again, for a `kvserve serve` subprocess."""
    flags: list[str] = []
    for flag, options in ENGINE_ARGS:
        value = getattr(args, _dest(flag))
        if options.get("action") is argparse.BooleanOptionalAction:
            if value is not None:
                flags.append(flag if value else f"--no-{flag.removeprefix('--')}")
        elif options.get("action") == "store_true":
            flags += [flag] if value else []
        elif flag == "--lora-modules":
            flags += [flag, *(f"{name}={path}" for name, path in value)] if value else []
        elif value is not None:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags
