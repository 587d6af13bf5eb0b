"""What a checkpoint's files set for requests, and the options that replace them: its
generation_config.json sets the sampling defaults of requests that leave a field out (vLLM's
`--generation-config auto`; a field the request sets wins, and `vllm` turns the file off), and
`--chat-template` stands in for its tokenizer's chat template."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from kvserve import LLM, SamplingParams
from kvserve.config import sampling_defaults
from kvserve.entrypoints.async_llm import AsyncLLM
from kvserve.entrypoints.openai.server import ServerConfig, build_app
from kvserve.errors import CheckpointError
from kvserve.sampling_params import StructuredOutputParams
from tests.unit.test_engine_args import parse

PROMPT = "def fibonacci(n):"
# Greedy, 5 tokens, and a penalty strong enough to change a random model's greedy output.
AUTHORS = {"temperature": 0.0, "top_k": 0, "repetition_penalty": 1.5, "max_new_tokens": 5}


def with_file(model: Path, folder: Path, name: str, content: dict) -> Path:
    """The model's files, with `name` written anew as `content`."""
    folder.mkdir()
    for file in model.iterdir():
        (folder / file.name).symlink_to(file)
    (folder / name).unlink()
    (folder / name).write_text(json.dumps(content))
    return folder


def with_generation_config(model: Path, folder: Path, fields: dict) -> Path:
    """The model's files, with a generation_config.json of `fields` (and its EOS id)."""
    return with_file(model, folder, "generation_config.json", {"eos_token_id": 2, **fields})


@pytest.fixture(scope="module")
def authored(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_generation_config(llama_dir, tmp_path_factory.mktemp("g") / "m", AUTHORS)


def test_offline_generate_without_params_samples_as_the_model_author_set(authored: Path):
    llm = LLM(str(authored))
    want = SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=5)
    assert llm.get_default_sampling_params() == want
    defaulted = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
    assert defaulted.token_ids == llm.generate([PROMPT], want)[0].outputs[0].token_ids
    assert len(defaulted.token_ids) == 5 and defaulted.finish_reason == "length"
    # Given params are taken as they are, as in vLLM: the file fills in no field of theirs.
    given = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert len(given.outputs[0].token_ids) == 3
    engine_own = LLM(str(authored), generation_config="vllm")
    assert engine_own.get_default_sampling_params() == SamplingParams()


def test_the_server_fills_in_the_fields_a_request_leaves_out(authored: Path):
    llm = LLM(str(authored))

    def greedy(**fields) -> str:
        params = SamplingParams(temperature=0.0, **fields)
        return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text

    penalized, unpenalized = greedy(repetition_penalty=1.5, max_tokens=8), greedy(max_tokens=8)
    assert penalized != unpenalized  # else the test could not tell them apart

    async def run() -> None:
        served = AsyncLLM(str(authored))
        transport = httpx.ASGITransport(app=build_app(served, ServerConfig(model_name="m")))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                async def complete(**fields) -> dict:
                    response = await client.post("/v1/completions",
                                                 json={"prompt": PROMPT, **fields})
                    assert response.status_code == 200, response.text
                    return response.json()

                # temperature 0 and the penalty from the file: n choices all greedy
                both = await complete(max_tokens=8, n=2)
                assert [c["text"] for c in both["choices"]] == [penalized] * 2
                # a field the request sets wins over the file's
                assert (await complete(max_tokens=8, repetition_penalty=1.0)
                        )["choices"][0]["text"] == unpenalized
                # chat leaves max_tokens to the server: the file's max_new_tokens
                chat = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}]})
                assert chat.json()["usage"]["completion_tokens"] == 5
                assert chat.json()["choices"][0]["finish_reason"] == "length"
        finally:
            served.shutdown()

    asyncio.run(run())


def test_bad_generation_configs_are_named(llama_dir: Path, tmp_path: Path):
    bad = with_generation_config(llama_dir, tmp_path / "bad", {"temperature": -0.5})
    with pytest.raises(CheckpointError, match=r"generation_config.json: temperature: "
                                              r"temperature must be in \[0, 1e\+06\], got -0.5"):
        LLM(str(bad))
    text = with_generation_config(llama_dir, tmp_path / "text", {"top_k": "50"})
    with pytest.raises(CheckpointError, match="top_k must be an integer, got '50'"):
        sampling_defaults(str(text))
    with pytest.raises(ValueError, match="override_generation_config: max_length not among"):
        sampling_defaults(str(llama_dir), overrides={"max_length": 9})
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a folder "
                                         "holding a generation_config.json, got 'nowhere'"):
        sampling_defaults(str(llama_dir), "nowhere")
    # another folder's file, then overrides on top (top_k 0 is off, as in vLLM)
    other = with_generation_config(llama_dir, tmp_path / "other", {"temperature": 0.7,
                                                                   "top_p": 0.8})
    assert sampling_defaults(str(llama_dir)) == {}  # make-model writes no sampling fields
    assert sampling_defaults(str(llama_dir), str(other), {"top_k": 0, "max_new_tokens": 9}
                             ) == {"temperature": 0.7, "top_p": 0.8, "top_k": -1,
                                   "max_tokens": 9}


def test_the_flags_reach_the_engine_and_survive_a_round_trip():
    from kvserve.engine_args import engine_flags, engine_kwargs

    args = parse("--model", "m", "--generation-config", "vllm",
                 "--override-generation-config", '{"temperature": 0.5, "top_p": 0.9}')
    assert vars(parse("--model", "m", *engine_flags(args))) == vars(args)
    kwargs = engine_kwargs(args)
    assert kwargs["generation_config"] == "vllm"
    assert kwargs["override_generation_config"] == {"temperature": 0.5, "top_p": 0.9}
    with pytest.raises(SystemExit):
        parse("--model", "m", "--override-generation-config", "[1]")


ROLES = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def test_a_chat_template_given_stands_in_for_the_tokenizers_own(llama_dir: Path,
                                                               tmp_path: Path):
    own = json.loads((llama_dir / "tokenizer_config.json").read_text())
    del own["chat_template"]
    bare = with_file(llama_dir, tmp_path / "bare", "tokenizer_config.json", own)
    hello = [{"role": "user", "content": "hello"}]
    with pytest.raises(ValueError, match="the model has no chat template"):
        LLM(str(bare)).chat(hello)
    (tmp_path / "roles.jinja").write_text(ROLES)
    for given in (ROLES, str(tmp_path / "roles.jinja")):  # inline, or its file
        llm = LLM(str(bare), chat_template=given)
        want = llm.get_tokenizer().encode("[user] hello\n")
        out = llm.chat(hello, SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert out.prompt_token_ids == want
    with pytest.raises(ValueError, match="chat_template: neither a Jinja template nor a "
                                         "readable file"):
        LLM(str(bare), chat_template=str(tmp_path / "missing.jinja"))
    plain = LLM(str(bare))  # vLLM's llm.chat(..., chat_template=...), for one call
    for given in (ROLES, str(tmp_path / "roles.jinja")):
        out = plain.chat(hello, SamplingParams(max_tokens=1), use_tqdm=False,
                         chat_template=given)[0]
        assert out.prompt_token_ids == plain.get_tokenizer().encode("[user] hello\n")
    with pytest.raises(ValueError, match="chat_template: not a valid Jinja template "
                                         r"\(line 1: "):
        LLM(str(bare), chat_template="{% for m in messages %}")


def test_a_tokenizer_given_stands_in_for_the_models_own(llama_dir: Path, tmp_path: Path):
    """vLLM's `--tokenizer`: another folder's tokenizer, with its chat template, for the chat
    route, the token counts and structured output; it must fit the model's vocabulary."""
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "special_tokens_map.json"):
        if (llama_dir / name).exists():
            (tokenizer / name).symlink_to(llama_dir / name)
    settings = json.loads((llama_dir / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({**settings,
                                                                 "chat_template": ROLES}))
    llm = LLM(str(llama_dir), tokenizer=str(tokenizer))
    hello = [{"role": "user", "content": "hello"}]
    out = llm.chat(hello, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("[user] hello\n")
    choice = SamplingParams(max_tokens=8, structured_output=StructuredOutputParams(
        choice=["yes", "no"]))
    assert llm.generate("x", choice, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
    with pytest.raises(CheckpointError, match="tokenizer: cannot load the tokenizer from"):
        LLM(str(llama_dir), tokenizer=str(tmp_path / "missing"))
    grown = AutoTokenizer.from_pretrained(tokenizer)
    vocab = llm.engine.config.model.vocab_size
    grown.add_tokens([f"<extra_{i}>" for i in range(vocab - len(grown) + 1)])
    grown.save_pretrained(tmp_path / "grown")
    with pytest.raises(ValueError, match=f"tokenizer: its {vocab + 1} tokens do not fit the "
                                         f"model's vocabulary of {vocab}"):
        LLM(str(llama_dir), tokenizer=str(tmp_path / "grown"))
