"""skinny_linear_normed (engine/kernels/gpu/norm_gemv.py): the single-row GEMM with an RMS-norm
prologue, against the unfused pair it replaces (fused_norm's kernel, then skinny_linear under
the same config) and against the PyTorch references (norm_reference, then F.linear in fp32).

Outputs and residual_out are poisoned (NaN) before every run. Under Triton's interpreter the
fp32 and fp16 cases run (numpy's float16 rounds as the GPU does; its bfloat16 is an ulp off
torch's, so bf16 runs on a GPU only): ragged shapes (N not a multiple of BLOCK_N, K not of
BLOCK_K, group sizes and head dims not powers of two), every tuned config, bias and no bias,
a residual update and none (layer 0); there the fused result equals the unfused pair bit for
bit (_check_against_pair). On a GPU (within PAIR_TOL) bf16 too, and the autotuner's separate entries
per prologue.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import norm_reference
from engine.kernels.pending_norm import PendingGatedNorm, PendingRmsNorm
from engine.layers.norm import with_head_skip
from tests.gpu.conftest import INTERPRETED, needs_device, relative_error

pytestmark = [pytest.mark.gpu, needs_device]

on_gpu_only = pytest.mark.skipif(INTERPRETED, reason="needs a CUDA device (autotuning, bf16)")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=on_gpu_only)]
# against the references (fp32 GEMM of the reference's rounded x)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# against the unfused pair: only the mean square's summation order differs
PAIR_TOL = {torch.float32: 1e-6, torch.bfloat16: 5e-3, torch.float16: 1e-3}
EPS = 1e-5
MULTIPLIER = 0.22


def _small_config():
    from engine.kernels.gpu.skinny_gemm import SkinnyConfig

    return SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)


def _random(g, *shape, scale=1.0):
    return scale * torch.randn(*shape, generator=g)


def _linear_operands(g, features, depth, with_bias, dtype, device):
    weight = (_random(g, features, depth) / depth**0.5).to(device, dtype)
    bias = _random(g, features).to(device, dtype) if with_bias else None
    out = torch.full((1, features), float("nan"), dtype=dtype, device=device)
    return weight, bias, out


def _rms_case(features, depth, with_delta, with_bias, dtype, device, seed):
    """A PendingRmsNorm (residual_out NaN-filled), weight, bias, NaN-filled out."""
    g = torch.Generator().manual_seed(seed)
    hidden = _random(g, 1, depth, scale=3.0).to(device, dtype)
    delta = _random(g, 1, depth, scale=5.0).to(device, dtype) if with_delta else None
    norm_weight = (1 + 0.3 * _random(g, depth)).to(device, dtype)
    norm = PendingRmsNorm.allocate(hidden, delta, MULTIPLIER, norm_weight, EPS)
    if norm.residual_out is not None:
        norm.residual_out.fill_(float("nan"))
    return (norm, *_linear_operands(g, features, depth, with_bias, dtype, device))


def _rms_unfused(norm: PendingRmsNorm, weight, bias, config):
    """What the fused launch replaces: fused_norm.add_rms_norm, then skinny_linear."""
    from engine.kernels.gpu.fused_norm import add_rms_norm
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    residual, normed = add_rms_norm(norm.hidden, norm.delta, norm.multiplier, norm.weight, norm.eps)
    return residual, skinny_linear(normed, weight, bias, config=config)


def _rms_reference(norm: PendingRmsNorm, weight, bias):
    residual, normed = norm_reference.add_rms_norm(norm.hidden, norm.delta, norm.multiplier, norm.weight, norm.eps)
    return residual, F.linear(normed.float(), weight.float(), None if bias is None else bias.float())


def _check_against_pair(got, pair, dtype):
    """Within PAIR_TOL; under the interpreter bit for bit: its reductions are numpy's over
    arrays of the same power-of-two width in both kernels, so the mean squares agree and any
    dropped or added rounding shows."""
    assert relative_error(got, pair) < PAIR_TOL[dtype]
    if INTERPRETED:
        assert torch.equal(got, pair)


def _check_rms(norm, weight, bias, out, config, dtype):
    from engine.kernels.gpu.norm_gemv import skinny_linear_normed

    got = skinny_linear_normed(norm, weight, bias, out=out, config=config)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    pair_residual, pair = _rms_unfused(norm, weight, bias, config)
    ref_residual, ref = _rms_reference(norm, weight, bias)
    _check_against_pair(got, pair, dtype)
    assert relative_error(got, ref) < TOL[dtype]
    if norm.delta is None:
        assert norm.new_hidden is norm.hidden
    else:  # the same roundings, elementwise: equal to both
        assert torch.equal(norm.residual_out, pair_residual)
        assert torch.equal(norm.residual_out, ref_residual) or dtype == torch.bfloat16
        assert relative_error(norm.residual_out, ref_residual) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("features,depth", [(40, 100), (72, 33), (16, 64)])
def test_add_rms_norm_prologue_small_shapes(device, features, depth, with_delta, with_bias, dtype):
    case = _rms_case(features, depth, with_delta, with_bias, dtype, device, seed=features + depth)
    _check_rms(*case, _small_config(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", range(6))
def test_add_rms_norm_prologue_each_tuned_config(device, index, dtype):
    """N = 40, K = 1100 (a multiple of no BLOCK_K nor a power of two), with delta and bias."""
    from engine.kernels.gpu.skinny_gemm import CONFIGS

    case = _rms_case(40, 1100, True, True, dtype, device, seed=index)
    _check_rms(*case, CONFIGS[index], dtype)


def _gated_case(features, channels, group_size, heads, with_bias, dtype, device, seed):
    """A PendingGatedNorm whose gate and skip_x are column slices of wider rows (as the
    in_proj and conv outputs are), weight, bias, NaN-filled out."""
    g = torch.Generator().manual_seed(100 + seed)
    y = _random(g, 1, channels, scale=2.0).to(device)
    projected = _random(g, 1, channels + 37, scale=2.0).to(device, dtype)
    conv_out = _random(g, 1, channels + 11).to(device, dtype)
    D = _random(g, heads).to(device)
    norm_weight = (1 + 0.3 * _random(g, channels)).to(device, dtype)
    norm = PendingGatedNorm(
        y, projected[:, 5 : 5 + channels], conv_out[:, :channels], D, norm_weight, group_size, EPS, dtype
    )
    return (norm, *_linear_operands(g, features, channels, with_bias, dtype, device))


def _check_gated(norm: PendingGatedNorm, weight, bias, out, config, dtype):
    from engine.kernels.gpu.fused_norm import gated_rms_norm
    from engine.kernels.gpu.norm_gemv import skinny_linear_normed
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    got = skinny_linear_normed(norm, weight, bias, out=out, config=config)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    normed = gated_rms_norm(norm.y, norm.gate, norm.weight, norm.group_size, norm.eps, dtype,
                            skip=(norm.skip_x, norm.D))
    pair = skinny_linear(normed, weight, bias, config=config)
    ref = _gated_reference(norm, weight, bias)
    _check_against_pair(got, pair, dtype)
    assert relative_error(got, ref) < TOL[dtype]


# (N, I, group size, heads): several groups and heads, group size and head dim not powers of
# two, one group, a group smaller than a BLOCK_K of 32, several groups per K step.
GATED_SHAPES = [(40, 96, 32, 6), (72, 150, 50, 6), (16, 64, 64, 2), (24, 120, 20, 5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("features,channels,group_size,heads", GATED_SHAPES)
def test_gated_norm_prologue_small_shapes(device, features, channels, group_size, heads, with_bias, dtype):
    case = _gated_case(features, channels, group_size, heads, with_bias, dtype, device, seed=channels)
    _check_gated(*case, _small_config(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", range(6))
def test_gated_norm_prologue_each_tuned_config(device, index, dtype):
    """N = 40, I = 1100 in 4 groups of 275 and 11 heads of 100 channels, with a bias."""
    from engine.kernels.gpu.skinny_gemm import CONFIGS

    case = _gated_case(40, 1100, 275, 11, True, dtype, device, seed=index)
    _check_gated(*case, CONFIGS[index], dtype)


def test_default_calls_allocate_out(device):
    """No config (autotuned on a GPU, CONFIGS[0] under the interpreter) and no out."""
    from engine.kernels.gpu.norm_gemv import skinny_linear_normed

    norm, weight, bias, _ = _rms_case(40, 100, True, True, torch.float32, device, seed=1)
    got = skinny_linear_normed(norm, weight, bias)
    assert got.shape == (1, 40) and got.is_contiguous()
    assert relative_error(got, _rms_reference(norm, weight, bias)[1]) < TOL[torch.float32]
    gated, weight, bias, _ = _gated_case(40, 96, 32, 6, False, torch.float32, device, seed=2)
    got = skinny_linear_normed(gated, weight, bias)
    assert got.shape == (1, 40) and got.is_contiguous()


def test_normed_layout_checks(device):
    from engine.kernels.gpu.norm_gemv import normed_layout_problem, skinny_linear_normed

    norm, weight, bias, _ = _rms_case(40, 64, True, True, torch.float32, device, seed=3)
    assert normed_layout_problem(norm, weight, bias) is None
    rms_rejected = {
        "residual_out is hidden": PendingRmsNorm(norm.hidden, norm.delta, 1.0, norm.weight, EPS, norm.hidden),
        "residual_out overlaps delta": PendingRmsNorm(
            norm.hidden, norm.delta, 1.0, norm.weight, EPS, norm.delta.view(1, 64)),
        "two rows": PendingRmsNorm.allocate(torch.randn(2, 64, device=device), None, 1.0, norm.weight, EPS),
        "half delta": PendingRmsNorm.allocate(norm.hidden, norm.delta.half(), 1.0, norm.weight, EPS),
        "short norm weight": PendingRmsNorm.allocate(norm.hidden, None, 1.0, norm.weight[:32], EPS),
        "strided hidden": PendingRmsNorm.allocate(torch.randn(1, 128, device=device)[:, ::2], None, 1.0,
                                                  norm.weight, EPS),
    }
    for name, bad in rms_rejected.items():
        assert normed_layout_problem(bad, weight, bias) is not None, name
    assert normed_layout_problem(norm, torch.randn(40, 9000, device=device)) is not None  # too wide
    with pytest.raises(AssertionError, match="overlaps"):
        skinny_linear_normed(rms_rejected["residual_out is hidden"], weight)

    gated, weight, bias, _ = _gated_case(40, 96, 32, 6, True, torch.float32, device, seed=4)
    assert normed_layout_problem(gated, weight, bias) is None
    replace = lambda **kw: PendingGatedNorm(**{**gated.__dict__, **kw})  # noqa: E731
    gated_rejected = {
        "group size not dividing": replace(group_size=40),
        "heads not dividing": replace(D=torch.randn(5, device=device)),
        "fp16 D": replace(D=gated.D.half()),
        "y not fp32": replace(y=gated.y.half()),
        "out dtype not weight's": replace(out_dtype=torch.float16),
        "strided gate": replace(gate=torch.randn(1, 192, device=device)[:, ::2]),
    }
    for name, bad in gated_rejected.items():
        assert normed_layout_problem(bad, weight, bias) is not None, name


@on_gpu_only
@pytest.mark.parametrize("features,depth", [(8512, 2048), (11264, 2048), (2048, 4096)])
def test_autotuned_model_shapes_tune_each_prologue(device, features, depth):
    """bf16, autotuned, at the 1.5B model's in_proj and MLP input (N 8512 and 11264, K 2048)
    and out_proj (N 2048, K 4096); each shape runs the plain kernel and both norm prologues
    (the gated one as one group of K channels, 64 heads) and the tuner keeps an entry per
    prologue at (N, K)."""
    from engine.kernels.gpu.norm_gemv import skinny_linear_normed
    from engine.kernels.gpu.skinny_gemm import ADD_RMS_NORM, GATED_NORM, PLAIN, _tuned_row_kernel, skinny_linear

    dtype = torch.bfloat16
    norm, weight, bias, out = _rms_case(features, depth, True, False, dtype, device, seed=depth)
    skinny_linear(norm.hidden, weight)  # the plain kernel at the same (N, K)
    got = skinny_linear_normed(norm, weight, out=out)
    assert relative_error(got, _rms_reference(norm, weight, None)[1]) < TOL[dtype]
    gated, weight, _, out = _gated_case(features, depth, depth, 64, False, dtype, device, seed=depth)
    got = skinny_linear_normed(gated, weight, out=out)
    assert relative_error(got, _gated_reference(gated, weight)) < TOL[dtype]
    prologues = {key[2] for key in _tuned_row_kernel.cache if tuple(key[:2]) == (features, depth)}
    assert {PLAIN.value, ADD_RMS_NORM.value, GATED_NORM.value} <= prologues


def _gated_reference(gated: PendingGatedNorm, weight, bias=None):
    """norm_reference.gated_rms_norm of y + D * skip_x (layers.norm.with_head_skip), rounded to
    out_dtype, then F.linear in fp32."""
    normed = norm_reference.gated_rms_norm(
        with_head_skip(gated.y, gated.skip_x, gated.D), gated.gate, gated.weight, gated.group_size,
        gated.eps, gated.out_dtype,
    )
    return F.linear(normed.float(), weight.float(), None if bias is None else bias.float())
