"""`kvserve bench latency`: batch-1 TTFT and time per output token against the bandwidth floor.

The floor is the time to stream every matmul weight once (what one decode step must read)
at the bandwidth of the engine's device measured in the same run: a large copy (read + write
bytes counted), and a large read-only sum, which is what a decode step does with its weights.
transformers runs on the same device, eagerly and, with `--hf-compile`, with a static cache
that it compiles; `--baseline vllm llamacpp` adds those engines (see `peers.py`).
"""

from __future__ import annotations

import argparse
import logging
import statistics
from collections.abc import Callable

from kvserve.arg_types import positive_int
from kvserve.benchmarks.device import memory_bandwidth, on_one_gpu, timed, weight_bytes
from kvserve.benchmarks.hf_baseline import hf_generate_batch, load_hf
from kvserve.benchmarks.peers import add_baseline_arg, each_peer
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.workloads import fixed
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def ttft_and_tpot(request_seconds: Callable[[int], float], output_len: int, runs: int
                  ) -> tuple[float, float]:
    """Median TTFT (a one-token request) and TPOT (the rest of a full request, per token),
    from `request_seconds(n)`: the seconds one request of n new tokens takes alone."""
    request_seconds(4)  # first-use costs
    ttft = statistics.median(request_seconds(1) for _ in range(runs))
    full = statistics.median(request_seconds(output_len) for _ in range(runs))
    if full <= ttft:
        logger.warning("a %d-token request took no longer than a 1-token one (%.1f against "
                       "%.1f ms): the machine is too busy to time this, and TPOT comes out "
                       "at or below 0", output_len, full * 1e3, ttft * 1e3)
    return ttft, (full - ttft) / (output_len - 1)


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    llm = LLM(**on_one_gpu(engine_kwargs(args), 2 if "hf" in args.baseline else 1))
    cfg, device = llm.engine.config.model, llm.engine.config.device
    prompt = fixed(1, args.prompt_len, args.output_len, cfg.vocab_size).prompts[0]

    def ours(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.reset_prefix_cache()  # each request prefills its prompt, as for the peers
        return timed(lambda: llm.generate([{"prompt_token_ids": prompt}], params,
                                          use_tqdm=False), device)

    ttft, tpot = ttft_and_tpot(ours, args.output_len, args.runs)
    bandwidth, read_bandwidth = memory_bandwidth(device)
    nbytes = weight_bytes(llm.engine.core.runner.model)
    floor = nbytes / bandwidth
    read_floor = nbytes / read_bandwidth

    def row(engine: str, ttft_s: float, tpot_s: float) -> dict[str, object]:
        timed_ok = tpot_s > 0  # else too noisy for rates and ratios
        return {"engine": engine, "TTFT ms": round(ttft_s * 1e3, 1),
                "TPOT ms": round(tpot_s * 1e3, 2),
                "decode tok/s": round(1 / tpot_s, 1) if timed_ok else None,
                "TPOT / floor": round(tpot_s / floor, 2) if timed_ok else None,
                "TPOT / read floor": round(tpot_s / read_floor, 2) if timed_ok else None,
                "kvserve TPOT speedup": (round(tpot_s / tpot, 2) if timed_ok and tpot > 0
                                         else None)}

    rows = [row(f"kvserve {str(cfg.dtype).removeprefix('torch.')}", ttft, tpot)]
    hf = load_hf(args.model, cfg.dtype, device) if "hf" in args.baseline else None
    if hf is not None:
        for static_cache in [False, True] if args.hf_compile else [False]:
            def theirs(n: int, static_cache: bool = static_cache) -> float:
                return timed(lambda: hf_generate_batch(hf, [prompt], n,
                                                       static_cache=static_cache), device)
            rows.append(row("transformers static+compile" if static_cache else "transformers",
                            *ttft_and_tpot(theirs, args.output_len, args.runs)))
    for peer in each_peer(args.baseline, args.model, cfg.dtype,
                          args.prompt_len + args.output_len, device):
        rows.append(row(peer.name, *ttft_and_tpot(
            lambda n, peer=peer: peer.request_seconds(prompt, n), args.output_len, args.runs)))
        print_table(rows[-1:])
    rows.append({"engine": "copy-bandwidth floor", "TPOT ms": round(floor * 1e3, 2),
                 "decode tok/s": round(1 / floor, 1), "TPOT / floor": 1.0})
    rows.append({"engine": "read-bandwidth floor", "TPOT ms": round(read_floor * 1e3, 2),
                 "decode tok/s": round(1 / read_floor, 1), "TPOT / read floor": 1.0})
    print_table(rows, title=(
        f"latency, batch 1, {args.prompt_len}-token prompt, {args.output_len} new tokens, "
        f"{args.model}, {cfg.dtype}, {device}; floor = {nbytes / 1e6:.0f} MB of weights at "
        f"{bandwidth / 1e9:.1f} GB/s copy / {read_bandwidth / 1e9:.1f} GB/s read bandwidth"))
    save_json(args.json, {"benchmark": "latency", "model": args.model, "device": device,
                          "rows": rows,
                          "weight_bytes": nbytes, "copy_bandwidth": bandwidth,
                          "read_bandwidth": read_bandwidth})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("latency", help="batch-1 TTFT and TPOT against the bandwidth floor")
    add_engine_args(p)
    p.add_argument("--prompt-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--runs", type=positive_int, default=3)
    add_baseline_arg(p)
    p.add_argument("--hf-compile", action="store_true",
                   help="also time transformers with a static cache, which it compiles on CUDA")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)
