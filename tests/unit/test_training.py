"""Trained test models: a disjoint held-out split, deterministic training that learns."""

from __future__ import annotations

import hashlib
import json

import pytest

from kvserve.tools.corpus import split_files, stdlib_files
from kvserve.tools.make_model import make_model


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
