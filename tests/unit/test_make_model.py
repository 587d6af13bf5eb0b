import hashlib
import json

import pytest

from kvserve.tools.checkpoint_files import write_json
from kvserve.tools.make_lora import make_lora
from kvserve.tools.make_model import PRESETS, hf_config, make_model


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    a = digest(make_model("tiny", tmp_path / "a", seed=3))
    b = digest(make_model("tiny", tmp_path / "b", seed=3))
    c = digest(make_model("tiny", tmp_path / "c", seed=4))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["tokenizer.json"] == c["tokenizer.json"]


def test_sharded_checkpoint_has_a_complete_index(tmp_path):
    folder = make_model("tiny", tmp_path / "s", arch="qwen2", max_shard_bytes=100_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert "model.layers.1.self_attn.q_proj.bias" in index["weight_map"]
    assert not (folder / "model.safetensors").exists()


def test_num_layers_keeps_the_presets_other_shapes(tmp_path):
    config = json.loads((make_model("tiny", tmp_path / "l", arch="qwen3_moe", num_layers=3)
                         / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["hidden_size"] == 64
    assert config["num_experts"] == 8 and config["moe_intermediate_size"] == 64


def test_a_lora_rank_beyond_the_narrowest_target_is_refused(tmp_path):
    write_json(tmp_path / "config.json", hf_config(PRESETS["tiny"]))
    tiny = PRESETS["tiny"]
    narrowest = tiny.num_kv_heads * tiny.hidden_size // tiny.num_heads  # k_proj's outputs
    assert make_lora(tmp_path, tmp_path / "ok", rank=narrowest)
    with pytest.raises(ValueError, match=f"rank must be <= {narrowest}, the narrowest "
                                         f"targeted layer's smaller dimension, got "
                                         f"{narrowest + 1}"):
        make_lora(tmp_path, tmp_path / "wide", rank=narrowest + 1)
