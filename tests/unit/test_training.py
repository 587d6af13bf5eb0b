"""Trained test models: a disjoint held-out split, deterministic training that learns, and
drafts distilled from a teacher."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from kvserve.models.loader import iter_checkpoint
from kvserve.tools.corpus import heldout_windows, split_files, stdlib_files
from kvserve.tools.make_model import make_model
from kvserve.tools.train import (
    AGREEMENT_WINDOWS,
    DISTILL_PROMPT_LEN,
    teacher_agreement,
    teacher_continuations,
)


def test_heldout_split_is_disjoint_and_complete():
    train, heldout = set(split_files("train")), set(split_files("heldout"))
    assert not train & heldout and train | heldout == set(stdlib_files())
    assert 0.04 < len(heldout) / len(stdlib_files()) < 0.06
    with pytest.raises(ValueError, match="split must be train or heldout"):
        split_files("test")


def test_training_is_deterministic_and_lowers_the_heldout_loss(tmp_path):
    runs = [make_model("tiny", tmp_path / name, train_steps=12, seed=1) for name in "ab"]
    digests = [hashlib.sha256((run / "model.safetensors").read_bytes()).hexdigest()
               for run in runs]
    assert digests[0] == digests[1]
    untrained = make_model("tiny", tmp_path / "c", seed=1)
    assert digests[0] != hashlib.sha256((untrained / "model.safetensors").read_bytes()
                                        ).hexdigest()
    report = json.loads((runs[0] / "training.json").read_text())
    assert report["steps"] == 12
    assert report["heldout_loss"] < 7.5  # ln(3000) = 8.0 for a uniform guess
    with pytest.raises(ValueError, match="train_steps must be >= 0"):
        make_model("tiny", tmp_path / "d", train_steps=-1)


def test_a_mixture_of_experts_trains_under_its_checkpoint_names(tmp_path):
    """transformers stacks the experts; the trained checkpoint names each expert's weights as
    the untrained one does, and training moved every expert (and the shared one)."""
    untrained = dict(iter_checkpoint(make_model("tiny", tmp_path / "a", arch="qwen2_moe")))
    trained = dict(iter_checkpoint(make_model("tiny", tmp_path / "b", arch="qwen2_moe",
                                              train_steps=3)))
    assert {n: t.shape for n, t in trained.items()} == {n: t.shape for n, t in untrained.items()}
    experts = [n for n in trained if ".experts." in n or ".shared_expert." in n]
    assert len(experts) == 2 * 3 * 9  # layers x projections x (8 experts + the shared one)
    assert not [n for n in experts if torch.equal(trained[n], untrained[n])]


def test_distillation_trains_a_draft_that_agrees_with_its_teacher(tmp_path):
    teacher = make_model("tiny", tmp_path / "teacher", seed=2)
    draft = make_model("tiny", tmp_path / "draft", train_steps=20, seed=1, distill_from=teacher)
    report = json.loads((draft / "training.json").read_text())
    assert report["teacher"] == str(teacher)
    # The report's agreement is the one measured here, on the same held-out windows...
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(teacher / "tokenizer.json"))
    continuations = teacher_continuations(
        teacher, tokenizer, heldout_windows(tokenizer, DISTILL_PROMPT_LEN, AGREEMENT_WINDOWS),
        256, progress=False)
    assert continuations.shape == (AGREEMENT_WINDOWS, 256)
    distilled = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32)
    assert report["teacher_agreement"] == round(teacher_agreement(distilled, continuations), 4)
    # ...and far above that of the same model trained as long on the teacher's own text.
    text_trained = AutoModelForCausalLM.from_pretrained(
        make_model("tiny", tmp_path / "text", train_steps=20, seed=1), dtype=torch.float32)
    assert report["teacher_agreement"] > 2 * teacher_agreement(text_trained, continuations)


def test_distillation_refuses_what_it_cannot_use(tmp_path):
    with pytest.raises(ValueError, match="distill_from needs train_steps > 0"):
        make_model("tiny", tmp_path / "a", distill_from=tmp_path)
    with pytest.raises(ValueError, match="distill_from must be a checkpoint folder"):
        make_model("tiny", tmp_path / "b", train_steps=2, distill_from=tmp_path / "none")
    other_vocabulary = make_model("small", tmp_path / "small")
    with pytest.raises(ValueError, match="distill_from: .*tokenizer differs"):
        make_model("tiny", tmp_path / "c", train_steps=2, distill_from=other_vocabulary)
