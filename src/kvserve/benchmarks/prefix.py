"""`kvserve bench prefix`: KV reuse on shared-prefix and multi-turn workloads.

Three engines run the same shuffled batch of prompts that share heads by group: prefix
caching off, caching on with the batch admitted in the caller's (FCFS) order, and caching on
with global prefix sharing (BatchLLM). The KV pool is sized to hold only a few groups at once,
which is where the admission order decides how often a head is computed. A multi-turn chat
replay then compares caching off and on. Each configuration gets a fresh engine per run; the
medians are reported with their ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from kvserve.arg_types import non_negative_int, positive_int
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.workloads import chat_script, shared_prefix
from kvserve.config import ModelConfig
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

CONFIGS = {
    "caching off": {"enable_prefix_caching": False, "prefix_sharing": "off"},
    "caching, FCFS": {"enable_prefix_caching": True, "prefix_sharing": "off"},
    "caching, global sharing": {"enable_prefix_caching": True, "prefix_sharing": "auto"},
}


def summarize(timed: list[tuple[RequestOutput, float]], wall: float, llm: Any
              ) -> dict[str, float]:
    """Throughput, mean TTFT (from each output's batch start), peak KV blocks, hit rate."""
    stats = llm.get_stats()
    outputs = [o for o, _ in timed]
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = [o.first_token_time - start for o, start in timed if o.first_token_time is not None]
    return {"wall s": wall, "req/s": len(outputs) / wall, "out tok/s": num_out / wall,
            "mean TTFT s": statistics.fmean(ttft), "peak KV blocks": stats.kv_blocks_peak,
            "hit rate %": 100 * stats.prefix_cache_hit_rate}


def shared_run(args: argparse.Namespace, options: dict[str, Any], vocab: int,
               kv_bytes: int) -> dict[str, float]:
    from kvserve import LLM

    work = shared_prefix(args.groups, args.group_size, args.prefix_len, args.suffix_len,
                         args.output_len, vocab, args.workload_seed)
    llm = LLM(**{**engine_kwargs(args), "kv_cache_memory": kv_bytes, **options})
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.monotonic()
    outputs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params,
                           use_tqdm=False)
    return summarize([(o, start) for o in outputs], time.monotonic() - start, llm)


def chat_run(args: argparse.Namespace, caching: bool) -> dict[str, float]:
    """Every conversation takes its turns in step with the others: one batch per turn, each
    prompt the whole conversation so far."""
    from kvserve import LLM

    llm = LLM(**{**engine_kwargs(args), "enable_prefix_caching": caching})
    script = chat_script(args.chats, args.turns, args.chat_system_words, args.chat_user_words,
                         args.workload_seed)
    chats = [[{"role": "system", "content": script.system}] for _ in range(args.chats)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    timed: list[tuple[RequestOutput, float]] = []
    wall = 0.0
    for turn_index in range(args.turns):
        for chat, messages in zip(chats, script.user_messages, strict=True):
            chat.append({"role": "user", "content": messages[turn_index]})
        start = time.monotonic()
        turn = llm.chat(chats, params, use_tqdm=False)
        wall += time.monotonic() - start
        for chat, out in zip(chats, turn, strict=True):
            chat.append({"role": "assistant", "content": out.outputs[0].text})
        timed += [(o, start) for o in turn]
    return summarize(timed, wall, llm)


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def table_row(label: str, median: dict[str, float]) -> dict[str, object]:
    digits = {"out tok/s": 1, "hit rate %": 1, "peak KV blocks": None}
    return {"config": label, **{key: round(value, digits.get(key, 3))
                                for key, value in median.items()}}


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    model = ModelConfig.from_pretrained(args.model)
    blocks_per_request = -(-(args.prefix_len + args.suffix_len + args.output_len)
                           // args.block_size)
    prefix_blocks = args.prefix_len // args.block_size
    group_blocks = prefix_blocks + args.group_size * (blocks_per_request - prefix_blocks)
    pool_blocks = args.pool_groups * group_blocks
    kv_bytes = pool_blocks * args.block_size * model.kv_bytes_per_token
    print(f"shared-prefix batch: {args.groups} groups x {args.group_size} requests, "
          f"{args.prefix_len} shared + {args.suffix_len} own tokens -> {args.output_len}; "
          f"KV pool of {pool_blocks} blocks ({kv_bytes / 2**20:.0f} MiB), enough for "
          f"{args.pool_groups} groups at once", flush=True)
    LLM(**engine_kwargs(args)).generate("warm-up", use_tqdm=False)  # first-use costs
    results = {}
    for label, options in CONFIGS.items():
        runs = []
        for i in range(args.runs):
            runs.append(shared_run(args, options, model.vocab_size, kv_bytes))
            print(f"  {label}, run {i + 1}: {runs[-1]['wall s']:.1f} s", flush=True)
        results[label] = medians(runs)
    off, fcfs, shared = (r["req/s"] for r in results.values())
    rows = [table_row(label, median) for label, median in results.items()]
    print_table(rows, title=f"shared-prefix batch, {args.model} (median of {args.runs})")
    ratios = {"caching / off": round(fcfs / off, 2),
              "global sharing / off": round(shared / off, 2),
              "global sharing / caching FCFS": round(shared / fcfs, 2)}
    print_table([ratios], title="throughput ratios")
    chat_rows = []
    if args.turns:
        print(f"\nmulti-turn replay: {args.chats} chats x {args.turns} turns", flush=True)
        chat = {label: medians([chat_run(args, caching) for _ in range(args.runs)])
                for label, caching in (("caching off", False), ("caching on", True))}
        chat_rows = [table_row(label, median) for label, median in chat.items()]
        print_table(chat_rows, title=f"multi-turn chat, {args.chats} chats x {args.turns} "
                                     f"turns (median of {args.runs})")
        ratios["multi-turn caching / off"] = round(
            chat["caching on"]["req/s"] / chat["caching off"]["req/s"], 2)
        print(f"multi-turn throughput ratio, caching / off: {ratios['multi-turn caching / off']}")
    save_json(args.json, {"benchmark": "prefix", "model": args.model, "pool_blocks": pool_blocks,
                          "shared": rows, "ratios": ratios, "multi_turn": chat_rows})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefix", help="prefix caching and global prefix sharing on "
                                      "shared-prefix and multi-turn workloads")
    add_engine_args(p)
    p.add_argument("--groups", type=positive_int, default=8)
    p.add_argument("--group-size", type=positive_int, default=16)
    p.add_argument("--prefix-len", type=non_negative_int, default=512,
                   help="tokens shared by a group")
    p.add_argument("--suffix-len", type=non_negative_int, default=32,
                   help="tokens of each request's own")
    p.add_argument("--output-len", type=positive_int, default=32)
    p.add_argument("--pool-groups", type=positive_int, default=3,
                   help="size the KV pool to hold this many groups at once")
    p.add_argument("--chats", type=positive_int, default=16, help="multi-turn: conversations")
    p.add_argument("--turns", type=non_negative_int, default=4,
                   help="multi-turn: turns each (0: skip)")
    p.add_argument("--chat-system-words", type=non_negative_int, default=200)
    p.add_argument("--chat-user-words", type=positive_int, default=40)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--runs", type=positive_int, default=1,
                   help="runs per configuration; the median is reported")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.set_defaults(func=run)
