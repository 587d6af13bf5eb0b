"""Tiny random checkpoints shared by the whole test session, built by `make-model`, and a
policy that verifies every draft."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve.core.scheduler.speculation import DraftPolicy
from kvserve.cpp_extension import cpu_kernels
from kvserve.tools.make_model import make_model

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. It is chosen when
# a kernel is defined, so this must precede any import of one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests compare float32 outputs token for token (with transformers, across batch shapes):
# `--dtype auto` must mean float32 on every machine, bfloat16 CPUs included.
os.environ["KVSERVE_CPU_BF16"] = "0"

ARCHES = ["llama", "mistral", "qwen2", "qwen3"]
# The tiny Mistral's window is 64 tokens, so prompts of a few hundred tokens cross it.
SLIDING_WINDOW = 64


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, the controller builds the C++ kernels before any worker starts: a
    server that one worker starts would otherwise wait out its start-up timeout for the
    build that another worker holds (minutes on a fresh 2-core machine)."""
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        cpu_kernels()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for arch in ARCHES:
        # Qwen2 is written in several shards to exercise the sharded index.
        dirs[arch] = make_model("tiny", root / arch, arch=arch, sliding_window=SLIDING_WINDOW,
                                max_shard_bytes=200_000 if arch == "qwen2" else 2 << 30)
    return dirs


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


# Beyond the plain Llama layout: YaRN on two of the tiny checkpoints (a 256-token original
# context stretched 8x, so the limit grows past max_position_embeddings); a Phi-3 checkpoint
# (fused q/k/v and gate/up, 3/4 of each head rotated, LongRoPE from 256 positions, a sliding
# window); Gemma 2 and Gemma 3 checkpoints (a local layer with the window, then a global one).
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256}
PHI3_ORIGINAL_CONTEXT = 256


@pytest.fixture(scope="session")
def variant_dirs(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rope")
    dirs = {arch: make_model("tiny", root / arch, arch=arch, sliding_window=SLIDING_WINDOW)
            for arch in ("phi3", "gemma2", "gemma3")}
    for arch in ("llama", "qwen3"):
        dirs[f"{arch}-yarn"] = path = root / f"{arch}-yarn"
        shutil.copytree(model_dirs[arch], path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config | {"rope_scaling": YARN}))
    return dirs


def wait_for(condition: Callable[[], object], what: str, seconds: float = 120) -> None:
    """Polls `condition` until it holds; fails naming `what` after `seconds` (a bound on a
    hang, not a timing to pass)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.1)


def random_prompts(lengths: list[int], vocab_size: int = 3000, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture
def always_draft(monkeypatch):
    """Every draft proposed and verified, whatever the policy would measure as paying (with a
    draft model as costly as the target, nothing would)."""
    monkeypatch.setattr(DraftPolicy, "num_to_propose", lambda self, request, n, most: most)
    monkeypatch.setattr(DraftPolicy, "num_to_verify",
                        lambda self, request, n: len(request.spec_token_ids))
