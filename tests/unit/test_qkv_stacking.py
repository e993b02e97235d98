"""The attention layers' stacked q/k/v weight (PagedAttention.stack_projections, called by
load_model): the checkpoint's parameters stay as they were, as views of the stacked tensor,
and project_qkv computes what three separate projections compute. The stacked GEMM runs where
the step's plan asks for it (GpuBatchPlan.stacked_qkv; the tests ask with stacked=True) and
the single-row GEMM kernel takes the operands (CUDA); `stacked_path` sends the CPU's one-row
steps there too (through F.linear), so its splitting and checks run here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.layers.attention import PagedAttention
from engine.execution.loader import load_model
from engine.models.registry import load_model_config
from engine.models.granite_moe_hybrid import GraniteMoeHybridModel
from engine.parallel.tensor_parallel import TensorParallel
from engine.parallel.shard_layout import rank_shard_layout


ATTENTION_LAYER = load_model_config(DEFAULT_MODEL_DIR).layer_types.index("attention")


@pytest.fixture
def stacked_path(monkeypatch):
    from engine.layers import attention as attention_module

    monkeypatch.setattr(attention_module, "routes_to_skinny", lambda x, weight, bias: x.shape[0] == 1)


@pytest.fixture(scope="module")
def attention() -> PagedAttention:
    model, _ = load_model(DEFAULT_MODEL_DIR)
    return model.layers[ATTENTION_LAYER].self_attn


def _checkpoint_projections(layer_index: int, hidden: torch.Tensor) -> list[torch.Tensor]:
    """q, k and v of hidden with the weights read from the checkpoint file itself."""
    from safetensors import safe_open

    (path,) = sorted(DEFAULT_MODEL_DIR.glob("*.safetensors"))
    with safe_open(str(path), framework="pt") as f:
        return [F.linear(hidden, f.get_tensor(f"model.layers.{layer_index}.self_attn.{name}.weight").float())
                for name in ("q_proj", "k_proj", "v_proj")]


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("stacked", [True, False])
def test_project_qkv_equals_the_checkpoints_projections(attention, rows, stacked, request):
    """One row (the stacked GEMM, or on the CPU three) and several (three GEMMs) against
    F.linear with the weights read from the safetensors file (the default model has no
    attention bias)."""
    if stacked:
        request.getfixturevalue("stacked_path")
    assert attention.q_proj.bias is None
    hidden = torch.randn(rows, attention.q_proj.weight.shape[1], generator=torch.Generator().manual_seed(rows))
    got = attention.project_qkv(hidden, stacked=True)
    shapes = [(rows, attention.num_heads, attention.head_dim)] + 2 * [(rows, attention.num_kv_heads, attention.head_dim)]
    for value, want, shape in zip(got, _checkpoint_projections(ATTENTION_LAYER, hidden), shapes):
        assert value.shape == shape
        torch.testing.assert_close(value.reshape(rows, -1), want, rtol=1e-5, atol=1e-6)


def test_a_conversion_stacks_again(stacked_path):
    """.double() makes new parameters; the module stacks them again, so the one-row GEMM runs
    in the new dtype and still equals the three projections."""
    model, _ = load_model(DEFAULT_MODEL_DIR)
    attention = model.layers[ATTENTION_LAYER].self_attn.double()
    stacked, _ = attention._stacked_qkv
    assert stacked.dtype == torch.float64
    assert attention.k_proj.weight.data_ptr() == stacked.data_ptr() + attention.q_proj.weight.numel() * 8
    hidden = torch.randn(1, stacked.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    key = attention.project_qkv(hidden, stacked=True)[1].reshape(1, -1)
    torch.testing.assert_close(key, F.linear(hidden, attention.k_proj.weight))


def test_a_replaced_parameter_is_an_error(stacked_path):
    """A parameter assigned after stacking is not a view of the stacked weight: the one-row
    path refuses to run on the stale stacked copy."""
    model, _ = load_model(DEFAULT_MODEL_DIR)
    attention = model.layers[ATTENTION_LAYER].self_attn
    attention.v_proj.weight = torch.nn.Parameter(attention.v_proj.weight.clone(), requires_grad=False)
    hidden = torch.zeros(1, attention.v_proj.weight.shape[1])
    with pytest.raises(RuntimeError, match="replaced after stack_projections"):
        attention.project_qkv(hidden, stacked=True)
    attention.stack_projections()
    attention.project_qkv(hidden, stacked=True)


def test_parameters_are_views_of_the_stacked_weight(attention, stacked_path):
    """Names and shapes are the checkpoint's; writing q_proj.weight changes the one-row GEMM."""
    names = {name for name, _ in attention.named_parameters()}
    assert {"q_proj.weight", "k_proj.weight", "v_proj.weight"} <= names
    stacked, _ = attention._stacked_qkv
    q, k, v = attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight
    assert stacked.shape == (q.shape[0] + k.shape[0] + v.shape[0], q.shape[1])
    assert all(p.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr() for p in (q, k, v))
    hidden = torch.randn(1, q.shape[1], generator=torch.Generator().manual_seed(9))
    before = attention.project_qkv(hidden, stacked=True)[1].clone()
    with torch.no_grad():
        saved = attention.k_proj.weight.clone()
        attention.k_proj.weight.mul_(2)
        try:
            torch.testing.assert_close(attention.project_qkv(hidden, stacked=True)[1], 2 * before, rtol=1e-6, atol=1e-6)
        finally:
            attention.k_proj.weight.copy_(saved)


def test_forward_before_stacking_is_an_error():
    config = load_model_config(DEFAULT_MODEL_DIR)
    layout = rank_shard_layout(config, TensorParallel.single())
    layer = PagedAttention(config, layout, TensorParallel.single(), torch.float32)
    with pytest.raises(RuntimeError, match="stack_projections"):
        layer.project_qkv(torch.zeros(1, config.hidden_size), stacked=True)


def test_parameter_count_is_the_checkpoints():
    """Stacking adds no parameter: the loaded model counts what a model built from the config does."""
    model, _ = load_model(DEFAULT_MODEL_DIR)
    with torch.device("meta"):
        fresh = GraniteMoeHybridModel(load_model_config(DEFAULT_MODEL_DIR))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in fresh.parameters())
