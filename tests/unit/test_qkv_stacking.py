"""The attention layers' stacked q/k/v weight (PagedAttention.stack_projections, called by
load_model): the checkpoint's parameters stay as they were, as views of the stacked tensor,
and project_qkv computes what three separate projections compute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import DEFAULT_MODEL_DIR
from engine.layers.attention import PagedAttention
from engine.loader import load_model
from engine.model_config import load_model_config
from engine.models.granite_moe_hybrid import GraniteMoeHybridModel
from engine.tensor_parallel import TensorParallel
from engine.shard_layout import rank_shard_layout


@pytest.fixture(scope="module")
def attention() -> PagedAttention:
    model, _ = load_model(DEFAULT_MODEL_DIR)
    return next(layer.self_attn for layer in model.layers if layer.self_attn is not None)


def _three(attention: PagedAttention, hidden: torch.Tensor) -> list[torch.Tensor]:
    return [F.linear(hidden, proj.weight, proj.bias) for proj in (attention.q_proj, attention.k_proj, attention.v_proj)]


@pytest.mark.parametrize("rows", [1, 5])
def test_project_qkv_equals_three_projections(attention, rows):
    hidden = torch.randn(rows, attention.q_proj.weight.shape[1], generator=torch.Generator().manual_seed(rows))
    got = attention.project_qkv(hidden)
    shapes = [(rows, attention.num_heads, attention.head_dim)] + 2 * [(rows, attention.num_kv_heads, attention.head_dim)]
    for value, want, shape in zip(got, _three(attention, hidden), shapes):
        assert value.shape == shape
        torch.testing.assert_close(value.reshape(rows, -1), want, rtol=1e-6, atol=1e-6)


def test_parameters_are_views_of_the_stacked_weight(attention):
    """Names and shapes are the checkpoint's; writing q_proj.weight changes the one-row GEMM."""
    names = {name for name, _ in attention.named_parameters()}
    assert {"q_proj.weight", "k_proj.weight", "v_proj.weight"} <= names
    stacked, _ = attention._stacked_qkv
    q, k, v = attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight
    assert stacked.shape == (q.shape[0] + k.shape[0] + v.shape[0], q.shape[1])
    assert all(p.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr() for p in (q, k, v))
    hidden = torch.randn(1, q.shape[1], generator=torch.Generator().manual_seed(9))
    before = attention.project_qkv(hidden)[1].clone()
    with torch.no_grad():
        saved = attention.k_proj.weight.clone()
        attention.k_proj.weight.mul_(2)
        try:
            torch.testing.assert_close(attention.project_qkv(hidden)[1], 2 * before, rtol=1e-6, atol=1e-6)
        finally:
            attention.k_proj.weight.copy_(saved)


def test_forward_before_stacking_is_an_error():
    config = load_model_config(DEFAULT_MODEL_DIR)
    layout = rank_shard_layout(config, TensorParallel.single())
    layer = PagedAttention(config, layout, TensorParallel.single(), torch.float32)
    with pytest.raises(RuntimeError, match="stack_projections"):
        layer.project_qkv(torch.zeros(1, config.hidden_size))


def test_parameter_count_is_the_checkpoints():
    """Stacking adds no parameter: the loaded model counts what a model built from the config does."""
    model, _ = load_model(DEFAULT_MODEL_DIR)
    with torch.device("meta"):
        fresh = GraniteMoeHybridModel(load_model_config(DEFAULT_MODEL_DIR))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in fresh.parameters())
