"""`kvserve eval streaming`: perplexity over a text far longer than a window, as
StreamingLLM measures it.

One long held-out text is scored token by token (from `prompt_logprobs`, the step budget one
block, so the window slides block by block) by three configurations with the same cache
size, `--window-tokens`:
- in-window: the text cut into independent windows of that many tokens, each scored from
  its start with dense attention: the perplexity the model has within its trained length;
- sinks + window: the first `--sinks` tokens' blocks kept, the rest a sliding window;
- window only: a sliding window without sinks;
and, as far as the model's positions reach (`max_model_len`), dense attention over the whole
text so far, which is what goes wrong past the length a model was trained on.
The table compares the mean perplexity over the tokens after the first window (where the
window slides) with the in-window one, and `--png` draws each configuration's perplexity
along the text.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from kvserve.arg_types import non_negative_int, positive_int
from kvserve.benchmarks.report import print_table, pyplot, save_json
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.sampling_params import SamplingParams
from kvserve.tools.corpus import corpus_tokens


def token_nlls(llm: Any, prompts: list[list[int]]) -> list[float | None]:
    """The negative log-likelihood of every prompt token, the prompts joined; None for each
    prompt's first, which nothing predicts."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [None if i == 0 else -out.prompt_logprobs[i][p[i]].logprob
            for p, out in zip(prompts, outputs, strict=True) for i in range(len(p))]


def perplexity(nlls: list[float | None]) -> float:
    scored = [n for n in nlls if n is not None]
    return math.exp(sum(scored) / len(scored))


def check_shape(args: argparse.Namespace) -> None:
    """Refuses, before a model loads, a cache in which the window could not slide."""
    window, block = args.window_tokens, args.block_size
    if window % block:
        raise ValueError(f"--window-tokens ({window}) must be a multiple of --block-size "
                         f"({block})")
    sink_blocks = -(-args.sinks // block)
    if window // block - sink_blocks < 2:
        raise ValueError(f"--window-tokens ({window}) must hold the --sinks ({args.sinks}) "
                         f"and a window of 2 blocks of {block} tokens: at least "
                         f"{(sink_blocks + 2) * block}")
    if args.num_tokens <= window:
        raise ValueError(f"--num-tokens ({args.num_tokens}) must exceed --window-tokens "
                         f"({window}): the tokens after the first window are compared")


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    check_shape(args)
    base = {**engine_kwargs(args), "enable_prefix_caching": False,
            "max_num_batched_tokens": args.block_size}
    dense = LLM(**base)
    window = args.window_tokens
    if window > dense.engine.max_model_len:
        raise ValueError(f"--window-tokens ({window}) exceeds the model's max length "
                         f"({dense.engine.max_model_len})")
    text = corpus_tokens(dense.get_tokenizer(), "heldout", args.num_tokens).tolist()
    if len(text) <= window:
        raise ValueError(f"the held-out text holds {len(text)} tokens, no more than "
                         f"--window-tokens ({window})")
    if len(text) < args.num_tokens:
        print(f"the held-out text holds {len(text)} tokens, not --num-tokens "
              f"{args.num_tokens}: scoring those")
    # In-window: position p of the text is scored within its own window (never its first).
    windows = [text[start:start + window] for start in range(0, len(text), window)]
    in_window = token_nlls(dense, windows)
    full = token_nlls(dense, [text[:dense.engine.max_model_len - 1]])
    del dense
    sink_blocks = -(-args.sinks // args.block_size)
    curves = {"in-window (dense)": in_window, "dense, whole text": full}
    for label, sinks, blocks in (("sinks + window", args.sinks, window // args.block_size
                                  - sink_blocks),
                                 ("window only", 0, window // args.block_size)):
        llm = LLM(**{**base, "streaming_window": blocks, "attention_sinks": sinks})
        curves[label] = token_nlls(llm, [text])
        kv = llm.engine.core.kv_cache
        kv.check_integrity()
        assert kv.num_used_blocks == 0
        del llm
    # Compared on the tokens after the first window, where the streams slide, less each
    # window's first (which in-window cannot score).
    after_first = {label: [n if p % window else None for p, n in enumerate(nlls)][window:]
                   for label, nlls in curves.items()}
    reference = perplexity(after_first["in-window (dense)"])
    rows = [{"config": label, "cache tokens": len(curves[label]) if "whole" in label else window,
             "tokens scored": sum(n is not None for n in nlls),
             "perplexity": round(perplexity(nlls), 3),
             "vs in-window": round(perplexity(nlls) / reference, 3)}
            for label, nlls in after_first.items()]
    print_table(rows, title=f"{args.model}: {len(text)} held-out tokens, perplexity after "
                            f"the first {window}")
    if args.png:
        plot(curves, args.segment, args.png,
             f"{Path(args.model).name}: {len(text)} held-out tokens, a cache of {window}")
    save_json(args.json, {"eval": "streaming", "model": args.model, "num_tokens": len(text),
                          "window_tokens": window, "sinks": args.sinks, "rows": rows})


def plot(curves: dict[str, list[float | None]], segment: int, path: str, title: str) -> None:
    """Perplexity of each `segment` of tokens along the text, per configuration."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for (label, nlls), style in zip(curves.items(), ("-", "-", "-", "--"), strict=True):
        starts = range(0, len(nlls) - segment + 1, segment)
        ax.plot([s + segment for s in starts],
                [perplexity(nlls[s:s + segment]) for s in starts], style, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("tokens into the text")
    ax.set_ylabel(f"perplexity (per {segment} tokens)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("streaming", help="perplexity far past the window: attention sinks "
                                         "against window-only eviction (StreamingLLM)")
    add_engine_args(p, model="positional")
    p.add_argument("--num-tokens", type=positive_int, default=8192, help="length of the text")
    p.add_argument("--window-tokens", type=positive_int, default=256,
                   help="cache size of every configuration (a multiple of --block-size)")
    p.add_argument("--sinks", type=non_negative_int, default=4, help="attention sink tokens")
    p.add_argument("--segment", type=positive_int, default=256, help="plot: tokens per point")
    p.add_argument("--png", default=None, help="draw the perplexity curves to this file")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)
