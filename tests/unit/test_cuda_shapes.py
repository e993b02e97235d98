"""engine/execution/loader.py check_cuda_shapes: a model the CUDA kernels cannot serve is refused by
name when it is loaded for CUDA, before any weight is read or any CUDA call is made (so this
runs without a GPU); loaded for the CPU it is served."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.execution.loader import load_model


def test_a_non_power_of_two_head_dim_is_refused_for_cuda_only(tmp_path):
    model_dir = tmp_path / "head_dim_24"
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    assert config["hidden_size"] // heads & (config["hidden_size"] // heads - 1) == 0  # the embedded model's is
    (model_dir / "config.json").write_text(json.dumps({**config, "head_dim": 24}))
    with pytest.raises(ValueError, match="head_dim 24: the CUDA attention kernels need a power of two"):
        load_model(model_dir, device="cuda")
    # on the CPU the shapes pass and loading reaches the weights, saved for the embedded head_dim
    with pytest.raises(ValueError, match=r"k_proj.weight' has shape \(64, 128\), the model expects \(48, 128\)"):
        load_model(model_dir, device="cpu")
