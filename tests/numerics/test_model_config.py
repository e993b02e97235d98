"""config.json spellings (docs/design.md section 7) and the loader's refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.execution.loader import load_model
from engine.models.registry import load_model_config
from numerics_support import TINY_CONFIGS, PagedRunner, Request, build_random_case, rel_err

# What transformers 5.x writes (linear_attention/full_attention, rope_parameters, dtype, __float__).
TRANSFORMERS_5 = {
    "model_type": "granitemoehybrid",
    "vocab_size": 97,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "shared_intermediate_size": 96,
    "intermediate_size": 11008,
    "num_local_experts": 0,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 2,
    "mamba_expand": 2,
    "position_embedding_type": "rope",
    "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"},
    "time_step_limit": [0.0, {"__float__": "Infinity"}],
    "dtype": "float32",
    "eos_token_id": 2,
    "bos_token_id": 1,
    "pad_token_id": None,
}

# What published Granite-4.0-H checkpoints write (mamba/attention, nope, torch_dtype, plain rope_theta).
PUBLISHED = {
    **{k: v for k, v in TRANSFORMERS_5.items() if k not in ("rope_parameters", "time_step_limit", "dtype")},
    "layer_types": ["mamba", "attention", "mamba"],
    "position_embedding_type": "nope",
    "rope_theta": 10000,
    "mamba_d_head": "auto",
    "torch_dtype": "bfloat16",
    "eos_token_id": [100257, 2],
}

DROP = object()  # an override that removes the field


def write_config(directory: Path, raw: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def test_transformers_5_spelling(tmp_path):
    config = load_model_config(write_config(tmp_path, TRANSFORMERS_5))
    assert config.layer_types == ("mamba", "attention", "mamba")
    assert (config.mamba_layers, config.attention_layers) == ([0, 2], [1])
    assert config.rope_theta == 5000.0
    assert config.time_step_limit == (0.0, math.inf)
    assert config.dtype == "float32"
    assert config.eos_token_ids == (2,)
    assert config.head_dim == 16
    assert config.mamba_conv_dim == 128 + 2 * 2 * 16


def test_published_checkpoint_spelling(tmp_path):
    config = load_model_config(write_config(tmp_path, PUBLISHED))
    assert config.layer_types == ("mamba", "attention", "mamba")
    assert config.rope_theta is None
    assert config.mamba_d_head == 16  # "auto": mamba_expand * hidden_size / mamba_n_heads
    assert config.dtype == "bfloat16"
    assert config.eos_token_ids == (100257, 2)
    assert config.time_step_limit == (0.0, math.inf)


@pytest.mark.parametrize(
    "overrides, field, expected",
    [
        ({"position_embedding_type": None}, "rope_theta", None),
        (
            {"position_embedding_type": "rope", "rope_parameters": None, "rope_theta": 800},
            "rope_theta",
            800.0,
        ),
        ({"time_step_limit": [0.001, 100.0]}, "time_step_limit", (0.001, 100.0)),
        ({"time_step_limit": [0.0, math.inf]}, "time_step_limit", (0.0, math.inf)),  # JSON Infinity
        ({"time_step_limit": None}, "time_step_limit", (0.0, math.inf)),
        ({"dtype": None, "torch_dtype": "bfloat16"}, "dtype", "bfloat16"),
        ({"dtype": "torch.float16"}, "dtype", "float16"),
        ({"eos_token_id": [5, 6]}, "eos_token_ids", (5, 6)),
        ({"eos_token_id": None}, "eos_token_ids", ()),
        ({"num_key_value_heads": None}, "num_key_value_heads", 4),
        ({"num_local_experts": DROP}, "num_local_experts", 8),  # transformers' default: MoE
    ],
)
def test_spelling_variants(tmp_path, overrides, field, expected):
    raw = {k: v for k, v in {**TRANSFORMERS_5, **overrides}.items() if v is not DROP}
    config = load_model_config(write_config(tmp_path, raw))
    assert getattr(config, field) == expected


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"num_local_experts": None}, "num_local_experts"),
        ({"num_local_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"layer_types": ["mamba", "moe", "attention"]}, "layer_types"),
        ({"layer_types": ["mamba", "attention"]}, "layer_types"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type"),
        ({"mamba_d_head": 24}, "mamba_d_head"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "llama"}, "model_type 'llama' is not supported; supported: .*granitemoehybrid"),
    ],
)
def test_rejects_what_it_cannot_run(tmp_path, overrides, field):
    raw = {k: v for k, v in {**TRANSFORMERS_5, **overrides}.items() if v is not DROP}
    with pytest.raises(ValueError, match=field):
        load_model_config(write_config(tmp_path, raw))


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    return build_random_case("loader", TINY_CONFIGS["nope_mamba_heavy"], tmp_path_factory.mktemp("loader"))


def _broken_copy(source: Path, destination: Path, edit) -> Path:
    destination.mkdir()
    (destination / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, destination / "model.safetensors")
    return destination


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.1.mamba.A_log"), "lacks tensors for.*layers.1.mamba.A_log"),
        (lambda t: t.update({"model.layers.0.mamba.extra": torch.zeros(3)}), "unexpected tensor"),
        (lambda t: t.update({"model.norm.weight": torch.zeros(63)}), "model.norm.weight.*shape"),
    ],
)
def test_loader_refuses_missing_unexpected_and_misshapen(tmp_path, saved_model, edit, message):
    broken = _broken_copy(saved_model.model_dir, tmp_path / "broken", edit)
    with pytest.raises(ValueError, match=message):
        load_model(broken)


def test_bfloat16_load_keeps_ssm_parameters_fp32(saved_model):
    model, _ = load_model(saved_model.model_dir, dtype=torch.bfloat16)
    mixer = model.layers[0].mamba
    assert mixer.in_proj.weight.dtype == torch.bfloat16
    assert (mixer.A_log.dtype, mixer.D.dtype, mixer.dt_bias.dtype) == (torch.float32,) * 3
    runner = PagedRunner(model)
    assert runner.caches.ssm_state[0].dtype == torch.float32
    assert runner.caches.conv_state[0].dtype == torch.bfloat16
    prompt = saved_model.prompt(24, seed=0)
    logits = runner.run_in_chunks(Request(state_slot=0), prompt, [10])
    assert rel_err(logits, saved_model.reference_logits(prompt)) < 5e-2


def test_cache_byte_formulas_match_allocation(saved_model):
    model = saved_model.model
    caches = model.allocate_caches(num_blocks=5, block_size=16, num_state_slots=3)
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    kv = nbytes([*caches.key_cache.values(), *caches.value_cache.values()])
    state = nbytes([*caches.conv_state.values(), *caches.ssm_state.values()])
    assert kv == 5 * model.kv_bytes_per_block(16)
    assert state == 3 * model.state_bytes_per_slot()
