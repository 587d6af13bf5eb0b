"""The OpenAI-compatible server, run as a real subprocess and driven by the `openai` package
(sync and async, streaming and not) and by raw HTTP for the error cases."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trustme
import uvicorn

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.async_llm import AsyncLLM
from kvserve.entrypoints.openai.launch import server_process
from kvserve.entrypoints.openai.server import ServerConfig, build_app
from kvserve.errors import EngineDeadError, RequestFailedError
from kvserve.worker.tensor_parallel import free_port
from tests.conftest import wait_for
from tests.processes import alive, spawned_children

API_KEY = "test-key"
MODEL = "tiny"
MAX_WAITING = 80
MAX_BODY = 200_000
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[str]:
    flags = ["--served-model-name", MODEL, "--max-waiting-requests", str(MAX_WAITING),
             "--max-request-bytes", str(MAX_BODY)]
    with server_process(str(llama_dir), flags, {**os.environ, "KVSERVE_API_KEY": API_KEY},
                        timeout=300) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir))


def metric(server: str, name: str, label: str = "") -> float:
    """The sum of `name`'s series whose labels hold `label` (e.g. 'finish_reason="length"'):
    which series comes first depends on what the server served before."""
    text = httpx.get(f"{server}/metrics").text
    values = [float(value) for labels, value
              in re.findall(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.MULTILINE)
              if label in labels]
    assert values, f"{name}{{{label}}} missing from /metrics"
    return sum(values)


def wait_idle(server: str) -> None:
    """Polls /metrics until the engine has no running or waiting sequence (aborts are applied
    by the engine thread, after the HTTP response has ended)."""
    deadline = time.monotonic() + 60
    while (metric(server, "kvserve_num_requests_running")
           or metric(server, "kvserve_num_requests_waiting")):
        assert time.monotonic() < deadline, "engine never went idle"
        time.sleep(0.05)


def test_models_health_version(server: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' does not exist"):
        client.models.retrieve("gpt-4o")
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/ping").status_code == 200
    given = httpx.get(f"{server}/v1/models", headers={**AUTH, "X-Request-Id": "trace-7"})
    assert given.headers["x-request-id"] == "trace-7"
    fresh = {httpx.get(f"{server}/v1/models").headers["x-request-id"] for _ in range(2)}
    assert len(fresh) == 2 and all(r.startswith("req-") for r in fresh)  # 401s too
    assert httpx.post(f"{server}/ping").status_code == 200
    assert httpx.get(f"{server}/version").json()["version"]


def test_a_wrong_route_or_method_says_what_the_server_has(server: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    _check_error(httpx.post(f"{server}/v1/embeddings", json={}, headers=headers), 404, None,
                 "POST /v1/embeddings: no such route; this server has GET /health, ")
    wrong_method = httpx.get(f"{server}/v1/completions", headers=headers)
    _check_error(wrong_method, 405, None, "GET /v1/completions: use POST")
    assert wrong_method.headers["allow"] == "POST"


def test_greedy_completion_equals_offline(client: openai.OpenAI, llm: LLM) -> None:
    prompt = "def fibonacci(n):"
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                   ignore_eos=True), use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected.outputs[0].text
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == 12
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                         temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == expected.outputs[0].text


def test_a_null_field_is_one_left_out(server: str, llm: LLM) -> None:
    """OpenAI's API takes null for a field as its default, and clients send it so."""
    expected = llm.generate("hi", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    nulls = dict.fromkeys(["n", "top_p", "stop", "seed", "presence_penalty", "stream",
                           "stream_options", "logit_bias", "user", "logprobs", "echo",
                           "max_tokens", "suffix", "best_of"])
    got = _post(server, COMPLETIONS, {"prompt": "hi", "temperature": 0, "ignore_eos": True,
                                      **nulls})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == expected  # max_tokens: OpenAI's default, 16


def test_truncate_prompt_tokens_echoes_the_tail_it_kept(client: openai.OpenAI,
                                                         llm: LLM) -> None:
    prompt = "def fibonacci(n): return n if n < 2 else fibonacci(n - 1)"
    tail = llm.get_tokenizer().encode(prompt)[-5:]
    expected = llm.generate({"prompt_token_ids": tail}, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                    echo=True, extra_body={"ignore_eos": True,
                                                           "truncate_prompt_tokens": 5})
    assert got.usage.prompt_tokens == 5
    assert got.choices[0].text == llm.get_tokenizer().decode(tail) + expected.outputs[0].text


def test_bad_words_ban_as_offline(client: openai.OpenAI, llm: LLM) -> None:
    prompt, words = "def fibonacci(n):", ["return", "fib"]
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   bad_words=words), use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "bad_words": words})
    assert got.choices[0].text == expected.outputs[0].text


def test_token_prompts_echo_and_logprobs(client: openai.OpenAI, llm: LLM) -> None:
    ids = [[5, 6, 7, 8], [9, 10]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    assert [c.text for c in got.choices] == [e.outputs[0].text for e in expected]
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) >= 3 for top in lp.top_logprobs)
    echoed = client.completions.create(model=MODEL, prompt="import os", max_tokens=3,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("import os")


def test_segments_blend_like_the_offline_api(server: str, client: openai.OpenAI,
                                             llm: LLM) -> None:
    segments = ["The tower was built in 1889. ", "It is 330 metres tall. ", "How tall is it?"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate({"segments": segments}, params, use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=None, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True, "segments": segments})
    assert got.choices[0].text == expected.outputs[0].text
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert metric(server, "kvserve_blend_prompts_total") >= 1
    assert metric(server, "kvserve_blend_chunk_fill_tokens_total") > 0
    for body, message in (({"segments": ["only one"]}, "at least 2 segments"),
                          ({"segments": segments, "prompt": "x"}, "not both")):
        response = httpx.post(f"{server}/v1/completions", headers=AUTH,
                              json={"model": MODEL, "max_tokens": 2, **body})
        assert response.status_code == 400 and message in response.text


def test_prompt_logprobs_as_vllm_returns_them(client: openai.OpenAI, llm: LLM) -> None:
    ids = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    expected = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    for stream in (False, True):
        got = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                        stream=stream, extra_body={"prompt_logprobs": 1})
        first = next(iter(got)) if stream else got
        scored = first.choices[0].prompt_logprobs
        assert len(scored) == len(ids) and scored[0] is None
        for position in range(1, len(ids)):
            entry = scored[position][str(ids[position])]
            want = expected.prompt_logprobs[position][ids[position]]
            assert abs(entry["logprob"] - want.logprob) < 1e-5 and entry["rank"] == want.rank


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, llm: LLM) -> None:
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, one token (or none)."""
    ids = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1)
    expected = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    want = [None] + [expected.prompt_logprobs[k][ids[k]].logprob for k in range(1, len(ids))]
    sampled = expected.outputs[0].token_ids[0]
    want_sampled = expected.outputs[0].logprobs[0][sampled].logprob
    for max_tokens, stream in ((1, False), (1, True), (0, False), (0, True)):
        got = client.completions.create(model=MODEL, prompt=[ids], max_tokens=max_tokens,
                                        temperature=0, logprobs=1, echo=True, stream=stream)
        choice = next(iter(got)).choices[0] if stream else got.choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) \
            == len(lp.text_offset) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for k in range(1, len(ids)):
            assert abs(lp.token_logprobs[k] - want[k]) < 1e-5
            assert max(lp.top_logprobs[k].values()) >= lp.token_logprobs[k]
        if max_tokens:
            assert abs(lp.token_logprobs[-1] - want_sampled) < 1e-5
        else:
            assert choice.text == llm.get_tokenizer().decode(ids)
            assert choice.finish_reason == "length"
            assert stream or got.usage.completion_tokens == 0
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    unscored = client.completions.create(model=MODEL, prompt="import os", max_tokens=0,
                                         echo=True)
    assert unscored.choices[0].text == "import os" and unscored.choices[0].logprobs is None


def test_tokenize_detokenize_tokenizer_info(server: str, client: openai.OpenAI,
                                            llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    text = "def fibonacci(n):"
    got = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": text,
                                                  "return_token_strs": True}).json()
    assert got["tokens"] == tokenizer.encode(text) and got["count"] == len(got["tokens"])
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
    assert got["max_model_len"] == llm.engine.inputs.max_model_len
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    counted = httpx.post(f"{server}/tokenize", json={"messages": messages}).json()
    assert counted["count"] == chat.usage.prompt_tokens
    back = httpx.post(f"{server}/detokenize", json={"tokens": got["tokens"]}).json()
    assert back["prompt"] == tokenizer.decode(got["tokens"])
    info = httpx.get(f"{server}/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token
    assert info["chat_template"] == tokenizer.chat_template
    for path, body, param, words in (
            ("/detokenize", {"tokens": [1, 10**7]}, "tokens", "vocabulary"),
            ("/tokenize", {"prompt": "x", "messages": messages}, "prompt", "exactly one"),
            ("/tokenize", {"prompt": "x", "model": "gpt-5"}, "model", "does not exist")):
        response = httpx.post(f"{server}{path}", json=body)
        error = response.json()["error"]
        assert response.status_code in (400, 404) and error["param"] == param
        assert words in error["message"]


def test_logit_bias_and_allowed_token_ids(client: openai.OpenAI, llm: LLM) -> None:
    ids = [5, 6, 7]
    top = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1),
                       use_tqdm=False)[0].outputs[0].token_ids[0]
    for bias, allowed, check in (({42: 100}, None, lambda out: out == [42] * 4),
                                 ({top: -100}, None, lambda out: out[0] != top),
                                 ({}, [42, 43], lambda out: set(out) <= {42, 43})):
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias=bias,
                                allowed_token_ids=allowed)
        expected = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
        assert check(expected.token_ids)
        got = client.completions.create(model=MODEL, prompt=[ids], max_tokens=4, temperature=0,
                                        logit_bias={str(t): b for t, b in bias.items()},
                                        extra_body={"ignore_eos": True,
                                                    "allowed_token_ids": allowed})
        assert got.choices[0].text == expected.text


def test_chat_sync_and_stream(client: openai.OpenAI, llm: LLM) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10,
                                                 ignore_eos=True), use_tqdm=False)[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                         max_completion_tokens=10, logprobs=True,
                                         top_logprobs=2, extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == expected.outputs[0].text
    assert got.choices[0].message.role == "assistant"
    assert all(len(t.top_logprobs) == 2 for t in got.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=10, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    continuous = [c for c in client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=10, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].delta.role is None]
    counts = [c.usage.completion_tokens for c in continuous]
    assert counts == sorted(counts) and counts[0] > 0 and counts[-1] == 10
    assert all(c.usage.prompt_tokens == len(expected.prompt_token_ids) for c in continuous)


def test_continue_final_message_goes_on_with_the_assistants_text(
        server: str, client: openai.OpenAI, llm: LLM) -> None:
    """vLLM's continue_final_message: the last assistant message is left open, so the model
    writes its next words rather than a new turn."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "def fibonacci(n):"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False, add_generation_prompt=False,
                        continue_final_message=True)[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                         max_tokens=6, extra_body={"ignore_eos": True, **flags})
    assert got.choices[0].message.content == expected.outputs[0].text
    tokenized = httpx.post(f"{server}/tokenize", json={"messages": messages, **flags}).json()
    assert tokenized["tokens"] == expected.prompt_token_ids
    assert llm.get_tokenizer().decode(tokenized["tokens"]).endswith(
        "<|im_start|>assistant\ndef fibonacci(n):")


def test_stop_strings_and_n_stream_like_full(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, prompt="class Request:", max_tokens=24, temperature=0.8,
                seed=3, n=2, stop=["e", "ar"])
    full = client.completions.create(**args)
    streamed = ["", ""]
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in sorted(full.choices, key=lambda c: c.index)]
    assert all("e" not in text and "ar" not in text for text in streamed)
    usages = [chunk.usage for chunk in client.completions.create(
        **args, stream=True, stream_options={"include_usage": True,
                                             "continuous_usage_stats": True})]
    assert all(u is not None for u in usages)
    assert usages[-1].completion_tokens == full.usage.completion_tokens


def test_concurrent_streams_and_disconnects_free_all_blocks(server: str) -> None:
    async def one(i: int, client: openai.AsyncOpenAI) -> int | None:
        stream = await client.completions.create(
            model=MODEL, prompt=f"def f{i}(x):", max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage, received = None, 0
        async for chunk in stream:
            received += 1
            if i % 2 and received == 2:
                await stream.close()  # disconnect mid-stream
                return None
            usage = chunk.usage or usage
        assert usage is not None
        return usage.completion_tokens

    async def run() -> list[int | None]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY,
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(i, client) for i in range(64)))

    results = asyncio.run(run())
    assert results[0::2] == [16] * 32
    wait_idle(server)
    assert metric(server, "kvserve_kv_blocks_used") == 0
    assert metric(server, "kvserve_kv_blocks_total") > 0
    assert metric(server, "kvserve_requests_finished_total", 'finish_reason="length"') >= 32


def test_metrics_exposition(server: str, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    text = httpx.get(f"{server}/metrics").text
    for name in ["kvserve_time_to_first_token_seconds_bucket",
                 "kvserve_time_per_output_token_seconds_bucket",
                 "kvserve_e2e_request_latency_seconds_bucket",
                 "kvserve_request_queue_time_seconds_bucket", "kvserve_prompt_tokens_total",
                 "kvserve_generation_tokens_total", "kvserve_preemptions_total",
                 'finish_reason="length"']:
        assert name in text


def test_priority_and_user_reach_the_per_class_metrics(server: str,
                                                       client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="x", max_tokens=2, user="team-a",
                              extra_body={"priority": -3})
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                   max_tokens=2, user="team-b")
    text = httpx.get(f"{server}/metrics").text
    for labels in ('priority="-3",tenant="team-a"', 'priority="0",tenant="team-b"'):
        assert re.search(rf"^kvserve_class_time_to_first_token_seconds_count{{"
                         rf"model_name=\"{MODEL}\",{labels}}} 1\.0$", text, re.MULTILINE)
        assert (f'kvserve_class_request_queue_time_seconds_count{{model_name="{MODEL}",'
                f"{labels}}}") in text


def test_prefix_cache_hits_reach_metrics_and_cache_salts_isolate(
        server: str, client: openai.OpenAI) -> None:
    prompt = "the same long system prompt, " * 12

    def complete(salt: str) -> None:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  extra_body={"cache_salt": salt})

    complete("tenant-a")
    hits = metric(server, "kvserve_prefix_cache_hits_total")
    complete("tenant-b")
    assert metric(server, "kvserve_prefix_cache_hits_total") == hits
    complete("tenant-a")
    assert metric(server, "kvserve_prefix_cache_hits_total") > hits
    assert metric(server, "kvserve_prefix_cache_queries_total") > 0


def _post(server: str, path: str, body: bytes | dict, headers: dict | None = None
          ) -> httpx.Response:
    headers = {**AUTH, **(headers or {})}
    if isinstance(body, dict):
        return httpx.post(f"{server}{path}", json=body, headers=headers, timeout=30)
    return httpx.post(f"{server}{path}", content=body, timeout=30,
                      headers={"Content-Type": "application/json", **headers})


def _check_error(response: httpx.Response, status: int, param: str | None = None,
                 words: str = "") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    assert words in error["message"]


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), [
    (COMPLETIONS, b'{"prompt": "x", ', 400, None, "not valid JSON"),
    (COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None, "not valid JSON"),
    (COMPLETIONS, b'{"prompt": "a\\ud800b"}', 400, "prompt",  # JSON's escape, unpaired
     "not valid Unicode: it holds a lone surrogate (U+D800)"),
    ("/tokenize", b'{"prompt": "\\udc00"}', 400, "prompt", "lone surrogate (U+DC00)"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udbff"}]}', 400, "messages",
     "lone surrogate (U+DBFF)"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt", "a list of token-id lists, got 5"),
    (COMPLETIONS, {"prompt": [1.5]}, 400, "prompt", "a list of token ids or a list of"),
    (COMPLETIONS, {"prompt": "x", "stop": [1]}, 400, "stop",
     "must be a string or a list of strings, got [1]"),
    (COMPLETIONS, {"segments": ["x", {"text": "y"}]}, 400, "segments.1",
     "must be a string or a list of token ids"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content",
     "must be a string or a list of text parts"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "any"}, 400,
     "tool_choice", '"required" or {"type": "function"'),
    (COMPLETIONS, {"prompt": "x", "n": 100000}, 400, "n", "[1, 128]"),
    (COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "temperature", "in [0, 1e+06]"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 1e-300}, 400, "repetition_penalty",
     "[1e-06, 1e+06]"),
    (COMPLETIONS, {"prompt": "x", "seed": 2**64}, 400, "seed", "64-bit"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [10**7]}, 400, "stop_token_ids",
     "vocabulary"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens", "max_model_len"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "only with echo"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias", "token ids"),
    (COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
    (COMPLETIONS, {"prompt": "x", "best_of": 3}, 400, "best_of", "use n"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     "--enable-auto-tool-choice"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"7": 101}}, 400, "logit_bias", "[-100, 100]"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", "empty"),
    (COMPLETIONS, {"prompt": None}, 400, "prompt", "prompt is required (or kvserve's segments)"),
    (COMPLETIONS, {"prompt": [[1, 2], [10**7]]}, 400, None, "vocabulary"),
    (COMPLETIONS, {"prompt": "x", "model": "gpt-5"}, 404, "model", "does not exist"),
    (COMPLETIONS, {"prompt": "x", "cache_salt": ""}, 400, "cache_salt", "at least 1"),
    (COMPLETIONS, {"prompt": "x", "priority": "urgent"}, 400, "priority", "integer"),
    (COMPLETIONS, {"prompt": "x", "user": ""}, 400, "user", "at least 1"),
    (CHAT, {"messages": []}, 400, "messages", "at least 1"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", ""),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content", "'image_url' are not supported"),
    (CHAT, {"messages": [{"role": "user", "content": ["x"]}]}, 400, "messages.0.content",
     "content parts are objects"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", "logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
            "top_logprobs": 50}, 400, "logprobs", "[0, 20]"),
    (COMPLETIONS, {"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objekt"}}}},
     400, "response_format.json_schema.schema", "objekt"),
    (COMPLETIONS, {"prompt": "x", "response_format": {"type": "json_schema"}}, 400,
     "response_format", "json_schema is required"),
    (COMPLETIONS, {"prompt": "x", "guided_regex": "[a-"}, 400, "guided_regex", "regex"),
    (COMPLETIONS, {"prompt": "x", "guided_choice": []}, 400, "guided_choice", "non-empty"),
    (COMPLETIONS, {"prompt": "x", "guided_grammar": "start: ("}, 400, "guided_grammar",
     "grammar"),
    (COMPLETIONS, {"prompt": "x", "bad_words": [" "]}, 400, "bad_words",
     "bad_words must be a list of non-empty strings"),
    (COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens",
     "must be -1 (the context's room) or >= 1, got 0"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True}, 400,
     "use_beam_search", "not supported"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     400, "continue_final_message", "add_generation_prompt false"),
    (COMPLETIONS, {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, 400, None,
     "at most one"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}],
            "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream_options: only allowed when stream is true"),
])
def test_bad_requests(server: str, path: str, body: bytes | dict, status: int,
                      param: str | None, words: str) -> None:
    _check_error(_post(server, path, body), status, param, words)


@pytest.mark.parametrize(("body", "content_type", "words"), [
    (b'{"prompt": "x"}', "application/x-www-form-urlencoded",
     "must be a JSON object sent as application/json, and it came as "
     "application/x-www-form-urlencoded (curl -d sends a form"),
    (b'{"prompt": "x"}', "text/plain; charset=utf-8", "and it came as text/plain (curl"),
    (b"", "application/json", "the body is empty"),
    (b"[1]", "application/json", "the body must be a JSON object, got an array"),
    (b"null", "application/json", "the body must be a JSON object, got null"),
])
def test_a_body_that_is_no_json_object(server: str, body: bytes, content_type: str,
                                       words: str) -> None:
    _check_error(_post(server, COMPLETIONS, body, {"Content-Type": content_type}), 400, None,
                 words)


def test_structured_outputs_parse(client: openai.OpenAI) -> None:
    """A random model's sampled outputs, held to a schema (OpenAI's response_format), a
    regex and a choice (vLLM's extras)."""
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"enum": ["S", "M", "L"]}}, "required": ["name", "size"],
        "additionalProperties": False}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a shirt"}], n=4, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        value = json.loads(choice.message.content)
        assert set(value) == {"name", "size"} and value["size"] in "SML"
    regex = client.completions.create(model=MODEL, prompt="x", n=4, max_tokens=30,
                                      extra_body={"guided_regex": "[0-9]{2}-[a-z]{2,4}"})
    assert all(re.fullmatch("[0-9]{2}-[a-z]{2,4}", c.text) for c in regex.choices)
    picked = client.completions.create(model=MODEL, prompt="x", max_tokens=10,
                                       extra_body={"guided_choice": ["up", "down"]})
    assert picked.choices[0].text in ("up", "down")
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    grammar = client.completions.create(model=MODEL, prompt="x", n=4, max_tokens=40,
                                        extra_body={"guided_grammar": lark})
    assert all(re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", c.text) for c in grammar.choices)


def test_a_stop_string_can_stay_in_the_text(client: openai.OpenAI, llm: LLM) -> None:
    ids = [5, 6, 7]
    text = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    stop = text[4:6]
    for stream in (False, True):
        got = client.completions.create(model=MODEL, prompt=[ids], max_tokens=12,
                                        temperature=0, stop=stop, stream=stream,
                                        extra_body={"ignore_eos": True,
                                                    "include_stop_str_in_output": True})
        out = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
        assert out == text[:text.index(stop) + len(stop)]


def test_a_grammar_past_the_parsers_limits_is_a_request_error(server: str) -> None:
    """Its output would end short of the grammar: a 500 naming the parser's error, as a body
    or as the stream's last event."""
    body = {"prompt": "x", "max_tokens": 10, "temperature": 0,
            "guided_choice": [f"option {i}" for i in range(2001)]}
    _check_error(_post(server, COMPLETIONS, body), 500, None,
                 "structured_output: the grammar's parser stopped: Parser Error: Current row")
    events = _post(server, COMPLETIONS, {**body, "stream": True}).text
    assert "the grammar's parser stopped" in events and events.endswith("data: [DONE]\n\n")


def test_auth_size_and_overload(server: str) -> None:
    body = {"prompt": "x", "max_tokens": 2}
    _check_error(httpx.post(f"{server}{COMPLETIONS}", json=body), 401)
    _check_error(_post(server, COMPLETIONS, body, {"Authorization": "Bearer wrong"}), 401)
    _check_error(_post(server, COMPLETIONS, {"prompt": "x" * MAX_BODY}), 413)
    # More than the queue could ever hold: no retry would help.
    _check_error(_post(server, COMPLETIONS, {"prompt": ["x"] * (MAX_WAITING + 1)}), 400,
                 "prompt", f"{MAX_WAITING + 1} prompts of n=1 make {MAX_WAITING + 1} "
                 f"sequences, more than the server queues at once (max_waiting_requests="
                 f"{MAX_WAITING})")
    _check_error(_post(server, COMPLETIONS, {"prompt": "x", "n": MAX_WAITING + 1}), 400, "n")
    assert _post(server, COMPLETIONS, body).status_code == 200


def test_a_server_answers_to_each_of_its_names(llama_dir: Path) -> None:
    """vLLM's `--served-model-name a b`: requests may use any name; responses carry the
    first."""

    async def run() -> None:
        llm = AsyncLLM(str(llama_dir))
        app = build_app(llm, ServerConfig(model_name=MODEL, aliases=("gpt-4o",)))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as client:
                listed = (await client.get("/v1/models")).json()["data"]
                assert [m["id"] for m in listed] == [MODEL, "gpt-4o"]
                one = (await client.get("/v1/models/org/gpt-4o")).json()["error"]["message"]
                assert "model 'org/gpt-4o' does not exist" in one
                assert (await client.get("/v1/models/gpt-4o")).json()["id"] == "gpt-4o"
                done = await client.post(COMPLETIONS, json={"model": "gpt-4o", "prompt": "x",
                                                            "max_tokens": 1})
                assert done.status_code == 200 and done.json()["model"] == MODEL
                other = await client.post(COMPLETIONS, json={"model": "x", "prompt": "x"})
                _check_error(other, 404, "model", f"this server serves ['gpt-4o', '{MODEL}']")
        finally:
            llm.shutdown()

    asyncio.run(run())


def test_the_queue_counts_sequences_and_a_full_one_answers_503(llama_dir: Path) -> None:
    """Each of a request's n sequences takes a place in the waiting queue. The engine thread
    is held on a command here, so that what is queued stays queued."""

    async def run() -> None:
        llm = AsyncLLM(str(llama_dir), max_waiting_requests=8)
        app = build_app(llm, ServerConfig(model_name=MODEL))
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            held.set()
            release.wait()

        holding = asyncio.create_task(llm.call_on_engine(hold))
        try:
            await asyncio.to_thread(held.wait)
            queued = llm.add_requests(["x", "y", "z"], SamplingParams(n=2, max_tokens=2))
            assert llm.num_waiting == 6
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as client:
                full = await client.post(COMPLETIONS, json={"prompt": "x", "n": 3})
                _check_error(full, 503, None, "the waiting queue is full "
                                              "(max_waiting_requests=8); retry later")
                assert full.headers["Retry-After"] == "1"
            queued += llm.add_requests(["w"], SamplingParams(n=2, max_tokens=2))
            release.set()
            await holding
            for stream in queued:
                outputs = [out async for out in stream]
                assert [len(c.token_ids) for c in outputs[-1].outputs] == [2, 2]
            assert llm.num_waiting == 0
        finally:
            release.set()
            llm.shutdown()
        kv = llm.engine.core.kv_cache
        kv.check_integrity()
        assert kv.num_used_blocks == 0

    asyncio.run(run())


def _read(url: str, body: dict, into: list) -> None:
    """Appends the response's event lines (a stream) or the response itself."""
    with httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=300) as response:
        if not body["stream"]:
            response.read()
            into.append(response)
            return
        into.extend(line for line in response.iter_lines() if line)


ENDLESS = ["--streaming-window", "4", "--no-enable-prefix-caching"]  # max_tokens past the model


@pytest.mark.parametrize(("flags", "stop_signal", "max_tokens", "status", "ending"), [
    ([*ENDLESS, "--disable-uvicorn-access-log"], signal.SIGTERM, 1_000_000, 503,
     "server_shutting_down"),
    (["--shutdown-timeout", "300"], signal.SIGINT, 1000, 200, "length"),
    (["--shutdown-timeout", "300", "--tensor-parallel-size", "2"], signal.SIGTERM, 1000, 200,
     "length"),
], ids=["at-once", "drained-ctrl-c", "tensor-parallel"])
def test_a_stop_ends_the_requests_in_flight_then_the_server(
        llama_dir: Path, tmp_path: Path, flags: list[str], stop_signal: int, max_tokens: int,
        status: int, ending: str) -> None:
    """SIGTERM (docker stop, systemd) or Ctrl+C with a stream and a plain request running:
    by default both end at once with an error (an event before [DONE]; a 503), with
    --shutdown-timeout they run to their end first. The server then stops through the
    engine's shutdown with nothing after it: no tracebacks (from tensor-parallel workers, or
    Ctrl+C's KeyboardInterrupt), and the heap frozen out of the collector at start-up freed
    again (left frozen, Triton's bindings reported some 40 lines of "leaked" objects)."""
    lines: list[str] = []
    plain: list[httpx.Response] = []
    with open(tmp_path / "server.log", "w+") as log:
        with server_process(str(llama_dir), flags, timeout=300, log=log,
                            stop_signal=stop_signal) as url:
            readers = [threading.Thread(target=_read, args=(url, {
                "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream},
                into)) for stream, into in ((True, lines), (False, plain))]
            for reader in readers:
                reader.start()
            wait_for(lambda: metric(url, "kvserve_num_requests_running") >= 2,
                     "both requests' running")
        for reader in readers:
            reader.join()
        log.seek(0)
        output = log.read()
    assert lines[-1] == "data: [DONE]", lines[-2:]
    assert plain[0].status_code == status
    for last in (json.loads(lines[-2].removeprefix("data: ")), plain[0].json()):
        assert (last["error"]["code"] if status != 200
                else last["choices"][0]["finish_reason"]) == ending
    assert "Application shutdown complete" in output
    assert ('"POST /v1/completions HTTP/1.1"' in output) != (
        "--disable-uvicorn-access-log" in flags)  # one line per request, unless disabled
    for noise in ("Traceback", "leaked"):
        assert noise not in output, output[output.index(noise) - 200:]


def test_a_dead_engine_fails_its_requests_then_answers_503_to_new_ones_and_health(
        llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Anything raised outside a step (here, while the engine thread looks for work) ends the
    engine: the request waiting on it fails where it used to wait forever, then new requests
    and /health answer 503, which a supervisor's probe sees."""

    def lost_the_pool() -> bool:
        raise RuntimeError("lost the pool")

    async def run() -> None:
        llm = AsyncLLM(str(llama_dir))
        app = build_app(llm, ServerConfig(model_name=MODEL))
        monkeypatch.setattr(llm.engine, "has_unfinished_requests", lost_the_pool)

        async def consume() -> None:
            async for _ in llm.generate("x", SamplingParams(max_tokens=4)):
                pass

        try:
            with pytest.raises(RequestFailedError, match="the engine stopped: RuntimeError"):
                await asyncio.wait_for(consume(), 120)  # a guard: it waited forever before
            assert isinstance(llm.dead, EngineDeadError)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                for response in (await client.get("/health"),
                                 await client.post(COMPLETIONS, json={"prompt": "x"})):
                    _check_error(response, 503, None, "the engine stopped")
                    assert response.json()["error"]["code"] == "engine_dead"
        finally:
            llm.shutdown()

    asyncio.run(run())


def test_a_killed_tensor_parallel_rank_stops_the_server(llama_dir: Path,
                                                        tmp_path: Path) -> None:
    """A rank killed (by the OOM killer, say) fails the request in flight with its name, then
    the server stops by itself and exits with an error, for its supervisor to restart it;
    before, it answered /health with 200 and failed every request with a broken pipe."""
    with open(tmp_path / "server.log", "w+") as log:
        with server_process(str(llama_dir), ["--tensor-parallel-size", "2"], timeout=300,
                            log=log) as url:
            server_pid = httpx.get(f"{url}/replicas").json()[0]["pid"]
            rank = max(spawned_children(server_pid))
            os.kill(rank, signal.SIGKILL)
            wait_for(lambda: not alive(rank), "the rank's end")
            response = _post(url, COMPLETIONS, {"prompt": "x", "max_tokens": 4})
            _check_error(response, 500)
            assert re.search(r"tensor-parallel rank \d exited", response.text)
            wait_for(lambda: not alive(server_pid), "the server's own stop")
        log.seek(0)
        output = log.read()
    assert re.match(r"kvserve: tensor-parallel rank \d exited", output.splitlines()[-1])



def test_browser_pages_of_allowed_origins_may_call_the_api(llama_dir: Path) -> None:
    """CORS, as vLLM's server answers it: a preflight passes before the key check (a browser
    sends it without the key), and every response, an error too, names the origin allowed;
    a page of another origin is refused."""
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}

    async def run() -> None:
        llm = AsyncLLM(str(llama_dir))
        try:
            for origins, page, allowed in ((("*",), "http://any.example", "*"),
                                           (("http://ui.example",), "http://ui.example",
                                            "http://ui.example")):
                app = build_app(llm, ServerConfig(model_name=MODEL, api_key="k",
                                                  allowed_origins=origins))
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                             headers={"Origin": page}) as client:
                    answer = await client.options(COMPLETIONS, headers=preflight)
                    assert answer.status_code == 200
                    assert answer.headers["access-control-allow-origin"] == allowed
                    assert "authorization" in answer.headers["access-control-allow-headers"]
                    keyless = await client.post(COMPLETIONS, json={"prompt": "x"})
                    assert keyless.status_code == 401
                    assert keyless.headers["access-control-allow-origin"] == allowed
                    done = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2},
                                             headers={"Authorization": "Bearer k"})
                    assert done.status_code == 200
                    assert done.headers["access-control-allow-origin"] == allowed
                    other = await client.options(COMPLETIONS, headers={
                        **preflight, "Origin": "http://elsewhere.example"})
                    assert other.status_code == (200 if allowed == "*" else 400)
            closed = build_app(llm, ServerConfig(model_name=MODEL, allowed_origins=()))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=closed),
                                         base_url="http://t") as client:
                answer = await client.options(COMPLETIONS, headers={
                    **preflight, "Origin": "http://any.example"})
                assert answer.status_code == 405
                assert "access-control-allow-origin" not in answer.headers
        finally:
            llm.shutdown()

    asyncio.run(run())


def test_allowed_origins_take_vllms_json_list_too() -> None:
    from kvserve.entrypoints.cli import _origins

    assert _origins(["*"]) == ("*",)
    assert _origins(["http://a", "http://b"]) == ("http://a", "http://b")
    assert _origins(['["http://a"]']) == ("http://a",) and _origins(["[]"]) == ()
    with pytest.raises(ValueError, match="--allowed-origins: not a JSON list"):
        _origins(["[http://a"])


class _Idle:  # what the routes these tests call (/health) ask of the engine
    dead = None


@contextlib.contextmanager
def _uvicorn_in_thread(config: ServerConfig) -> Iterator[int]:
    """A server as `serve` configures it, on a free port of its own thread, without an
    engine; yields the port."""
    from kvserve.entrypoints.openai.server import uvicorn_config

    port = free_port()
    server = uvicorn.Server(uvicorn_config(build_app(_Idle(), config), config, "127.0.0.1",
                                           port))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        wait_for(lambda: server.started, "the server's start")
        yield port
    finally:
        server.should_exit = True
        thread.join()


def test_an_idle_keep_alive_connection_stays_open_longer_than_clients_keep_theirs() -> None:
    """The server closes an idle connection after --timeout-keep-alive seconds: by default
    longer than clients keep one (httpx 5, aiohttp 15), so that the client closes first. At
    uvicorn's 5, the server closed connections that clients were reusing at that moment (91
    in 3,000 requests, some reset mid-request). Here, with 1 s, the connection serves two
    requests, then the server closes it."""
    from kvserve.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", "m"]).timeout_keep_alive > 15
    config = ServerConfig(model_name=MODEL, timeout_keep_alive=1)
    with (_uvicorn_in_thread(config) as port,
          socket.create_connection(("127.0.0.1", port), timeout=60) as connection):
        for _ in range(2):  # kept alive between requests
            connection.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert connection.recv(4096).startswith(b"HTTP/1.1 200")
        assert connection.recv(1) == b""  # then closed by the server, once idle


def test_https_with_a_key_and_certificate(tmp_path: Path) -> None:
    """--ssl-keyfile and --ssl-certfile serve HTTPS; a key without its certificate, or
    files that do not load, are refused before any model would load."""
    authority = trustme.CA()
    issued = authority.issue_cert("127.0.0.1")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    issued.private_key_pem.write_to_path(str(key))
    issued.cert_chain_pems[0].write_to_path(str(cert))
    config = ServerConfig(model_name=MODEL, ssl_keyfile=str(key), ssl_certfile=str(cert))
    with _uvicorn_in_thread(config) as port:
        trusting = ssl.create_default_context()
        authority.configure_trust(trusting)
        assert httpx.get(f"https://127.0.0.1:{port}/health", verify=trusting).status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health")  # plain HTTP is not served there
    with pytest.raises(ValueError, match="give both"):
        ServerConfig(model_name=MODEL, ssl_keyfile=str(key))
    with pytest.raises(ValueError, match="cannot load them as a certificate and its key"):
        ServerConfig(model_name=MODEL, ssl_keyfile=str(cert), ssl_certfile=str(cert))
