"""`kvserve ...`: the command line. Thin: parses flags, builds configs, calls the library."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

import kvserve
from kvserve.arg_types import non_negative_int, port, positive_float, positive_int
from kvserve.config import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_WAITING_REQUESTS, GiB
from kvserve.engine_args import add_engine_args, engine_kwargs


def _generate(args: argparse.Namespace) -> None:
    from kvserve import LLM, SamplingParams

    prompts = args.prompt
    if not prompts:
        if sys.stdin.isatty():
            print("reading prompts from stdin, one per line; end with Ctrl-D",
                  file=sys.stderr)
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
        if not prompts:
            raise ValueError("no prompts: give --prompt, or lines on stdin")
    llm = LLM(**engine_kwargs(args))  # type: ignore[arg-type]
    given = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k",
                                                    "max_tokens")
             if getattr(args, name) is not None}
    # Greedy, 64 tokens, where neither the flags nor the model's generation config say.
    defaults = {"temperature": 0.0, "max_tokens": 64, **llm.engine.inputs.sampling_defaults}
    params = SamplingParams(**{**defaults, **given}, seed=args.sampling_seed,
                            stop=args.stop or [], ignore_eos=args.ignore_eos)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        print(f"--- prompt: {prompt!r}")
        print(f"{completion.text!r}  [{len(completion.token_ids)} tokens, "
              f"finish_reason={completion.finish_reason}]")


def _serve(args: argparse.Namespace) -> None:
    from kvserve.entrypoints.openai.server import ServerConfig, serve

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    name, *aliases = args.served_model_name or [args.model]
    # The server's options fail here, before the model loads.
    config = ServerConfig(model_name=name, aliases=tuple(aliases), api_key=args.api_key or None,
                          max_request_bytes=args.max_request_bytes,
                          tool_call_parser=args.tool_call_parser
                          if args.enable_auto_tool_choice else None,
                          reasoning_parser=args.reasoning_parser,
                          shutdown_timeout=args.shutdown_timeout,
                          allowed_origins=_origins(args.allowed_origins),
                          access_log=not args.disable_uvicorn_access_log,
                          log_level=args.uvicorn_log_level,
                          timeout_keep_alive=args.timeout_keep_alive,
                          ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    options = dict(engine_kwargs(args), model_name=name,
                   max_waiting_requests=args.max_waiting_requests)
    disaggregated = args.prefill_replicas or args.decode_replicas
    if disaggregated and args.data_parallel_size > 1:
        raise ValueError("--data-parallel-size: give it or --prefill-replicas with "
                         "--decode-replicas, not both")
    if args.data_parallel_size > 1 or args.ray_address or disaggregated:
        from kvserve.cluster.cluster_llm import ClusterLLM

        llm = ClusterLLM(**options, data_parallel_size=args.data_parallel_size,
                         router=args.router, ray_address=args.ray_address,
                         migration_threshold=args.migration_threshold,
                         prefill_replicas=args.prefill_replicas,
                         decode_replicas=args.decode_replicas)
    else:
        from kvserve.entrypoints.async_llm import AsyncLLM

        llm = AsyncLLM(**options)
    serve(llm, config, args.host, args.port)


def _origins(values: list[str]) -> tuple[str, ...]:
    """`--allowed-origins` as origins, or as vLLM's JSON list (`'[]'`: none)."""
    if len(values) != 1 or not values[0].startswith("["):
        return tuple(values)
    try:
        origins = json.loads(values[0])
    except json.JSONDecodeError as e:
        raise ValueError(f"--allowed-origins: not a JSON list of origins ({e})") from None
    if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
        raise ValueError(f"--allowed-origins: expected a JSON list of origins, got {values[0]}")
    return tuple(origins)


def _make_model(args: argparse.Namespace) -> None:
    from kvserve.tools.make_model import make_model

    path = make_model(args.preset, args.output, arch=args.arch, seed=args.seed,
                      dtype=args.dtype, max_shard_bytes=int(args.max_shard_size * GiB),
                      train_steps=args.train_steps, distill_from=args.distill_from,
                      num_layers=args.num_layers, progress=True)
    print(f"wrote {path}")


def _make_lora(args: argparse.Namespace) -> None:
    from kvserve.tools.make_lora import make_lora

    make_lora(args.model, args.output, rank=args.rank, alpha=args.alpha,
              targets=tuple(args.targets or ()), seed=args.seed)
    print(f"wrote {args.output}")


def _quantize(args: argparse.Namespace) -> None:
    from kvserve.quantization.quantize import quantize_model

    path = quantize_model(args.model, args.output, args.method, args.bits, args.group_size,
                          args.act_order, args.sym, args.calibration_samples,
                          args.calibration_len, args.seed, args.outlier_fraction,
                          args.sensitive_fraction, args.lm_head, progress=True)
    print(f"wrote {path}")


class CommandParser(argparse.ArgumentParser):
    """A parser (and, as its class, each subcommand's) whose unknown flags are refused by the
    subcommand that got them, with the flag it has that comes closest."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:
            self.error(unknown_flags_message(extras, self._option_string_actions))
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        if message == "one of the arguments model --model is required":  # argparse's words
            message = (f"the model is required: {self.prog} MODEL (a checkpoint folder or a "
                       "Hugging Face Hub id)")
        super().error(message)


def unknown_flags_message(extras: list[str], known: Iterable[str]) -> str:
    flags = [extra.partition("=")[0] for extra in extras if extra.startswith("-")]
    hints = [f"{flag}: did you mean {close[0]}?" for flag in flags
             if (close := difflib.get_close_matches(flag, known, n=1))]
    return f"unrecognized arguments: {' '.join(extras)}" + (
        f" ({'; '.join(hints)})" if hints else "")


def build_parser() -> argparse.ArgumentParser:
    from kvserve.benchmarks import simulate
    from kvserve.benchmarks.cli import add_bench_parser
    from kvserve.cluster.router import ROUTERS
    from kvserve.entrypoints.openai.reasoning import REASONING_PARSERS
    from kvserve.entrypoints.openai.tool_calling import TOOL_CALL_PARSERS
    from kvserve.evals import perplexity, streaming
    from kvserve.tools.make_lora import FUSED_TARGETS, TARGETS
    from kvserve.tools.make_model import ARCHES, PRESETS

    parser = CommandParser(
        prog="kvserve", description="LLM inference and serving for Hugging Face checkpoints.",
        epilog="`kvserve COMMAND --help` lists a command's flags; e.g. `kvserve serve "
               "Qwen/Qwen2.5-0.5B-Instruct` serves the OpenAI API on port 8000.")
    parser.add_argument("--version", action="version", version=f"kvserve {kvserve.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts (arguments or stdin)")
    add_engine_args(gen, model="positional")
    gen.add_argument("--prompt", action="append",
                     help="repeat for several prompts (default: each line of stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    for flag, kind, fallback in (("--max-tokens", int, "64"), ("--temperature", float, "0"),
                                 ("--top-p", float, "1"), ("--top-k", int, "-1: off")):
        gen.add_argument(flag, type=kind, default=None,
                         help=f"default: the generation config's (see --generation-config), "
                              f"else {fallback}")
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(srv, model="positional")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=port, default=8000)
    srv.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1 routes "
                          "(default: $KVSERVE_API_KEY)")
    srv.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="the model names clients may use; responses carry the first "
                          "(default: the model argument, folder or Hub id)")
    srv.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                     help="beyond this many queued sequences (each prompt counts n), "
                          "answer 503 with Retry-After")
    srv.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                     help="larger request bodies get 413")
    srv.add_argument("--shutdown-timeout", type=non_negative_int, default=0,
                     help="on SIGTERM or Ctrl+C, stop taking connections and give the "
                          "requests in flight this many seconds to finish before aborting "
                          "them (default 0: abort them at once)")
    srv.add_argument("--allowed-origins", nargs="+", default=["*"], metavar="ORIGIN",
                     help="the origins whose browser pages may call the API (CORS; default "
                          "*: any, as vLLM's and llama.cpp's servers allow), such as "
                          "http://localhost:3000; vLLM's JSON list form too ('[]': none)")
    srv.add_argument("--timeout-keep-alive", type=positive_int, default=65,
                     help="seconds an idle keep-alive connection stays open (default 65: "
                          "longer than clients and load balancers keep theirs, so that a "
                          "connection a client reuses is never closed under it)")
    srv.add_argument("--ssl-keyfile", default=None,
                     help="serve HTTPS: the PEM file of the server's private key (with "
                          "--ssl-certfile)")
    srv.add_argument("--ssl-certfile", default=None,
                     help="serve HTTPS: the PEM file of the server's certificate (chain)")
    srv.add_argument("--uvicorn-log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug", "trace"],
                     help="the HTTP server's log level (default info)")
    srv.add_argument("--disable-uvicorn-access-log", action="store_true",
                     help="no log line per HTTP request")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='let the model decide whether to call a tool (tool_choice "auto", '
                          "the default with tools): needs --tool-call-parser")
    srv.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                     help="the format the model writes its calls in: hermes (Hermes, "
                          "Qwen2.5, Qwen3) or llama3_json (Llama 3.1 and later)")
    srv.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                     help="return a reasoning model's <think> block as reasoning_content, "
                          "apart from content: qwen3 (a block that opens the output) or "
                          "deepseek_r1 (the template opens it in the prompt)")
    srv.add_argument("--data-parallel-size", type=positive_int, default=1,
                     help="engine replicas, each a Ray actor with its own KV cache, behind "
                          "this one server (needs pip install 'kvserve[cluster]')")
    srv.add_argument("--router", default="round-robin", choices=ROUTERS,
                     help="which replica serves a request: round-robin (default), "
                          "least-loaded, or prefix-aware (the one likely to hold the longest "
                          "cached head of the prompt)")
    srv.add_argument("--ray-address", default=None,
                     help="join this Ray cluster (e.g. ray://host:10001 or auto) instead of "
                          "starting a local one")
    srv.add_argument("--prefill-replicas", type=non_negative_int, default=0,
                     help="disaggregated serving (DistServe): replicas that only prefill; "
                          "each prompt's KV then moves to one of --decode-replicas")
    srv.add_argument("--decode-replicas", type=non_negative_int, default=0,
                     help="replicas that take prefilled requests and decode them")
    srv.add_argument("--migration-threshold", type=non_negative_int, default=0,
                     help="live migration for load balancing: while one replica has this many "
                          "requests more than another, move its running requests there as "
                          "they decode (default 0: off; POST /replicas/migrate moves them by "
                          "hand)")
    srv.set_defaults(func=_serve)

    mk = sub.add_parser("make-model", help="write a random-weight HF checkpoint")
    mk.add_argument("preset", choices=sorted(PRESETS))
    mk.add_argument("--output", required=True)
    mk.add_argument("--arch", choices=sorted(ARCHES), default=None)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    mk.add_argument("--max-shard-size", type=positive_float, default=2.0,
                    help="GiB per safetensors file")
    mk.add_argument("--num-layers", type=positive_int, default=None,
                    help="fewer (or more) decoder layers than the preset's, of its shapes: "
                         "a model's per-layer costs in less memory and time")
    mk.add_argument("--train-steps", type=int, default=0,
                    help="train this many steps on the standard library's sources (the "
                         "held-out loss goes to training.json); 0 keeps random weights")
    mk.add_argument("--distill-from", default=None, metavar="TARGET",
                    help="train on this checkpoint's greedy continuations of the training "
                         "text instead of on the text: a speculative draft for TARGET (same "
                         "tokenizer); training.json records how often it agrees with TARGET")
    mk.set_defaults(func=_make_model)

    ml = sub.add_parser("make-lora", help="write a random LoRA adapter for a checkpoint, in "
                                          "PEFT's format")
    ml.add_argument("model", help="the base model: HF checkpoint folder or Hub id")
    ml.add_argument("--output", required=True)
    ml.add_argument("--rank", type=positive_int, default=16)
    ml.add_argument("--alpha", type=float, default=32.0)
    ml.add_argument("--targets", nargs="+", choices=sorted(set(TARGETS + FUSED_TARGETS)),
                    help="default: every projection the checkpoint names")
    ml.add_argument("--seed", type=int, default=0)
    ml.set_defaults(func=_make_lora)

    qt = sub.add_parser("quantize", help="quantize a checkpoint's linear layers")
    qt.add_argument("model", help="HF checkpoint folder or Hub id (full precision)")
    qt.add_argument("--output", required=True)
    qt.add_argument("--method", choices=["rtn", "gptq", "squeezellm"], default="gptq")
    qt.add_argument("--bits", type=int, choices=[2, 3, 4, 8], default=4)
    qt.add_argument("--group-size", type=int, default=None,
                    help="input channels per scale; -1: one per row (default: 128, or the "
                         "largest power of two below it that divides every layer; -1 at 8 "
                         "bits, the layout the CPU int8 kernel runs)")
    qt.add_argument("--act-order", action="store_true",
                    help="GPTQ: quantize input channels by decreasing Hessian diagonal")
    qt.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True,
                    help="zero point at the middle of the range (default) or fitted")
    qt.add_argument("--calibration-samples", type=positive_int, default=128,
                    help="GPTQ and SqueezeLLM: windows of local text to calibrate on "
                         "(default 128)")
    qt.add_argument("--calibration-len", type=int, default=256,
                    help="tokens per calibration window (default 256)")
    qt.add_argument("--seed", type=int, default=0)
    qt.add_argument("--outlier-fraction", type=float, default=0.0045,
                    help="SqueezeLLM: the share of largest weights kept exactly, in a sparse "
                         "matrix (default 0.0045)")
    qt.add_argument("--sensitive-fraction", type=float, default=0.0005,
                    help="SqueezeLLM: the share of most sensitive weights (Fisher) kept in "
                         "the sparse matrix too (default 0.0005)")
    qt.add_argument("--lm-head", action="store_true",
                    help="quantize the LM head too (untied from the embedding)")
    qt.set_defaults(func=_quantize)

    add_bench_parser(sub)
    simulate.add_parser(sub)
    evals = sub.add_parser("eval", help="model quality through the engine")
    evals_sub = evals.add_subparsers(dest="eval", required=True)
    perplexity.add_parser(evals_sub)
    streaming.add_parser(evals_sub)
    return parser


def _resolve_model_arg(args: argparse.Namespace) -> None:
    """A Hugging Face Hub id as the model becomes its folder (downloaded, or found in the
    cache) before any command reads it; the server still serves it under the id."""
    from kvserve.models.hub import resolve_model

    model = getattr(args, "model", None)
    if not isinstance(model, str):
        return
    if hasattr(args, "served_model_name") and args.served_model_name is None:
        args.served_model_name = [model]
    args.model = resolve_model(model, getattr(args, "revision", None),
                               getattr(args, "download_dir", None))


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("kvserve").setLevel(logging.INFO)  # before parsing: flags log notes
    args = build_parser().parse_args(argv)
    try:
        _resolve_model_arg(args)
        args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
