"""`kvserve eval perplexity`: held-out perplexity through the engine, and through
transformers on the same checkpoint, windows and device as the check.

The text is the held-out split of the standard library's sources (`tools/corpus.py`), which
the trained test models never saw, cut into windows of `--context` tokens. The engine scores
every token after a window's first from its `prompt_logprobs`.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from kvserve.arg_types import at_least_two, positive_int
from kvserve.benchmarks.device import synchronize
from kvserve.benchmarks.report import print_table, save_json
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.sampling_params import SamplingParams
from kvserve.tools.corpus import heldout_windows


def engine_nll(llm, windows: list[list[int]]) -> float:  # noqa: ANN001 (kvserve.LLM)
    """Summed negative log-likelihood of every window token after the first."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params)
    return -sum(out.prompt_logprobs[i][w[i]].logprob
                for w, out in zip(windows, outputs, strict=True) for i in range(1, len(w)))


@torch.inference_mode()
def hf_nll(model, windows: list[list[int]], batch_size: int = 8) -> float:  # noqa: ANN001
    total = 0.0
    for start in range(0, len(windows), batch_size):
        ids = torch.tensor(windows[start:start + batch_size], device=model.device)
        logprobs = torch.log_softmax(model(ids).logits[:, :-1].float(), dim=-1)
        total -= float(logprobs.gather(2, ids[:, 1:].unsqueeze(2)).sum())
    return total


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM
    from kvserve.benchmarks.hf_baseline import load_hf

    llm = LLM(**engine_kwargs(args))
    cfg, device = llm.engine.config.model, llm.engine.config.device
    if args.context > llm.engine.max_model_len:
        raise ValueError(f"--context ({args.context}) exceeds the model's max length "
                         f"({llm.engine.max_model_len})")
    windows = heldout_windows(llm.get_tokenizer(), args.context, args.num_windows).tolist()
    if not windows:
        raise ValueError(f"--context ({args.context}) is longer than the held-out text")
    if len(windows) < args.num_windows:
        print(f"the held-out text holds {len(windows)} windows of {args.context} tokens, "
              f"not --num-windows {args.num_windows}: scoring those")
    num_scored = sum(len(w) - 1 for w in windows)

    def row(engine: str, nll: float, seconds: float) -> dict[str, object]:
        return {"engine": engine, "windows": len(windows), "tokens scored": num_scored,
                "nll/token": round(nll / num_scored, 4),
                "perplexity": round(math.exp(nll / num_scored), 3),
                "seconds": round(seconds, 1), "tokens/s": round(num_scored / seconds)}

    start = time.perf_counter()
    rows = [row("kvserve", engine_nll(llm, windows), time.perf_counter() - start)]
    hf = None if args.no_hf else load_hf(args.model, cfg.dtype, device)
    if hf is not None:
        start = time.perf_counter()
        nll = hf_nll(hf, windows)
        synchronize(device)
        rows.append(row("transformers", nll, time.perf_counter() - start))
    print_table(rows, title=f"held-out perplexity, {args.model}, {cfg.dtype}, {device}, "
                            f"windows of {args.context} tokens")
    save_json(args.json, {"eval": "perplexity", "model": args.model, "dtype": str(cfg.dtype),
                          "context": args.context, "rows": rows})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("perplexity", help="held-out perplexity, beside transformers'")
    add_engine_args(p, model="positional")
    p.add_argument("--context", type=at_least_two, default=256,
                   help="tokens per window (default 256)")
    p.add_argument("--num-windows", type=positive_int, default=64,
                   help="held-out windows scored (default 64)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers check")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)
