"""`kvserve serve --data-parallel-size 2`: two engine replicas as Ray actors behind one
OpenAI server. Their greedy outputs match one engine's, /metrics reports each replica and the
total, a request migrated back and forth while it streams ends as it would have unmoved,
prefill and decode disaggregated over two replicas answer alike, and a replica whose process
is killed costs only its own requests."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.openai.launch import server_process
from kvserve.tools.make_lora import make_lora
from tests.conftest import wait_for
from tests.processes import alive, spawned_children

pytest.importorskip("ray")

MAX_TOKENS = 12
LONG = 400  # tokens of the requests a kill interrupts
# Tokens of the request migrated back and forth: enough that three migrations land while it
# decodes (the tiny model decodes 400 in well under a second on the CPU's decode stack).
MIGRATED = 1000


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[str]:
    flags = ["--data-parallel-size", "2", "--router", "round-robin",
             "--kv-cache-memory", "0.02"]
    with server_process(str(llama_dir), flags, timeout=300) as url:
        yield url


def complete(server: str, prompt: str, **extra: object) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def metric(server: str, name: str, replica: str) -> float:
    text = httpx.get(f"{server}/metrics").text
    match = re.search(rf'^{name}{{[^}}]*replica="{replica}"[^}}]*}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name} for replica {replica} missing from /metrics"
    return float(match.group(1))


def metric_total(server: str, name: str) -> float:
    """A front-end metric (no replica label), summed over its labels."""
    text = httpx.get(f"{server}/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text,
                                            re.MULTILINE))


def replicas(server: str) -> list[dict]:
    return httpx.get(f"{server}/replicas").json()


def test_replicas_answer_as_one_engine(server: str, llama_dir: Path) -> None:
    prompts = [f"def function_{i}(x):" for i in range(6)]
    served = [complete(server, p)["choices"][0]["text"] for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = LLM(str(llama_dir)).generate(prompts, greedy)
    assert served == [out.outputs[0].text for out in expected]
    assert [r["healthy"] for r in replicas(server)] == [True, True]
    for replica in ("0", "1"):
        assert metric(server, "kvserve_cluster_routed_requests_total", replica) >= 3
        assert metric(server, "kvserve_generation_tokens_total", replica) >= 3 * MAX_TOKENS
    assert (metric(server, "kvserve_generation_tokens_total", "all")
            == metric(server, "kvserve_generation_tokens_total", "0")
            + metric(server, "kvserve_generation_tokens_total", "1"))


def test_a_stream_closed_early_frees_its_blocks(server: str) -> None:
    body = {"prompt": "def g(x):", "max_tokens": LONG, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then the client leaves
    wait_for(lambda: metric(server, "kvserve_num_requests_running", "all") == 0,
             "the abort")
    assert metric(server, "kvserve_kv_blocks_used", "all") == 0


def test_a_request_migrated_mid_stream_streams_on_unbroken(server: str, llama_dir: Path
                                                           ) -> None:
    body = {"prompt": "def moving(x):", "max_tokens": MIGRATED, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, moves = "", []
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            text += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
            if len(moves) < 3:  # back and forth while it decodes
                source = next(r["replica"] for r in replicas(server) if r["num_requests"])
                moves += httpx.post(f"{server}/replicas/migrate", json={
                    "source": source, "destination": 1 - source}).json()
    assert [m["migrated"] for m in moves] == [True, True, True]
    greedy = SamplingParams(temperature=0, max_tokens=MIGRATED, ignore_eos=True)
    assert text == LLM(str(llama_dir)).generate(["def moving(x):"], greedy)[0].outputs[0].text
    assert metric_total(server, "kvserve_cluster_migrations_total") == 3
    assert metric_total(server, "kvserve_cluster_migration_downtime_seconds_count") == 3
    wait_for(lambda: metric(server, "kvserve_num_requests_running", "all") == 0, "the end")
    assert metric(server, "kvserve_kv_blocks_used", "all") == 0
    assert metric(server, "kvserve_kv_host_blocks_used", "all") == 0


def test_a_request_of_two_completions_migrates_with_both(server: str, llama_dir: Path) -> None:
    body = {"prompt": "def twice(x):", "max_tokens": MIGRATED, "temperature": 0.8, "seed": 5,
            "n": 2, "stream": True, "ignore_eos": True}
    done_before = metric_total(server, "kvserve_cluster_migrations_total")
    texts, moves = ["", ""], []
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                texts[choice["index"]] += choice["text"]
            if not moves:
                source = next(r["replica"] for r in replicas(server) if r["num_requests"])
                moves = httpx.post(f"{server}/replicas/migrate", json={
                    "source": source, "destination": 1 - source}).json()
    assert [m["migrated"] for m in moves] == [True]
    params = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=MIGRATED, ignore_eos=True)
    unmoved = LLM(str(llama_dir)).generate(["def twice(x):"], params)[0].outputs
    assert texts == [o.text for o in unmoved] and texts[0] != texts[1]
    assert metric_total(server, "kvserve_cluster_migrations_total") == done_before + 1
    wait_for(lambda: metric(server, "kvserve_num_requests_running", "all") == 0, "the end")
    assert metric(server, "kvserve_kv_blocks_used", "all") == 0
    assert metric(server, "kvserve_kv_host_blocks_used", "all") == 0


def test_disaggregated_prefill_and_decode_answer_as_one_engine(llama_dir: Path) -> None:
    flags = ["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-cache-memory", "0.02"]
    prompts = [f"def split_{i}(x):" for i in range(4)]
    with server_process(str(llama_dir), flags, timeout=300) as url:
        assert [r["role"] for r in replicas(url)] == ["prefill", "decode"]
        served = [complete(url, p)["choices"][0]["text"] for p in prompts]
        # Every request moved once, after its first token; the prefill replica decoded none.
        assert metric_total(url, "kvserve_cluster_migrations_total") == len(prompts)
        assert metric(url, "kvserve_cluster_routed_requests_total", "0") == len(prompts)
        assert metric(url, "kvserve_generation_tokens_total", "0") == len(prompts)
        wait_for(lambda: metric(url, "kvserve_num_requests_running", "all") == 0, "the end")
        assert metric(url, "kvserve_kv_blocks_used", "all") == 0
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    assert served == [o.outputs[0].text for o in LLM(str(llama_dir)).generate(prompts, greedy)]


@dataclass
class StreamRecord:
    started: threading.Event = field(default_factory=threading.Event)
    tokens: int = 0
    finish_reason: str | None = None
    error: dict | None = None


def read_stream(server: str, prompt: str, record: StreamRecord, max_tokens: int = LONG
                ) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "logprobs": 0}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                record.error = event["error"]
                continue
            choice = event["choices"][0]
            record.tokens += len(choice["logprobs"]["tokens"])
            record.finish_reason = choice["finish_reason"] or record.finish_reason
            record.started.set()


def test_a_killed_replica_costs_only_its_own_requests(server: str) -> None:
    records = [StreamRecord() for _ in range(4)]
    threads = [threading.Thread(target=read_stream, args=(server, f"def h{i}(x):", r))
               for i, r in enumerate(records)]
    for thread in threads:
        thread.start()
    for record in records:
        assert record.started.wait(120), "a stream never started"
    victim = replicas(server)[0]
    assert victim["num_requests"] == 2  # round-robin: two streams on each replica
    os.kill(victim["pid"], signal.SIGKILL)
    for thread in threads:
        thread.join(300)
    failed = [r for r in records if r.error is not None]
    assert len(failed) == 2
    assert all(r.error["code"] == "request_failed" and r.tokens < LONG for r in failed)
    assert all(r.finish_reason == "length" and r.tokens == LONG
               for r in records if r.error is None)
    # The survivor keeps serving at once; the dead one comes back as a new process.
    assert complete(server, "def after(x):")["choices"][0]["finish_reason"] == "length"
    wait_for(lambda: all(r["healthy"] for r in replicas(server)), "the restart", 240)
    assert replicas(server)[0]["pid"] != victim["pid"]
    assert metric(server, "kvserve_kv_blocks_used", "1") == 0
    assert metric(server, "kvserve_kv_blocks_used", "all") == 0


def test_sigterm_ends_the_streams_on_the_replicas_then_the_server(llama_dir: Path) -> None:
    """A stop ends a stream still running on a replica with the shutdown error and [DONE]
    (the front end fails its streams the way one engine does); the server then stops."""
    flags = ["--data-parallel-size", "2", "--kv-cache-memory", "0.02", "--streaming-window",
             "4", "--no-enable-prefix-caching"]  # a stream with no end of its own
    record = StreamRecord()
    with server_process(str(llama_dir), flags, timeout=300) as url:
        thread = threading.Thread(target=read_stream, args=(url, "def f(x):", record),
                                  kwargs={"max_tokens": 1_000_000})
        thread.start()
        assert record.started.wait(120), "the stream never started"
    thread.join(120)
    assert record.error is not None and record.error["code"] == "server_shutting_down"


def test_a_replica_whose_engine_died_is_restarted(llama_dir: Path) -> None:
    """A tensor-parallel rank killed inside a replica kills its engine: the replica's process
    ends, Ray starts it again, and requests sent meanwhile are served by the other replica,
    where before the replica stayed up and failed every request routed to it."""
    flags = ["--data-parallel-size", "2", "--router", "round-robin", "--tensor-parallel-size",
             "2", "--kv-cache-memory", "0.02"]
    with server_process(str(llama_dir), flags, timeout=300) as url:
        victim = replicas(url)[0]
        rank = max(spawned_children(victim["pid"]))
        os.kill(rank, signal.SIGKILL)
        wait_for(lambda: not alive(rank), "the rank's end")
        for i in range(4):  # round-robin: two of them to the dead replica
            assert complete(url, f"def f{i}(x):")["choices"][0]["finish_reason"] == "length"
        wait_for(lambda: all(r["healthy"] for r in replicas(url))
                 and replicas(url)[0]["pid"] != victim["pid"], "the restart", 240)
        assert complete(url, "def after(x):")["choices"][0]["finish_reason"] == "length"


def test_replicas_serve_lora_adapters_loaded_at_start_and_at_run_time(llama_dir: Path,
                                                                      tmp_path: Path) -> None:
    """Every replica serves the adapters; a replica restarted after a kill serves those
    loaded at run time too, and not those unloaded."""
    for seed, name in enumerate(("a", "b")):
        make_lora(llama_dir, tmp_path / name, rank=4, alpha=8.0, seed=seed, std=0.2)
    flags = ["--data-parallel-size", "2", "--router", "round-robin", "--kv-cache-memory",
             "0.02", "--served-model-name", "base", "--lora-modules", f"a={tmp_path / 'a'}"]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    offline = LLM(str(llama_dir), lora_modules={n: str(tmp_path / n) for n in ("a", "b")})
    expected = {n: offline.generate({"prompt": "def f(x):", "lora_name": n}, greedy,
                                    use_tqdm=False)[0].outputs[0].text for n in ("a", "b")}
    with server_process(str(llama_dir), flags, timeout=300) as url:
        def texts(model: str) -> list[str]:  # round-robin: one request on each replica
            return [complete(url, "def f(x):", model=model)["choices"][0]["text"]
                    for _ in range(2)]

        loaded = httpx.post(f"{url}/v1/load_lora_adapter",
                            json={"lora_name": "b", "lora_path": str(tmp_path / "b")})
        assert loaded.status_code == 200, loaded.text
        assert texts("a") == [expected["a"]] * 2 and texts("b") == [expected["b"]] * 2
        assert httpx.post(f"{url}/v1/unload_lora_adapter",
                          json={"lora_name": "a"}).status_code == 200
        victim = replicas(url)[1]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: replicas(url)[1]["pid"] != victim["pid"]
                 and all(r["healthy"] for r in replicas(url)), "the restart", 240)
        assert texts("b") == [expected["b"]] * 2
        assert httpx.post(f"{url}/v1/completions", json={
            "model": "a", "prompt": "x", "max_tokens": 2}).status_code == 404
        assert sorted(m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]) == [
            "b", "base"]
