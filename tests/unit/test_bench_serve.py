"""The serve benchmark's client: the tokens and gaps it reads from a completion stream."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from kvserve.benchmarks import serve
from kvserve.entrypoints.cli import build_parser


def completion_stream(chunks: list[dict]) -> httpx.MockTransport:
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.MockTransport(lambda request: httpx.Response(200, content=body.encode()))


def read(chunks: list[dict], clock: list[float], monkeypatch) -> serve.RequestResult:
    """one_request over `chunks`, the clock reading `clock` at the start, at each chunk and
    at the end."""
    times = iter(clock)
    monkeypatch.setattr(serve, "perf_counter", lambda: next(times))

    async def main() -> serve.RequestResult:
        async with httpx.AsyncClient(transport=completion_stream(chunks)) as client:
            return await serve.one_request(client, "http://server", "m", [1, 2], 8)
    return asyncio.run(main())


def text(piece: str, tokens: int | None = None) -> dict:
    usage = {} if tokens is None else {"usage": {"completion_tokens": tokens}}
    return {"choices": [{"index": 0, "text": piece}], **usage}


def test_a_chunk_that_brings_several_tokens_shares_its_gap_among_them(monkeypatch):
    """Tokens that add no text send no chunk: the next chunk's gap covers them all, one TBT
    each, while ITL keeps the gap between chunks."""
    chunks = [text("a", 1), text("bc", 3), text("d", 4), text("", 4),
              {"choices": [], "usage": {"completion_tokens": 4}}]
    result = read(chunks, [0.0, 1.0, 1.3, 1.4, 1.45, 1.5, 2.0], monkeypatch)
    assert result.ok and result.output_tokens == 4
    assert result.ttft == 1.0 and result.e2e == 2.0
    assert result.itls == pytest.approx([0.3, 0.1, 0.05])
    # The closing chunk with no new token adds an ITL but no TBT.
    assert result.tbts == pytest.approx([0.15, 0.15, 0.1])
    row = serve.summarize([result], 2.0, [0.01], slo_ttft=5.0, slo_tpot=1.0)
    assert row["TBT p99 ms"] == 150 and row["ITL p99 ms"] == 300


def test_without_the_servers_count_each_chunk_is_one_token(monkeypatch):
    chunks = [text("a"), text("b"), text("c"), {"choices": [], "usage": {
        "completion_tokens": 5}}]
    result = read(chunks, [0.0, 0.5, 0.7, 1.0, 1.1, 1.2], monkeypatch)
    assert result.output_tokens == 5  # the closing usage has the last word
    assert result.tbts == pytest.approx([0.2, 0.3]) and result.itls == result.tbts


def test_a_refused_request_keeps_the_servers_answer_and_the_summary_survives_none_done():
    refusal = {"error": {"message": "model 'x' does not exist"}}

    async def main() -> serve.RequestResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(404, json=refusal))
        async with httpx.AsyncClient(transport=transport) as client:
            return await serve.one_request(client, "http://server", "x", [1, 2], 8)
    result = asyncio.run(main())
    assert not result.ok and result.error.startswith("404 ") and "does not exist" in result.error
    row = serve.summarize([result], 1.0, [0.01], slo_ttft=5.0, slo_tpot=1.0)
    assert row["completed"] == 0 and row["failed"] == 1
    assert math.isnan(row["TTFT p99 ms"]) and math.isnan(row["E2E p99 s"])


def test_a_refused_warm_up_stops_the_sweep_with_the_servers_answer(monkeypatch):
    async def refused(*args) -> tuple[list[serve.RequestResult], float, list[float]]:
        return [serve.RequestResult(ok=False, error="404 no such model")], 1.0, []

    monkeypatch.setattr(serve, "run_load", refused)
    args = build_parser().parse_args(["bench", "serve", "--url", "http://server",
                                      "--vocab-size", "100"])
    with pytest.raises(ValueError, match="refused a warm-up request .*: 404 no such model"):
        serve.sweep("http://server", args, "server")


def test_a_length_range_must_not_be_empty():
    args = build_parser().parse_args(["bench", "serve", "--url", "http://server",
                                      "--prompt-max", "64"])
    with pytest.raises(ValueError, match=r"--prompt-min \(128\) must be <= --prompt-max \(64\)"):
        serve.run(args)
