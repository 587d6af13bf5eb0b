"""`kvserve bench throughput`: offline output tokens/s, kvserve against HF generate on the
same checkpoint and device (eagerly, and with `--hf-compile` also with a compiled static
cache), and with `--baseline vllm llamacpp` against those engines (see `peers.py`)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.arg_types import non_negative_float, positive_int
from kvserve.benchmarks.device import on_one_gpu, synchronize
from kvserve.benchmarks.hf_baseline import hf_generate_batch, hf_run, load_hf
from kvserve.benchmarks.peers import add_baseline_arg, each_peer
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.workloads import Workload, fixed, variable
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.sampling_params import SamplingParams


def kvserve_run(llm, work: Workload, temperature: float = 0.0) -> float:  # noqa: ANN001
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)
              for n in work.output_lens]
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    llm.reset_prefix_cache()  # a repeated run prefills its prompts again
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    synchronize(llm.engine.config.device)
    elapsed = time.perf_counter() - start
    got = [len(o.outputs[0].token_ids) for o in outputs]
    assert got == work.output_lens, "kvserve produced a different number of tokens"
    return elapsed


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    llm = LLM(**on_one_gpu(engine_kwargs(args), 2 if "hf" in args.baseline else 1))
    cfg, device = llm.engine.config.model, llm.engine.config.device
    vocab = cfg.vocab_size
    workloads = {
        "a": fixed(args.num_prompts, 128, 128, vocab, args.workload_seed),
        "b": variable(args.num_prompts, (32, 512), (16, 256), vocab, args.workload_seed),
        # nano-vllm's benchmark (bench.py): 256 requests, 100-1024 tokens in and out.
        "nano": variable(256, (100, 1024), (100, 1024), vocab, args.workload_seed),
    }
    selected = [workloads[w] for w in args.workloads]
    hf = load_hf(args.model, cfg.dtype, device) if "hf" in args.baseline else None
    hf_modes = {"hf": False, "hf static+compile": True} if args.hf_compile else {"hf": False}
    kvserve_run(llm, fixed(2, 16, 4, vocab))  # warm-up
    if hf is not None:
        for static_cache in hf_modes.values():
            hf_generate_batch(hf, [[5] * 16, [6] * 16], 4, static_cache=static_cache)
    rows = []
    for work in selected:
        before = llm.get_stats()
        times = [kvserve_run(llm, work, args.temperature) for _ in range(args.runs)]
        after = llm.get_stats()
        ours = work.num_output_tokens / statistics.median(times)
        row: dict[str, object] = {
            "workload": work.name,
            "kvserve s (median)": round(statistics.median(times), 2),
            "kvserve out tok/s": round(ours, 1),
            "kvserve total tok/s": round((work.num_output_tokens + work.num_prompt_tokens)
                                         / statistics.median(times), 1),
            # The share of step time an overlapped (async) scheduler could hide.
            "host % of steps": round(100 * (after.host_seconds - before.host_seconds)
                                     / (after.step_seconds - before.step_seconds), 1),
        }
        if hf is not None:
            for mode, static_cache in hf_modes.items():
                rates = {}
                for batch in args.hf_batch_sizes:
                    rates[batch] = work.num_output_tokens / hf_run(
                        hf, work, batch, args.temperature, static_cache)
                    print(f"  {mode} batch {batch}: {rates[batch]:.1f} useful out tok/s",
                          flush=True)
                best = max(rates, key=rates.__getitem__)
                row.update({f"{mode} best batch": best,
                            f"{mode} out tok/s": round(rates[best], 1),
                            f"ratio vs {mode}": round(ours / rates[best], 2)})
        rows.append(row)
        print_table(rows[-1:])
    longest = max(len(p) + n for w in selected for p, n in zip(w.prompts, w.output_lens,
                                                                strict=True))
    # Each peer runs alone, after kvserve: none keeps a process busy beside another's run.
    for peer in each_peer(args.baseline, args.model, cfg.dtype, longest, device):
        peer.run(fixed(2, 16, 4, vocab))  # first-use costs
        for work, row in zip(selected, rows, strict=True):
            rate = work.num_output_tokens / statistics.median(
                peer.run(work) for _ in range(args.runs))
            row.update({f"{peer.name} out tok/s": round(rate, 1),
                        f"ratio vs {peer.name}": round(row["kvserve out tok/s"] / rate, 2)})
            print(f"  {peer.name}, {work.name}: {rate:.1f} out tok/s", flush=True)
    print_table(rows, title=f"throughput, {args.model}, kvserve {cfg.dtype}, {device}, "
                            f"{torch.get_num_threads()} threads, temperature {args.temperature}")
    save_json(args.json, {"benchmark": "throughput", "model": args.model, "device": device,
                          "temperature": args.temperature, "rows": rows})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("throughput", help="offline throughput against HF generate")
    add_engine_args(p)
    p.add_argument("--workloads", nargs="+", choices=["a", "b", "nano"], default=["a", "b"],
                   help="a: N x 128 -> 128 tokens; b: N x [32,512] -> [16,256] tokens; "
                        "nano: nano-vllm's 256 x [100,1024] -> [100,1024] tokens")
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--runs", type=positive_int, default=3,
                   help="kvserve runs; the median is reported")
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="0 decodes greedily; above 0 both engines sample the full distribution")
    p.add_argument("--hf-batch-sizes", type=positive_int, nargs="+", default=[8, 32, 64])
    add_baseline_arg(p)
    p.add_argument("--hf-compile", action="store_true",
                   help="also run transformers with a static cache, which it compiles on CUDA")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.set_defaults(func=run)
