"""skinny_linear (engine/kernels/gpu/skinny_gemm.py) against its reference, F.linear computed in
fp32 from the same inputs: fresh random inputs, one row of x, the output poisoned (NaN) before
each run.

Under Triton's interpreter (TRITON_INTERPRET=1) the fp32 cases run: a small explicit config on
shapes where N is not a multiple of BLOCK_N and K not a multiple of BLOCK_K, every tuned config
on one such shape, and a call without a config (the interpreter's fallback to the first one).
On a GPU the same cases run in bf16 and fp16 too, and the autotuned kernel runs on the shapes
the engine sends it and inside a CUDA graph. The kernel module is imported inside the tests: it
needs triton, which the CPU-only suite does not install.
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
# output; N = SKINNY_MAX_FEATURES; and a ragged one.
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
