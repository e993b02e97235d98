"""skinny_linear (engine/kernels/gpu/skinny_gemm.py) against its reference, F.linear computed in
fp32 from the same inputs: fresh random inputs, one row of x, the output poisoned (NaN) before
each run.

Under Triton's interpreter (TRITON_INTERPRET=1) the fp32 cases run: a small explicit config on
shapes where N is not a multiple of BLOCK_N and K not a multiple of BLOCK_K, every tuned config
on one such shape, and a call without a config (the interpreter's fallback to the first one).
On a GPU the same cases run in bf16 and fp16 too, and the autotuned kernel runs on the shapes
the engine sends it and inside a CUDA graph. The kernel module is imported inside the tests: it
needs triton, which the CPU-only suite does not install.

The gated variant (x = [gate | up], silu(gate) * up computed as x is loaded) is compared with
F.linear in fp32 after norm_reference.silu_and_mul, and bit for bit with skinny_linear after
activation.silu_and_mul under the same config: the same roundings and the same accumulation
order. It runs in fp16 under the interpreter too (numpy's float16 rounds as the GPU does), so
the rounding of silu to the dtype is checked without a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.conftest import INTERPRETED, needs_device, relative_error

pytestmark = [pytest.mark.gpu, needs_device]

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
on_gpu_only = pytest.mark.skipif(INTERPRETED, reason="needs a CUDA device (autotuning, graphs, bf16/fp16)")
GPU_DTYPES = [
    torch.float32,
    pytest.param(torch.bfloat16, marks=on_gpu_only),
    pytest.param(torch.float16, marks=on_gpu_only),
]
# (N, K) for BLOCK_N = 16, BLOCK_K = 32: N % 16 != 0 and K % 32 != 0 (K = 33 also breaks 16-byte
# alignment of x's and weight's rows); (16, 64) divides evenly.
SMALL_SHAPES = [(40, 100), (72, 33), (16, 64)]
# The (N, K) the engine sends here on the 1.5B model: attention k/v and q/o, Mamba out_proj, MLP
# output; a 4,096-feature shape (a width no linear of the model has); and a ragged one.
MODEL_SHAPES = [(512, 2048), (2048, 2048), (2048, 4096), (2048, 5632), (4096, 2048), (1000, 1000)]


def _operands(features: int, depth: int, with_bias: bool, dtype: torch.dtype, device, seed: int):
    """Random x (1, depth), weight (features, depth), bias (features,) or None, and a NaN-filled
    out (1, features)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(1, depth, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(features, depth, generator=g) / depth**0.5).to(device=device, dtype=dtype)
    bias = torch.randn(features, generator=g).to(device=device, dtype=dtype) if with_bias else None
    out = torch.full((1, features), float("nan"), dtype=dtype, device=device)
    return x, weight, bias, out


def _gated_operands(features: int, depth: int, with_bias: bool, dtype: torch.dtype, device, seed: int):
    """Random gate_up (1, 2 depth) = [gate | up] at the scale of an MLP's pre-activations,
    weight (features, depth), bias (features,) or None, and a NaN-filled out (1, features)."""
    g = torch.Generator(device="cpu").manual_seed(1000 + seed)
    gate_up = (2 * torch.randn(1, 2 * depth, generator=g)).to(device=device, dtype=dtype)
    _, weight, bias, out = _operands(features, depth, with_bias, dtype, device, seed)
    return gate_up, weight, bias, out


def _gated_reference(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in fp32 after norm_reference.silu_and_mul in gate_up's dtype (the activation the
    unfused path feeds the GEMM)."""
    from engine.kernels.norm_reference import silu_and_mul

    return _reference(silu_and_mul(gate_up), weight, bias)


def _unfused(gate_up, weight, bias, config):
    """What the fused launch replaces: activation.silu_and_mul, then skinny_linear."""
    from engine.kernels.gpu.activation import silu_and_mul
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    return skinny_linear(silu_and_mul(gate_up), weight, bias, config=config)


def _small_config():
    from engine.kernels.gpu.skinny_gemm import SkinnyConfig

    return SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in fp32 on the same (rounded) inputs."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("features,depth", SMALL_SHAPES)
def test_small_shapes_explicit_config(device, features, depth, with_bias, dtype):
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    x, weight, bias, out = _operands(features, depth, with_bias, dtype, device, seed=features + depth)
    got = skinny_linear(x, weight, bias, out=out, config=_small_config())
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    assert relative_error(got, _reference(x, weight, bias)) < TOL[dtype]


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("index", range(6))
def test_each_tuned_config(device, index, dtype):
    """Every config the autotuner may pick, on N = 40 (not a multiple of 16 or 32) and
    K = 1100 (not a multiple of 256, 512 or 1024), with a bias."""
    from engine.kernels.gpu.skinny_gemm import CONFIGS, skinny_linear

    assert len(CONFIGS) == 6
    x, weight, bias, out = _operands(40, 1100, True, dtype, device, seed=index)
    got = skinny_linear(x, weight, bias, out=out, config=CONFIGS[index])
    assert relative_error(got, _reference(x, weight, bias)) < TOL[dtype]


@on_gpu_only
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("features,depth", [(2048, 300), (64, 700), (40, 1100), (24, 1900), (40, 2600)])
def test_preloaded_tiles_give_the_same_bits(device, features, depth, gated, monkeypatch):
    """Under PDL the first PRELOAD_TILES weight tiles are loaded before the wait and
    accumulated ahead of the loop: the same products in the same order as without them, so
    the output is bitwise the same for 0 to 4 tiles, and right. BLOCK_K is 512 here: K ends
    in the first tile (the others all masked), the second, the third, the fourth, or runs on
    into the loop."""
    from engine.kernels.gpu import pdl, skinny_gemm

    if not pdl.enabled():
        pytest.skip("PDL is off on this device: the preload is not compiled in")
    make = _gated_operands if gated else _operands
    x, weight, bias, _ = make(features, depth, True, torch.bfloat16, device, seed=7)
    config = skinny_gemm.CONFIGS[0]
    assert config.block_k == 512
    outs = []
    for tiles in range(5):
        monkeypatch.setattr(skinny_gemm, "PRELOAD_TILES", tiles)
        outs.append(skinny_gemm.skinny_linear(x, weight, bias, gated=gated, config=config))
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    if not gated:
        assert relative_error(outs[-1], _reference(x, weight, bias)) < TOL[torch.bfloat16]


def test_default_call_allocates_out(device):
    """No config (autotuned on a GPU, CONFIGS[0] under the interpreter) and no out."""
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    x, weight, bias, _ = _operands(40, 1100, True, torch.float32, device, seed=5)
    got = skinny_linear(x, weight, bias)
    assert got.shape == (1, 40) and got.is_contiguous() and got.dtype == torch.float32
    assert relative_error(got, _reference(x, weight, bias)) < TOL[torch.float32]


def test_strided_x(device):
    """x a column slice of a wider row (x.stride(0) > K), as a split projection output is."""
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    x_wide, weight, bias, out = _operands(40, 160, True, torch.float32, device, seed=7)
    x = x_wide[:, 30:130]  # (1, 100)
    weight = weight[:, :100].contiguous()
    got = skinny_linear(x, weight, bias, out=out, config=_small_config())
    assert relative_error(got, _reference(x, weight, bias)) < TOL[torch.float32]


@on_gpu_only
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("features,depth", MODEL_SHAPES)
def test_autotuned_model_shapes(device, features, depth, with_bias):
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    x, weight, bias, out = _operands(features, depth, with_bias, torch.bfloat16, device, seed=features + depth)
    got = skinny_linear(x, weight, bias, out=out)
    assert relative_error(got, _reference(x, weight, bias)) < TOL[torch.bfloat16]


@on_gpu_only
def test_cuda_graph_replay(device):
    """Tuned eagerly, captured, then replayed on new x: the graph reads x and writes out by
    address; capture fails on a host synchronisation."""
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    x, weight, bias, out = _operands(2048, 4096, True, torch.bfloat16, device, seed=12)
    skinny_linear(x, weight, bias, out=out)  # autotunes, outside the capture
    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        skinny_linear(x, weight, bias, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(x, weight, bias, out=out)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, _reference(x, weight, bias)) < TOL[torch.bfloat16]


def test_supports_and_layout_checks(device):
    from engine.kernels.gpu.skinny_gemm import layout_problem, skinny_linear, supports

    x = torch.randn(1, 64, device=device)
    weight = torch.randn(32, 64, device=device)
    assert layout_problem(x, weight, torch.randn(32, device=device)) is None
    assert supports(x, weight) == (device.type == "cuda")
    rejected = {
        "2 rows": (torch.randn(2, 64, device=device), weight, None),
        "no rows": (torch.randn(0, 64, device=device), weight, None),
        "1-D x": (torch.randn(64, device=device), weight, None),
        "non-contiguous weight": (x, torch.randn(64, 32, device=device).t(), None),
        "strided K": (torch.randn(1, 128, device=device)[:, ::2], weight, None),
        "dtype mismatch": (x, weight.double(), None),
        "integer dtype": (x.int(), weight.int(), None),
        "K mismatch": (x, torch.randn(32, 63, device=device), None),
        "bias shape": (x, weight, torch.randn(31, device=device)),
        "bias dtype": (x, weight, torch.randn(32, device=device, dtype=torch.float16)),
        "strided bias": (x, weight, torch.randn(64, device=device)[::2]),
    }
    for name, (a, w, b) in rejected.items():
        assert layout_problem(a, w, b) is not None, name
        assert not supports(a, w, b), name
    with pytest.raises(AssertionError, match="one row"):
        skinny_linear(torch.randn(2, 64, device=device), weight)
    with pytest.raises(AssertionError, match="out must be"):
        skinny_linear(x, weight, out=torch.empty(2, 32, device=device))


# fp16 also in the interpreter: numpy's float16 rounds to nearest even, as the GPU does (bf16
# there differs from torch's rounding by an ulp, so it stays on the GPU).
GATED_DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=on_gpu_only),
]


@pytest.mark.parametrize("dtype", GATED_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("features,depth", SMALL_SHAPES)
def test_gated_small_shapes_explicit_config(device, features, depth, with_bias, dtype):
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    gate_up, weight, bias, out = _gated_operands(features, depth, with_bias, dtype, device, seed=features + depth)
    got = skinny_linear(gate_up, weight, bias, gated=True, out=out, config=_small_config())
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    assert relative_error(got, _gated_reference(gate_up, weight, bias)) < TOL[dtype]
    assert torch.equal(got, _unfused(gate_up, weight, bias, _small_config()))


@pytest.mark.parametrize("dtype", GATED_DTYPES)
@pytest.mark.parametrize("index", range(6))
def test_gated_each_tuned_config(device, index, dtype):
    """Every config on N = 40, K = 1100 (K not a multiple of any BLOCK_K), with a bias."""
    from engine.kernels.gpu.skinny_gemm import CONFIGS, skinny_linear

    gate_up, weight, bias, out = _gated_operands(40, 1100, True, dtype, device, seed=index)
    got = skinny_linear(gate_up, weight, bias, gated=True, out=out, config=CONFIGS[index])
    assert relative_error(got, _gated_reference(gate_up, weight, bias)) < TOL[dtype]
    assert torch.equal(got, _unfused(gate_up, weight, bias, CONFIGS[index]))


def test_gated_default_call_and_strided_row(device):
    """No config and no out; gate_up a column slice of a wider row (row stride > 2K)."""
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    wide, weight, bias, _ = _gated_operands(40, 150, True, torch.float32, device, seed=9)
    gate_up = wide[:, 50:250]  # (1, 200) = [gate | up] of K = 100
    weight = weight[:, :100].contiguous()
    got = skinny_linear(gate_up, weight, bias, gated=True)
    assert got.shape == (1, 40) and got.is_contiguous() and got.dtype == torch.float32
    assert relative_error(got, _gated_reference(gate_up, weight, bias)) < TOL[torch.float32]


@on_gpu_only
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("features,depth", [(2048, 5632), (2048, 2048), (1000, 1000)])
def test_gated_autotuned_model_shapes(device, features, depth, with_bias):
    """The MLP output shape of the 1.5B model and two others, autotuned on their own: the
    tuner's cache holds separate entries for the plain and the gated kernel at (N, K). Not
    bitwise against the unfused path: the two may be tuned to different configs."""
    from engine.kernels.gpu.skinny_gemm import _tuned_row_kernel, skinny_linear

    gate_up, weight, bias, out = _gated_operands(features, depth, with_bias, torch.bfloat16, device, seed=depth)
    skinny_linear(gate_up[:, :depth], weight, bias)  # the plain kernel at the same (N, K)
    got = skinny_linear(gate_up, weight, bias, gated=True, out=out)
    assert relative_error(got, _gated_reference(gate_up, weight, bias)) < TOL[torch.bfloat16]
    gated_keys = {key[2] for key in _tuned_row_kernel.cache if tuple(key[:2]) == (features, depth)}
    assert gated_keys == {False, True}


@on_gpu_only
def test_gated_cuda_graph_replay(device):
    """As test_cuda_graph_replay, for the gated kernel at the MLP output shape."""
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    gate_up, weight, bias, out = _gated_operands(2048, 5632, False, torch.bfloat16, device, seed=13)
    skinny_linear(gate_up, weight, bias, gated=True, out=out)  # autotunes, outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        skinny_linear(gate_up, weight, bias, gated=True, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(gate_up, weight, bias, gated=True, out=out)
    gate_up.copy_(2 * torch.randn_like(gate_up))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, _gated_reference(gate_up, weight, bias)) < TOL[torch.bfloat16]


def test_gated_layout_checks(device):
    from engine.kernels.gpu.skinny_gemm import layout_problem, skinny_linear, supports

    gate_up = torch.randn(1, 128, device=device)
    weight = torch.randn(32, 64, device=device)
    assert layout_problem(gate_up, weight, torch.randn(32, device=device), gated=True) is None
    assert supports(gate_up, weight, gated=True) == (device.type == "cuda")
    assert layout_problem(gate_up, weight) is not None  # 2K columns are not K
    rejected = {
        "K columns": torch.randn(1, 64, device=device),
        "2K + 1 columns": torch.randn(1, 129, device=device),
        "2 rows": torch.randn(2, 128, device=device),
        "strided row": torch.randn(1, 256, device=device)[:, ::2],
    }
    for name, a in rejected.items():
        assert layout_problem(a, weight, gated=True) is not None, name
        assert not supports(a, weight, gated=True), name
    with pytest.raises(AssertionError, match="2K"):
        skinny_linear(torch.randn(1, 64, device=device), weight, gated=True)


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("features,depth", SMALL_SHAPES)
def test_row_rms_scales_the_output(device, features, depth, with_bias, dtype):
    """row_rms (the folded RMS norm): F.linear(x, weight) * rsqrt(sum(sum_squares) / K + eps)
    + bias, against that computed in fp32 (fp64 for the scale). 37 pieces of the sum of
    squares: not a power of two, so the pieces' mask is exercised."""
    from engine.kernels.gpu.skinny_gemm import RowRms, skinny_linear

    x, weight, bias, out = _operands(features, depth, with_bias, dtype, device, seed=11)
    sum_squares = torch.rand(37, generator=torch.Generator().manual_seed(12)).to(device) * 3 * depth / 37
    eps = 1e-5
    got = skinny_linear(x, weight, bias, out=out, config=_small_config(), row_rms=RowRms(sum_squares, eps))
    scale = float(torch.rsqrt(sum_squares.double().sum() / depth + eps))
    want = F.linear(x.float(), weight.float()) * scale
    if bias is not None:
        want += bias.float()
    assert relative_error(got, want) < TOL[dtype]
    plain = skinny_linear(x, weight, None, config=_small_config())
    assert relative_error(got, want) < relative_error(plain, want) / 10, "the scale was not applied"
