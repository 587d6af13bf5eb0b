"""LoRA adapters in PEFT's format: outputs equal transformers on the merged weights, with
adapters and the base model mixed in one batch."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.entrypoints.openai.launch import server_process
from kvserve.errors import CheckpointError
from kvserve.tools.make_lora import TARGETS, make_lora
from tests.conftest import random_prompts
from tests.models.test_hf_equivalence import MAX_TOKENS, assert_no_blocks_held


def write_adapter(base: Path, folder: Path, seed: int, rank: int = 4, alpha: float = 8.0,
                  targets: tuple[str, ...] = TARGETS) -> dict[str, tuple[torch.Tensor,
                                                                        torch.Tensor]]:
    return make_lora(base, folder, rank, alpha, targets, seed, std=0.2)


def two_adapters(base: Path, folder: Path) -> dict[str, str]:
    """Adapters "first" and "second" of `base` (seeds 1 and 2), as lora_modules."""
    for seed, name in enumerate(("first", "second"), start=1):
        write_adapter(base, folder / name, seed=seed)
    return {name: str(folder / name) for name in ("first", "second")}


def merged_greedy(base: Path, pairs: dict, scale: float, prompts: list[list[int]]
                  ) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, (a, b) in pairs.items():
            modules[name].weight += scale * b @ a
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS,
                               min_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def test_adapters_and_the_base_model_in_one_batch(model_dirs, tmp_path):
    base = model_dirs["llama"]
    first = write_adapter(base, tmp_path / "first", seed=1)
    second = write_adapter(base, tmp_path / "second", seed=2, rank=8, alpha=4.0,
                           targets=("q_proj", "v_proj", "down_proj"))
    llm = LLM(str(base), lora_modules={"first": str(tmp_path / "first")})
    llm.engine.add_lora("second", str(tmp_path / "second"))
    prompts = random_prompts([5, 40, 17], seed=3)
    expected = {None: merged_greedy(base, {}, 1.0, prompts),
                "first": merged_greedy(base, first, 8.0 / 4, prompts),
                "second": merged_greedy(base, second, 4.0 / 8, prompts)}
    assert expected["first"] != expected[None] and expected["second"] != expected[None]
    names = [None, "first", "second"] * 3
    batch = [{"prompt_token_ids": prompts[i % 3], "lora_name": name} if name else
             {"prompt_token_ids": prompts[i % 3]} for i, name in enumerate(names)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second run hits the prefix cache, which keeps adapters apart
        outputs = llm.generate(batch, params, use_tqdm=False)
        for i, (name, out) in enumerate(zip(names, outputs, strict=True)):
            assert out.outputs[0].token_ids == expected[name][i % 3], (name, i)
    assert llm.get_stats().prefix_cache_hits > 0
    assert_no_blocks_held(llm)


def test_vllms_lora_request_loads_the_adapter_and_runs_prompts_with_it(model_dirs, tmp_path):
    base = model_dirs["llama"]
    tagged = LLM(str(base), lora_modules=two_adapters(base, tmp_path))
    prompts = random_prompts([5, 17, 9], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [out.outputs[0].token_ids for out in tagged.generate(
        [{"prompt_token_ids": p, **name} for p, name in zip(prompts, [
            {"lora_name": "first"}, {}, {"lora_name": "second"}], strict=True)],
        params, use_tqdm=False)]
    plain = tagged.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
    assert plain[0].outputs[0].token_ids != expected[0]  # the adapter changes the output
    llm = LLM(str(base))
    first = LoRARequest("first", 1, str(tmp_path / "first"))
    second = LoRARequest("second", 2, str(tmp_path / "second"))
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                       lora_request=[first, None, second])
    assert [out.outputs[0].token_ids for out in got] == expected
    assert llm.engine.lora_names == {"first", "second"}
    again = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False,
                         lora_request=first)  # loaded already: used as it is
    assert again[0].outputs[0].token_ids == expected[0]
    with pytest.raises(ValueError, match="lora_request has 1 entries for 3 prompts"):
        llm.generate(["a", "b", "c"], params, lora_request=[first])
    with pytest.raises(ValueError, match="lora_request\\[0\\] must be a LoRARequest or None, "
                                         "got str"):
        llm.generate(["a"], params, lora_request=["first"])
    with pytest.raises(ValueError, match="lora_path must be a non-empty string"):
        LoRARequest("third", 3, "")
    assert_no_blocks_held(llm)


def test_bad_adapters_and_names_are_refused(model_dirs, tmp_path):
    base = model_dirs["llama"]
    llm = LLM(str(base))
    with pytest.raises(ValueError, match="lora_name 'missing' is not a loaded adapter"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "lora_name": "missing"}, use_tqdm=False)
    with pytest.raises(CheckpointError, match="no adapter_config.json"):
        llm.engine.add_lora("empty", str(tmp_path))
    write_adapter(base, tmp_path / "dora", seed=1)
    config = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**config,
                                                                      "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora"):
        llm.engine.add_lora("dora", str(tmp_path / "dora"))
    with pytest.raises(ValueError, match="max_loras"):
        LLM(str(base), max_loras=1, lora_modules={"a": "x", "b": "y"})


@pytest.mark.parametrize("config_text, edit, message", [
    ("{not json", None, "cannot read adapter_config.json: Expecting property name"),
    ("[1, 2]", None, "adapter_config.json must hold a JSON object"),
    ({"r": "4"}, None, "adapter_config.json r must be an integer >= 1, got '4'"),
    ({"r": 0}, None, "adapter_config.json r must be an integer >= 1, got 0"),
    ({"lora_alpha": "big"}, None, "adapter_config.json lora_alpha must be a number, got 'big'"),
    (None, ("q_proj.lora_A", lambda t: torch.zeros(t.shape[0], t.shape[1] + 1)),
     r"self_attn.q_proj: lora_A \[4, 65\] and lora_B \[64, 4\] do not fit r=4 and the "
     r"layer's \[64, 64\]"),
    (None, ("k_proj.lora_B", lambda t: torch.zeros(t.shape[0] + 3, t.shape[1])),
     r"k_proj: lora_A \[4, 64\] and lora_B \[35, 4\] do not fit"),
    (None, ("v_proj.lora_A", lambda t: torch.full_like(t, float("nan"))),
     "v_proj: lora_A or lora_B holds NaN or infinite values"),
])
def test_a_broken_adapter_is_refused_by_what_breaks_it(model_dirs, tmp_path, config_text, edit,
                                                       message):
    from safetensors.torch import load_file, save_file

    base, folder = model_dirs["llama"], tmp_path / "adapter"
    write_adapter(base, folder, seed=1)
    config_file = folder / "adapter_config.json"
    if isinstance(config_text, str):
        config_file.write_text(config_text)
    elif config_text is not None:
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                           **config_text}))
    if edit is not None:
        tensors = load_file(folder / "adapter_model.safetensors")
        key = next(k for k in tensors if edit[0] in k)
        tensors[key] = edit[1](tensors[key])
        save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(CheckpointError, match=message):
        LLM(str(base), lora_modules={"broken": str(folder)})


def test_an_adapter_unloaded_and_reloaded_under_its_name_never_hits_the_old_kv(model_dirs,
                                                                              tmp_path):
    base = model_dirs["llama"]
    write_adapter(base, tmp_path / "first", seed=1)
    write_adapter(base, tmp_path / "second", seed=2)
    llm = LLM(str(base), max_loras=1, lora_modules={"a": str(tmp_path / "first")})
    prompt = {"prompt_token_ids": random_prompts([40], seed=3)[0], "lora_name": "a"}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.add_request(prompt, params, "running")
    llm.engine.step()
    with pytest.raises(ValueError, match="in use by 1 unfinished"):
        llm.engine.remove_lora("a")
    llm.engine.abort_request("running")
    llm.engine.remove_lora("a")  # its slot is free for another (max_loras=1)
    with pytest.raises(ValueError, match="not a loaded adapter"):
        llm.engine.remove_lora("a")
    llm.engine.add_lora("a", str(tmp_path / "second"))
    hits = llm.get_stats().prefix_cache_hits
    second = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.get_stats().prefix_cache_hits == hits  # the first adapter's KV is not reused
    fresh = LLM(str(base), lora_modules={"a": str(tmp_path / "second")})
    assert second == fresh.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert second != first
    assert_no_blocks_held(llm)


def test_the_server_serves_adapters_as_models(model_dirs, tmp_path):
    base = model_dirs["llama"]
    llm = LLM(str(base), lora_modules=two_adapters(base, tmp_path))
    prompt = random_prompts([12], seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def offline(name: str) -> str:
        return llm.generate({"prompt_token_ids": prompt, "lora_name": name}, params,
                            use_tqdm=False)[0].outputs[0].text

    flags = ["--served-model-name", "base", "--lora-modules", f"first={tmp_path / 'first'}"]
    with server_process(str(base), flags, timeout=300) as url:
        def complete(model: str) -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True})

        models = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        assert models == ["base", "first"]
        assert complete("first").json()["choices"][0]["text"] == offline("first")
        assert complete("second").status_code == 404
        loaded = httpx.post(f"{url}/v1/load_lora_adapter",
                            json={"lora_name": "second", "lora_path": str(tmp_path / "second")})
        assert loaded.status_code == 200, loaded.text
        assert complete("second").json()["choices"][0]["text"] == offline("second")
        bad = httpx.post(f"{url}/v1/load_lora_adapter",
                         json={"lora_name": "third", "lora_path": str(tmp_path / "none")})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "first"})
        assert unloaded.status_code == 200, unloaded.text
        assert complete("first").status_code == 404
        again = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "first"})
        assert again.status_code == 404 and "lora_name" in again.json()["error"]["message"]
