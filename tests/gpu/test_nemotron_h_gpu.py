"""Nemotron-H's CUDA path (NemotronHModel with a GpuBatchPlan: the fused add+RMSNorm between
blocks, the Mamba2 and attention kernels the plan chose, the squared-ReLU kernel) against its
CPU fp32 path, on a random checkpoint with every block kind.

The steps of test_model_gpu.py (fresh and continued prefills, a 1-token prefill, decodes) and
then a one-row decode step (the single-row GEMMs, the fused Mamba decode kernel, and with one
norm group the gated norm folded into it); hidden states of every step and a state slot after
the last within the dtype's tolerance. With 4 norm groups the gated norm is never folded.
A second checkpoint has MoE blocks ("E": the router's device-side grouped top-k, the non-gated
grouped expert GEMM on latent inputs, the shared expert), checked the same way with the CPU
run's expert choices imposed on the GPU run: sigmoid scores of random logits sit close enough
that the GPU's rounding flips an expert now and then (on the H200 a 2.6e-2 fp32 error that
way), which says nothing of the kernels. Left to choose for itself, the GPU must pick the CPU's
experts for most (row, MoE block) pairs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from engine.interfaces.forward_batch import build_forward_batch
from engine.execution.loader import load_model
from engine.interfaces.step_io import SchedulerOutput
from tests.gpu.conftest import eager_forward, relative_error
from tests.gpu.test_model_gpu import BLOCK_SIZE, _chunk, _steps
from tests.tp.tp_support import write_random_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (fla-core's scan)"),
]


def _raw(n_groups: int) -> dict:
    return dict(
        model_type="nemotron_h", vocab_size=2048, hidden_size=128, intermediate_size=256,
        hybrid_override_pattern="M-M*-M-*M", num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, mamba_num_heads=8, mamba_head_dim=32, n_groups=n_groups, ssm_state_size=32,
        conv_kernel=4, chunk_size=256, use_bias=False, use_conv_bias=True, max_position_embeddings=1024,
    )


def _moe_raw() -> dict:
    """MoE blocks among the others: 8 experts in 4 groups (2 kept), top-3, latent experts."""
    return dict(
        _raw(1), hybrid_override_pattern="M-E*EM-*EM", n_routed_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=96, moe_shared_expert_intermediate_size=64, moe_latent_size=64,
        n_group=4, topk_group=2, routed_scaling_factor=2.5,
    )


@contextlib.contextmanager
def _expert_choices(recorded: list, imposed: list | None = None) -> Iterator[None]:
    """Within the block every RoutedExperts.select call appends its (expert ids, weights) to
    `recorded` (on the CPU), and with `imposed` returns imposed[i] instead of its own i-th
    choice (the same calls in the same order: the same steps through the same blocks)."""
    from engine.layers.routed_experts import RoutedExperts

    own_select = RoutedExperts.select

    def select(self, x):
        expert_ids, weights = own_select(self, x)
        recorded.append((expert_ids.cpu(), weights.float().cpu()))
        if imposed is None:
            return expert_ids, weights
        ids, imposed_weights = imposed[len(recorded) - 1]
        assert ids.shape == expert_ids.shape, "the runs routed different rows"
        return ids.to(expert_ids.device), imposed_weights.to(weights.device, weights.dtype)

    RoutedExperts.select = select
    try:
        yield
    finally:
        RoutedExperts.select = own_select


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


@pytest.mark.parametrize("n_groups", [1, 4])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-2), (torch.bfloat16, 5e-2)])
def test_gpu_forward_matches_cpu(tmp_path, n_groups, dtype, tol):
    model_dir = write_random_checkpoint(tmp_path / "model", _raw(n_groups))
    _, ref_hiddens, ref_state = _run(model_dir, "cpu", torch.float32)
    model, hiddens, state = _run(model_dir, "cuda", dtype)
    if dtype == torch.float32:  # the fold needs one norm group on the rank
        assert model.folds_gated_norm() == (n_groups == 1)
    for i, (h, ref) in enumerate(zip(hiddens, ref_hiddens)):
        assert relative_error(h, ref) < tol, f"step {i} hidden"
    assert relative_error(state, ref_state) < tol, "ssm state after the last step"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-2), (torch.bfloat16, 5e-2)])
def test_moe_gpu_forward_matches_cpu(tmp_path, dtype, tol):
    model_dir = write_random_checkpoint(tmp_path / "model", _moe_raw())
    cpu_choices, imposed, own = [], [], []
    with _expert_choices(cpu_choices):
        _, ref_hiddens, ref_state = _run(model_dir, "cpu", torch.float32)
    with _expert_choices(imposed, imposed=cpu_choices):
        _, hiddens, state = _run(model_dir, "cuda", dtype)
    for i, (h, ref) in enumerate(zip(hiddens, ref_hiddens)):
        assert relative_error(h, ref) < tol, f"step {i} hidden"
    assert relative_error(state, ref_state) < tol, "ssm state after the last step"
    # choosing for itself: a row's expert set may differ where two sigmoid scores nearly tie
    with _expert_choices(own):
        _run(model_dir, "cuda", dtype)
    pairs = [(set(a.tolist()), set(b.tolist())) for (ids, _), (ref_ids, _) in zip(own, cpu_choices, strict=True)
             for a, b in zip(ids, ref_ids, strict=True)]
    agreeing = sum(a == b for a, b in pairs)
    assert agreeing >= 0.9 * len(pairs), f"the GPU chose the CPU's experts for {agreeing} of {len(pairs)} rows"
