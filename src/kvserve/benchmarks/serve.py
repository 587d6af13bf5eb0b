"""`kvserve bench serve`: replay a synthetic workload against an OpenAI-compatible server.

Requests arrive as a Poisson process at each swept rate (or at a fixed concurrency) with
random token prompts, and stream their completions. Per rate it reports percentiles of
TTFT, TPOT, ITL (the gap between streamed chunks), TBT (Sarathi-Serve's time between
tokens: each chunk's gap shared among the tokens it brings, counted by the server's
continuous usage, since a token that adds no text sends no chunk of its own) and end-to-end
latency; throughput; goodput (requests per second that meet both the TTFT and the TPOT
SLO, DistServe's definition); and how fast `/health` answered meanwhile.

With `--model PATH` it starts `kvserve serve` itself once per `--policies` entry, so the
stall-free chunked schedule and the prefill-first baseline are compared in one command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter

import httpx

from kvserve.arg_types import positive_float, positive_int
from kvserve.benchmarks.report import print_table, pyplot, save_json
from kvserve.benchmarks.workloads import Workload, variable
from kvserve.config import SCHEDULER_POLICIES, ModelConfig
from kvserve.engine_args import add_engine_args, engine_flags
from kvserve.entrypoints.openai.launch import server_process


@dataclass
class RequestResult:
    ok: bool
    error: str = ""  # the server's answer to a request it refused
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    tbts: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(1, self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    start = perf_counter()
    result, last, last_token = RequestResult(ok=False), None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            result.error = f"{response.status_code} {(await response.aread()).decode()[:300]}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = perf_counter()
            # Tokens so far: the server's count where it streams one, else a token a chunk.
            tokens = (chunk.get("usage") or {}).get("completion_tokens",
                                                    result.output_tokens + 1)
            if not chunk.get("choices"):  # the closing usage
                result.output_tokens = tokens
                continue
            new, result.output_tokens = tokens - result.output_tokens, tokens
            if last is None:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            if new > 0:
                if last_token is not None:
                    result.tbts += [(now - last_token) / new] * new
                last_token = now
            last = now
    result.e2e = perf_counter() - start
    result.ok = result.output_tokens > 0
    return result


async def probe_health(client: httpx.AsyncClient, url: str, stop: asyncio.Event,
                       latencies: list[float], interval: float = 0.05) -> None:
    while not stop.is_set():
        start = perf_counter()
        await client.get(f"{url}/health")
        latencies.append(perf_counter() - start)
        await asyncio.sleep(interval)


async def send_all(workload: Workload,
                   request: Callable[[list[int], int], Awaitable[RequestResult]],
                   rate: float | None, concurrency: int | None, seed: int
                   ) -> tuple[list[RequestResult], float]:
    """Sends every request of the workload through `request(prompt, output_len)`: arriving
    as a Poisson process at `rate` per second, at most `concurrency` at a time; returns
    their results and the wall time."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency or len(workload.prompts))

    async def send(prompt: list[int], output_len: int) -> RequestResult:
        async with gate:
            return await request(prompt, output_len)

    start = perf_counter()
    tasks = []
    for prompt, output_len in zip(workload.prompts, workload.output_lens, strict=True):
        tasks.append(asyncio.create_task(send(prompt, output_len)))
        if rate:
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return list(results), perf_counter() - start


async def run_load(url: str, model: str, workload: Workload, rate: float | None,
                   concurrency: int | None, seed: int) -> tuple[list[RequestResult], float,
                                                                list[float]]:
    """Sends every request (Poisson at `rate`, or `concurrency` at a time); returns the
    results, the wall time and the /health latencies seen meanwhile."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client, \
            httpx.AsyncClient(timeout=30) as health_client:
        stop, health = asyncio.Event(), []
        prober = asyncio.create_task(probe_health(health_client, url, stop, health))
        results, wall = await send_all(
            workload, lambda prompt, n: one_request(client, url, model, prompt, n), rate,
            concurrency, seed)
        stop.set()
        await prober
    return list(results), wall, health


def summarize(results: list[RequestResult], wall: float, health: list[float],
              slo_ttft: float, slo_tpot: float) -> dict[str, float]:
    done = [r for r in results if r.ok]
    good = [r for r in done if r.ttft <= slo_ttft and r.tpot <= slo_tpot]
    ttft, tpot = [r.ttft for r in done], [r.tpot for r in done]
    itl = [x for r in done for x in r.itls]
    tbt = [x for r in done for x in r.tbts]
    e2e = [r.e2e for r in done]

    def ms(seconds: float) -> float:
        return round(seconds * 1e3) if math.isfinite(seconds) else seconds

    return {
        "completed": len(done), "failed": len(results) - len(done),
        "req/s": round(len(done) / wall, 3),
        "out tok/s": round(sum(r.output_tokens for r in done) / wall, 1),
        "goodput req/s": round(len(good) / wall, 3),
        "SLO met %": round(100 * len(good) / max(1, len(results)), 1),
        "TTFT p50 ms": ms(percentile(ttft, 50)), "TTFT p90 ms":
            ms(percentile(ttft, 90)), "TTFT p99 ms": ms(percentile(ttft, 99)),
        "TPOT p50 ms": ms(percentile(tpot, 50)), "TPOT p90 ms":
            ms(percentile(tpot, 90)), "TPOT p99 ms": ms(percentile(tpot, 99)),
        "ITL p50 ms": ms(percentile(itl, 50)), "ITL p99 ms":
            ms(percentile(itl, 99)),
        "TBT p50 ms": ms(percentile(tbt, 50)), "TBT p99 ms":
            ms(percentile(tbt, 99)),
        "E2E p50 s": round(percentile(e2e, 50), 2), "E2E p99 s": round(percentile(e2e, 99), 2),
        "health p99 ms": round(percentile(health, 99) * 1e3, 1),
        "health max ms": round(max(health, default=float("nan")) * 1e3, 1),
    }


@contextmanager
def local_server(args: argparse.Namespace, policy: str) -> Iterator[str]:
    """`kvserve serve` with every engine flag this command was given, under `policy`."""
    flags = [*engine_flags(args), "--scheduler-policy", policy,
             "--served-model-name", args.served_model_name]
    with server_process(args.model, flags) as url:
        yield url


def sweep(url: str, args: argparse.Namespace, label: str) -> list[dict[str, object]]:
    vocab = (ModelConfig.from_pretrained(args.model, args.dtype, args.device).vocab_size
             if args.model else args.vocab_size)
    warmup = variable(2, (16, 16), (4, 4), vocab, seed=args.seed)
    results, _, _ = asyncio.run(run_load(url, args.served_model_name, warmup, None, 2,
                                         args.seed))
    refused = [r.error for r in results if r.error]
    if refused:  # every request after would be refused the same way
        raise ValueError(f"the server refused a warm-up request (check --served-model-name "
                         f"and --vocab-size): {refused[0]}")
    rows = []
    for index, rate in enumerate(args.rates or [None]):
        # Fresh prompts at each rate, the same for every schedule: a prefix cache must not
        # serve one rate's prompts from the last's.
        workload = variable(args.num_prompts, (args.prompt_min, args.prompt_max),
                            (args.output_min, args.output_max), vocab, seed=args.seed + 1 + index)
        results, wall, health = asyncio.run(run_load(
            url, args.served_model_name, workload, rate, args.concurrency, args.seed))
        row: dict[str, object] = {"schedule": label, "rate": rate or f"c={args.concurrency}"}
        row.update(summarize(results, wall, health, args.slo_ttft, args.slo_tpot))
        print(f"  {label} at rate {row['rate']}: {row['completed']} done, p99 TTFT "
              f"{row['TTFT p99 ms']} ms, p99 TPOT {row['TPOT p99 ms']} ms", flush=True)
        rows.append(row)
    return rows


def plot(rows: list[dict[str, object]], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label in dict.fromkeys(str(r["schedule"]) for r in rows):
        mine = [r for r in rows if r["schedule"] == label and isinstance(r["rate"], float)]
        rates = [r["rate"] for r in mine]
        for ax, key in zip(axes, ["TTFT p99 ms", "TPOT p99 ms", "goodput req/s"], strict=True):
            ax.plot(rates, [r[key] for r in mine], marker="o", label=label)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(key)
            ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


def run(args: argparse.Namespace) -> None:
    if bool(args.url) == bool(args.model):
        raise ValueError("give either --url (a running server) or --model (start one per "
                         "--policies entry)")
    for name in ("prompt", "output"):
        low, high = getattr(args, f"{name}_min"), getattr(args, f"{name}_max")
        if low > high:
            raise ValueError(f"--{name}-min ({low}) must be <= --{name}-max ({high})")
    rows: list[dict[str, object]] = []
    if args.url:
        url = args.url.rstrip("/")
        try:
            httpx.get(f"{url}/v1/models", timeout=10).raise_for_status()
        except httpx.HTTPError as e:
            raise ValueError(f"--url: no OpenAI-compatible server answers at {url} "
                             f"({e})") from None
        rows += sweep(url, args, "server")
    else:
        for policy in args.policies:
            print(f"\nstarting kvserve serve --scheduler-policy {policy}")
            with local_server(args, policy) as url:
                rows += sweep(url, args, policy)
    columns = ["schedule", "rate", "completed", "out tok/s", "goodput req/s", "SLO met %",
               "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "TBT p99 ms",
               "ITL p99 ms", "E2E p99 s", "health p99 ms", "health max ms"]
    print_table([{c: r[c] for c in columns} for r in rows], title=(
        f"bench serve: {args.num_prompts} requests, prompts {args.prompt_min}-{args.prompt_max}"
        f" tokens, outputs {args.output_min}-{args.output_max}; SLO TTFT <= {args.slo_ttft} s,"
        f" TPOT <= {args.slo_tpot} s"))
    _print_ratios(rows, args.policies if not args.url else [])
    save_json(args.json, {"benchmark": "serve", "args": {k: v for k, v in vars(args).items()
                                                         if k != "func"}, "rows": rows})
    if args.plot:
        plot(rows, args.plot)


def _print_ratios(rows: list[dict[str, object]], policies: list[str]) -> None:
    if len(policies) != 2:
        return
    base, other = policies[1], policies[0]
    ratios = []
    for row in rows:
        if row["schedule"] != other:
            continue
        twin = next(r for r in rows if r["schedule"] == base and r["rate"] == row["rate"])
        ratios.append({
            "rate": row["rate"],
            f"TPOT p99 {base} / {other}": _ratio(twin["TPOT p99 ms"], row["TPOT p99 ms"]),
            f"TBT p99 {base} / {other}": _ratio(twin["TBT p99 ms"], row["TBT p99 ms"]),
            f"goodput {other} / {base}": _ratio(row["goodput req/s"], twin["goodput req/s"]),
        })
    print_table(ratios, title="ratios at the same request rate")


def _ratio(a: object, b: object) -> float | str:
    a, b = float(a), float(b)  # type: ignore[arg-type]
    return round(a / b, 2) if b else "inf"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="latency, throughput and goodput of a server under load")
    p.add_argument("--url", default=None, help="a running OpenAI-compatible server")
    # --model: a checkpoint to serve locally, once per --policies entry, with these flags.
    add_engine_args(p, model="optional")
    p.set_defaults(max_num_batched_tokens=256)  # --seed also seeds the workload
    p.add_argument("--served-model-name", default="bench")
    p.add_argument("--policies", nargs="+", default=["chunked", "prefill_first"],
                   choices=SCHEDULER_POLICIES, help="with --model: the schedules to compare")
    p.add_argument("--rates", type=positive_float, nargs="*", default=[0.5, 1.0, 2.0],
                   help="Poisson request rates to sweep (req/s)")
    p.add_argument("--concurrency", type=positive_int, default=None,
                   help="closed loop: this many requests in flight (with --rates none)")
    p.add_argument("--num-prompts", type=positive_int, default=32)
    p.add_argument("--prompt-min", type=positive_int, default=128)
    p.add_argument("--prompt-max", type=positive_int, default=512)
    p.add_argument("--output-min", type=positive_int, default=32)
    p.add_argument("--output-max", type=positive_int, default=128)
    p.add_argument("--vocab-size", type=positive_int, default=32000,
                   help="prompt token ids are drawn below this (with --url)")
    p.add_argument("--slo-ttft", type=positive_float, default=5.0, help="seconds")
    p.add_argument("--slo-tpot", type=positive_float, default=0.25,
                   help="seconds per output token (0.25: about reading speed)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG of p99 TTFT/TPOT and goodput vs rate")
    p.set_defaults(func=run)
