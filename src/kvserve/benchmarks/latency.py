"""`kvserve bench latency`: batch-1 TTFT and time per output token against the bandwidth floor.

The floor is the time to stream every matmul weight once (what one decode step must read)
at the bandwidth of the engine's device measured in the same run: a large copy (read + write
bytes counted), and a large read-only sum, which is what a decode step does with its weights.
Both are measured after every kvserve request and the medians taken (`BandwidthSamples`).
transformers runs on the same device, eagerly and, with `--hf-compile`, with a static cache
that it compiles; `--baseline vllm llamacpp` adds those engines (see `peers.py`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from kvserve.arg_types import at_least_two, positive_int
from kvserve.benchmarks.device import BandwidthSamples, on_one_gpu, synchronize, weight_bytes
from kvserve.benchmarks.hf_baseline import hf_request_times, load_hf
from kvserve.benchmarks.peers import add_baseline_arg, each_peer
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.workloads import fixed
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.sampling_params import SamplingParams


def ttft_and_tpot(request: Callable[[int], tuple[float, float]], output_len: int, runs: int
                  ) -> tuple[float, float]:
    """Median TTFT and TPOT of `runs` requests of output_len new tokens, each alone:
    `request(n)` gives the seconds from its start to its first token and to its last. TPOT
    is each request's own time after its first token, so the prefill's noise from one run to
    the next stays out of it; taken as a full request less a one-token one, it came out below
    zero behind a 4,096-token prompt that took llama.cpp 12.5 s to prefill."""
    request(4)  # first-use costs
    samples = [request(output_len) for _ in range(runs)]
    return (statistics.median(first for first, _ in samples),
            statistics.median((last - first) / (output_len - 1) for first, last in samples))


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    llm = LLM(**on_one_gpu(engine_kwargs(args), 2 if "hf" in args.baseline else 1))
    cfg, device = llm.engine.config.model, llm.engine.config.device
    prompt = fixed(1, args.prompt_len, args.output_len, cfg.vocab_size).prompts[0]

    bandwidth = BandwidthSamples(device)

    def ours(n: int) -> tuple[float, float]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.reset_prefix_cache()  # each request prefills its prompt, as for the peers
        synchronize(device)
        start = time.monotonic()
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        synchronize(device)
        times = output.first_token_time - start, time.monotonic() - start
        bandwidth.measure()
        return times

    ttft, tpot = ttft_and_tpot(ours, args.output_len, args.runs)
    nbytes = weight_bytes(llm.engine.core.runner.model)
    floor = nbytes / bandwidth.copy
    read_floor = nbytes / bandwidth.read

    def row(engine: str, ttft_s: float, tpot_s: float) -> dict[str, object]:
        return {"engine": engine, "TTFT ms": round(ttft_s * 1e3, 1),
                "TPOT ms": round(tpot_s * 1e3, 2), "decode tok/s": round(1 / tpot_s, 1),
                "TPOT / floor": round(tpot_s / floor, 2),
                "TPOT / read floor": round(tpot_s / read_floor, 2),
                "kvserve TPOT speedup": round(tpot_s / tpot, 2)}

    rows = [row(f"kvserve {str(cfg.dtype).removeprefix('torch.')}", ttft, tpot)]
    hf = load_hf(args.model, cfg.dtype, device) if "hf" in args.baseline else None
    if hf is not None:
        for static_cache in [False, True] if args.hf_compile else [False]:
            def theirs(n: int, static_cache: bool = static_cache) -> tuple[float, float]:
                return hf_request_times(hf, prompt, n, static_cache=static_cache)
            rows.append(row("transformers static+compile" if static_cache else "transformers",
                            *ttft_and_tpot(theirs, args.output_len, args.runs)))
    for peer in each_peer(args.baseline, args.model, cfg.dtype,
                          args.prompt_len + args.output_len, device):
        rows.append(row(peer.name, *ttft_and_tpot(
            lambda n, peer=peer: peer.request_times(prompt, n), args.output_len, args.runs)))
        print_table(rows[-1:])
    rows.append({"engine": "copy-bandwidth floor", "TPOT ms": round(floor * 1e3, 2),
                 "decode tok/s": round(1 / floor, 1), "TPOT / floor": 1.0})
    rows.append({"engine": "read-bandwidth floor", "TPOT ms": round(read_floor * 1e3, 2),
                 "decode tok/s": round(1 / read_floor, 1), "TPOT / read floor": 1.0})
    print_table(rows, title=(
        f"latency, batch 1, {args.prompt_len}-token prompt, {args.output_len} new tokens, "
        f"{args.model}, {cfg.dtype}, {device}; floor = {nbytes / 1e6:.0f} MB of weights at "
        f"{bandwidth.describe()}"))
    save_json(args.json, {"benchmark": "latency", "model": args.model, "device": device,
                          "rows": rows,
                          "weight_bytes": nbytes, "copy_bandwidth": bandwidth.copy,
                          "read_bandwidth": bandwidth.read,
                          "bandwidth_samples": bandwidth.samples})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("latency", help="batch-1 TTFT and TPOT against the bandwidth floor")
    add_engine_args(p)
    p.add_argument("--prompt-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=at_least_two, default=128,
                   help="new tokens a request; TPOT is timed over those after the first")
    p.add_argument("--runs", type=positive_int, default=3)
    add_baseline_arg(p)
    p.add_argument("--hf-compile", action="store_true",
                   help="also time transformers with a static cache, which it compiles on CUDA")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)
