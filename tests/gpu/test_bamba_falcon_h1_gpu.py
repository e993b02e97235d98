"""Bamba's and Falcon-H1's CUDA paths against their CPU fp32 paths, and the Llama-layout MLP's
GPU path (SplitGatedMLP.forward_gpu, also under Triton's interpreter).

The models: random checkpoints (tests/tp/tp_support.py write_random_checkpoint; both families
name parameters as the checkpoint after "model."), run through the steps of test_model_gpu.py
(fresh and continued prefills, a 1-token prefill, decodes) and then a one-row decode step (the
single-row GEMMs, the fused Mamba decode kernel, the gated norm folded where it can be);
hidden states of every step and a state slot after the last within the dtype's tolerance.
Falcon-H1 in its three Mamba norm forms (no norm, normed before the gate, after it: only the
last folds, and only with one norm group), every multiplier != 1, every layer attention and
Mamba2 side by side; Bamba with partial RoPE and biases.
"""

from __future__ import annotations

import pytest
import torch

from engine.interfaces.forward_batch import build_forward_batch
from engine.layers.mlp import SplitGatedMLP
from engine.execution.loader import load_model
from engine.interfaces.step_io import SchedulerOutput
from engine.parallel.tensor_parallel import TensorParallel
from tests.gpu.conftest import eager_forward, needs_device, relative_error
from tests.gpu.test_model_gpu import (
    BLOCK_SIZE,
    _chunk,
    _randomise,
    _record_launches,
    _route_on_any_device,
    _steps,
)
from tests.tp.tp_support import write_random_checkpoint

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (fla-core's scan)")

_SIZES = dict(
    vocab_size=2048, hidden_size=128, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=32, mamba_d_conv=4,
    mamba_chunk_size=256, max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
BAMBA = dict(
    _SIZES, model_type="bamba", num_hidden_layers=6, attn_layer_indices=[2, 5], mamba_n_groups=1,
    attention_bias=True, mlp_bias=True, mamba_proj_bias=True,
)
FALCON = dict(
    _SIZES, model_type="falcon_h1", num_hidden_layers=4, head_dim=32, mamba_d_ssm=256,
    mamba_n_groups=1, projectors_bias=True, embedding_multiplier=3.0, lm_head_multiplier=0.7,
    key_multiplier=1.3, attention_in_multiplier=0.8, attention_out_multiplier=1.4,
    ssm_in_multiplier=1.2, ssm_out_multiplier=0.6, ssm_multipliers=[0.9, 1.3, 0.7, 1.1, 0.5],
    mlp_multipliers=[1.5, 0.4],
)
# name -> (config.json, whether the fp32 model folds the gated norm at one row)
CASES = {
    "bamba": (BAMBA, True),
    "falcon_gate_only": (dict(FALCON, mamba_rms_norm=False), False),
    "falcon_norm_before_gate": (dict(FALCON, mamba_rms_norm=True, mamba_norm_before_gate=True), False),
    "falcon_norm_after_gate": (dict(FALCON, mamba_rms_norm=True, mamba_norm_before_gate=False), True),
    "falcon_two_groups": (dict(FALCON, mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_n_groups=2), False),
}


def _run(model_dir, device: str, dtype: torch.dtype):
    model, config = load_model(model_dir, dtype=dtype, device=device)
    caches = model.allocate_caches(num_blocks=32, block_size=BLOCK_SIZE, num_state_slots=5, device=device)
    for layer in caches.ssm_state:  # slots start as garbage: reset chunks must not read them
        caches.ssm_state[layer].fill_(float("nan"))
        caches.conv_state[layer].fill_(float("nan"))
    steps = _steps(config.vocab_size)
    steps.append(SchedulerOutput((_chunk(0, [7], 22, False),)))  # one row: batch-1 decode
    hiddens = []
    with torch.inference_mode():
        for step in steps:
            batch = build_forward_batch(list(step.chunks), BLOCK_SIZE, torch.device(device))
            hiddens.append(eager_forward(model, batch, caches).float().cpu())
    return model, hiddens, caches.ssm_state[min(caches.ssm_state)][1:4].cpu()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-2), (torch.bfloat16, 5e-2)])
def test_gpu_forward_matches_cpu(tmp_path, name, dtype, tol):
    raw, folds = CASES[name]
    model_dir = write_random_checkpoint(tmp_path / "model", raw)
    _, ref_hiddens, ref_state = _run(model_dir, "cpu", torch.float32)
    model, hiddens, state = _run(model_dir, "cuda", dtype)
    if dtype == torch.float32:
        assert model.folds_gated_norm() == folds
    for i, (h, ref) in enumerate(zip(hiddens, ref_hiddens)):
        assert relative_error(h, ref) < tol, f"step {i} hidden"
    assert relative_error(state, ref_state) < tol, "ssm state after the last step"


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("rows", [1, 2])
def test_split_mlp_gpu_path_matches_forward(device, monkeypatch, rows):
    """SplitGatedMLP.forward_gpu with biases and a gate multiplier: at one row the single-row
    GEMMs for gate_proj and up_proj and the gated one for down_proj (no SiLU-and-mul launch),
    at two rows the SiLU-and-mul kernel; both match forward in fp32. D = 44 and I = 100 are
    not multiples of the tile sizes."""
    hidden, intermediate = 44, 100
    mlp = SplitGatedMLP(hidden, intermediate, (0, intermediate), TensorParallel.single(),
                        torch.float32, bias=True, gate_multiplier=1.5).to(device)
    _randomise(mlp, seed=3)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(4)).to(device)
    with torch.inference_mode():
        want = mlp(x)  # before the rule is patched: the PyTorch path throughout
        _route_on_any_device(monkeypatch)
        launches = _record_launches(monkeypatch)
        got = mlp.forward_gpu(x)
    assert launches == (["skinny", "skinny", "skinny gated"] if rows == 1 else ["silu_and_mul"])
    assert relative_error(got, want) < 1e-5
