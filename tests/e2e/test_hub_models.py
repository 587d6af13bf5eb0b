"""Hugging Face Hub model ids in place of folders, found in a Hub cache laid out as
huggingface_hub lays it out (refs naming commits, a snapshot folder per commit), offline."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.cli import _resolve_model_arg
from kvserve.errors import CheckpointError
from kvserve.tools.make_lora import make_lora
from tests.conftest import random_prompts
from tests.models.test_hf_equivalence import run_greedy

COMMITS = {"main": "1" * 40, "v2": "2" * 40}


def cache_repo(cache: Path, repo_id: str, ref: str, commit: str, folder: Path) -> None:
    """`folder` as the snapshot of `repo_id` at `ref` (commit `commit`) in a Hub cache."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)


@pytest.fixture
def hub_cache(model_dirs, tmp_path, monkeypatch) -> Path:
    """`acme/tiny` at main is the tiny Llama, at v2 the tiny Qwen3; the Hub is unreachable."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for (ref, commit), arch in zip(COMMITS.items(), ("llama", "qwen3"), strict=True):
        cache_repo(tmp_path / "hub", "acme/tiny", ref, commit, model_dirs[arch])
    return tmp_path / "hub"


def test_a_hub_id_serves_the_cached_snapshot_of_its_revision(hub_cache, llama_dir):
    llm = LLM("acme/tiny", download_dir=str(hub_cache))
    model = llm.engine.config.model
    assert Path(model.path) == hub_cache / "models--acme--tiny" / "snapshots" / COMMITS["main"]
    prompts = random_prompts([5, 30], seed=6)
    assert run_greedy(llm, prompts) == run_greedy(LLM(str(llama_dir)), prompts)
    other = LLM("acme/tiny", revision="v2", download_dir=str(hub_cache)).engine.config.model
    assert other.architecture == "Qwen3ForCausalLM"
    drafted = LLM("acme/tiny", speculative_model="acme/tiny", download_dir=str(hub_cache))
    assert drafted.engine.config.speculative.draft.path == model.path


@pytest.mark.parametrize(("model", "revision"), [("acme/other", None), ("acme/tiny", "v9")])
def test_what_the_cache_lacks_offline_is_named(hub_cache, model, revision):
    with pytest.raises(CheckpointError, match=rf"model: '{model}' is not a folder here, and "
                                              r"the Hugging Face Hub cannot give it: the Hub "
                                              r"cannot be reached and it is not in the cache"):
        LLM(model, revision=revision, download_dir=str(hub_cache))


def test_a_missing_path_still_says_it_has_no_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json in"):
        LLM(str(tmp_path / "no" / "such" / "folder"))


def test_the_server_serves_a_hub_model_under_its_id(hub_cache):
    args = argparse.Namespace(model="acme/tiny", served_model_name=None, revision="v2",
                              download_dir=str(hub_cache))
    _resolve_model_arg(args)
    assert args.served_model_name == ["acme/tiny"]
    assert Path(args.model).name == COMMITS["v2"]


def test_a_lora_adapter_by_its_hub_id(hub_cache, llama_dir, tmp_path, monkeypatch):
    """As vLLM's --lora-modules, from the Hub's default cache."""
    make_lora(llama_dir, tmp_path / "adapter", rank=4, seed=1, std=0.2)
    cache_repo(hub_cache, "acme/sql-lora", "main", COMMITS["main"], tmp_path / "adapter")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    prompts = random_prompts([5, 30], seed=7)

    def greedy(adapter: str) -> list[list[int]]:
        llm = LLM(str(llama_dir), lora_modules={"sql": adapter})
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p, "lora_name": "sql"} for p in prompts],
                               params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    assert greedy("acme/sql-lora") == greedy(str(tmp_path / "adapter"))
    with pytest.raises(CheckpointError, match="lora 'sql': 'acme/none' is not a folder here"):
        greedy("acme/none")
