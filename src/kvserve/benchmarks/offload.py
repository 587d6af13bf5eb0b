"""`kvserve bench offload`: multi-turn chats on a KV pool too small to keep them, with and
without the prefix-cache offload tiers.

Chats take their turns round-robin, `--concurrency` at a time, each prompt the whole
conversation so far. The device pool holds only `--pool-chats` conversations, so by a chat's
next turn the others have evicted its KV. Three engines replay the same script:
- recompute: prefix caching on the device pool alone, so an evicted history is prefilled
  again;
- host tier: evicted blocks are kept in host memory (room for every chat) and loaded back;
- disk tier: a host tier as small as the pool, with a disk tier below it.
It reports TTFT from turn 2 on (where a history exists to reuse) and the tokens each tier
served, checks that every configuration produced the same greedy replies, and prints the
TTFT ratios against recompute.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

from kvserve.arg_types import non_negative_int, positive_int
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.serve import percentile
from kvserve.benchmarks.workloads import ChatScript, chat_script
from kvserve.config import ModelConfig
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.models.loader import load_tokenizer
from kvserve.sampling_params import SamplingParams


def replay(llm: Any, script: ChatScript, concurrency: int, output_len: int
           ) -> tuple[list[float], list[list[int]], float]:
    """TTFTs of the turns after the first, every reply's token ids, and the wall time."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    chats = [[{"role": "system", "content": script.system}] for _ in script.user_messages]
    num_turns = len(script.user_messages[0])
    ttfts, replies = [], []
    start = time.perf_counter()
    for turn in range(num_turns):
        for first in range(0, len(chats), concurrency):
            wave = list(range(first, min(first + concurrency, len(chats))))
            for i in wave:
                chats[i].append({"role": "user", "content": script.user_messages[i][turn]})
            wave_start = time.monotonic()
            outputs = llm.chat([chats[i] for i in wave], params, use_tqdm=False)
            for i, out in zip(wave, outputs, strict=True):
                chats[i].append({"role": "assistant", "content": out.outputs[0].text})
                replies.append(out.outputs[0].token_ids)
                if turn > 0:
                    ttfts.append(out.first_token_time - wave_start)
    return ttfts, replies, time.perf_counter() - start


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    model = ModelConfig.from_pretrained(args.model, args.dtype, args.device)
    script = chat_script(args.chats, args.turns, args.system_words, args.user_words,
                         args.workload_seed)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    last = [{"role": "system", "content": script.system}]
    for message in script.user_messages[0]:
        last += [{"role": "user", "content": message}, {"role": "assistant", "content": "x"}]
    chat_tokens = (len(tokenizer.apply_chat_template(last, tokenize=True, return_dict=False))
                   + args.turns * args.output_len)
    block_bytes = model.kv_bytes_per_token * args.block_size
    chat_blocks = -(-chat_tokens // args.block_size)
    pool = args.pool_chats * chat_blocks * block_bytes
    every_chat = 2 * args.chats * chat_blocks * block_bytes
    print(f"{args.chats} chats x {args.turns} turns, up to {chat_tokens} tokens each; the KV "
          f"pool holds {args.pool_chats} of them ({pool / 2**20:.0f} MiB)", flush=True)
    rows, replies_by, ttft_by = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="kvserve-offload-") as folder:
        configs = {
            "recompute": {},
            "host tier": {"kv_offload_host": every_chat},
            "disk tier": {"kv_offload_host": pool, "kv_offload_dir": folder},
        }
        for label, options in configs.items():
            llm = LLM(**{**engine_kwargs(args), "kv_cache_memory": pool, **options})
            ttfts, replies, wall = replay(llm, script, args.concurrency, args.output_len)
            stats = llm.get_stats()
            kv = llm.engine.core.kv_cache
            kv.check_integrity()
            assert kv.num_used_blocks == 0 and kv.num_used_host_blocks == 0
            ttft_by[label], replies_by[label] = statistics.fmean(ttfts), replies
            device_hits = (stats.prefix_cache_hits - stats.prefix_cache_host_hits
                           - stats.prefix_cache_disk_hits)
            rows.append({"config": label, "wall s": round(wall, 1),
                         "TTFT mean s": round(ttft_by[label], 3),
                         "TTFT p50 s": round(percentile(ttfts, 50), 3),
                         "TTFT p99 s": round(percentile(ttfts, 99), 3),
                         "hit tokens device": device_hits,
                         "host": stats.prefix_cache_host_hits,
                         "disk": stats.prefix_cache_disk_hits,
                         "recomputed %": round(100 * (1 - stats.prefix_cache_hit_rate), 1)})
            print(f"  {label}: {wall:.1f} s", flush=True)
            del llm
    same = all(replies == replies_by["recompute"] for replies in replies_by.values())
    print_table(rows, title=f"multi-turn, {args.model} on {args.device}, turns 2-{args.turns}")
    ratios = {f"TTFT recompute / {label}": round(ttft_by["recompute"] / ttft_by[label], 2)
              for label in ttft_by if label != "recompute"}
    print_table([{**ratios, "identical greedy replies": same}], title="ratios")
    save_json(args.json, {"benchmark": "offload", "model": args.model, "device": args.device,
                          "rows": rows, "ratios": ratios, "identical": same})
    if not same:
        raise SystemExit("the configurations produced different greedy replies")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("offload", help="multi-turn chats with an undersized KV pool: "
                                       "recompute against host and disk offload tiers")
    add_engine_args(p)
    p.add_argument("--chats", type=positive_int, default=32)
    p.add_argument("--turns", type=positive_int, default=6)
    p.add_argument("--concurrency", type=positive_int, default=4, help="chats served at once")
    p.add_argument("--pool-chats", type=positive_int, default=4,
                   help="size the KV pool to hold this many whole conversations")
    p.add_argument("--system-words", type=non_negative_int, default=200)
    p.add_argument("--user-words", type=positive_int, default=40)
    p.add_argument("--output-len", type=positive_int, default=32)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results to this file")
    p.set_defaults(func=run)
