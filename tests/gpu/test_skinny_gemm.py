"""skinny_linear (engine/kernels/gpu/skinny_gemm.py) against its reference, F.linear computed in
fp32 from the same inputs: fresh random inputs, the output poisoned (NaN) before each run.

Under Triton's interpreter (TRITON_INTERPRET=1) only the fp32 cases with explicit small configs
run: shapes chosen so that N is not a multiple of BLOCK_N, K not a multiple of BLOCK_K, and one
split of K gets no tiles. On a GPU the same cases run in bf16 and fp16 too, and the autotuned
configs run on the model's shapes, with split-K, and inside a CUDA graph. The kernel module is imported
inside the tests: it needs triton, which the CPU-only suite does not install.
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
# (N, K): N % 16 != 0 and K % 32 != 0 (K = 100: 4 K tiles, so 3 splits get 2, 2 and 0 tiles),
# K = 33 also breaks 16-byte alignment of x's and weight's rows; (16, 64) divides evenly.
SMALL_SHAPES = [(40, 100), (72, 33), (16, 64)]
# The model's (N, K): Mamba out_proj, attention k/v, Mamba in_proj; and a ragged one.
MODEL_SHAPES = [(2048, 4096), (512, 2048), (8512, 2048), (1000, 1000)]


def _operands(rows: int, features: int, depth: int, with_bias: bool, dtype: torch.dtype, device, seed: int):
    """Random x (rows, depth), weight (features, depth), bias (features,) or None, and a
    NaN-filled out (rows, features)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, depth, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(features, depth, generator=g) / depth**0.5).to(device=device, dtype=dtype)
    bias = torch.randn(features, generator=g).to(device=device, dtype=dtype) if with_bias else None
    out = torch.full((rows, features), float("nan"), dtype=dtype, device=device)
    return x, weight, bias, out


def _small_config():
    """BLOCK_N = 16 and BLOCK_K = 32 on both paths (the tile path needs 16 or more on each)."""
    from engine.kernels.gpu.skinny_gemm import SkinnyConfig

    return SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in fp32 on the same (rounded) inputs."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("features,depth", SMALL_SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_small_shapes_explicit_config(device, rows, features, depth, with_bias, split_k, dtype):
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    x, weight, bias, out = _operands(rows, features, depth, with_bias, dtype, device, seed=rows * 1000 + depth)
    got = skinny_linear(x, weight, bias, out=out, split_k=split_k, config=_small_config())
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    assert relative_error(got, _reference(x, weight, bias)) < TOL[dtype]


@pytest.mark.parametrize("rows", [1, 3])
def test_strided_x_rows(device, rows):
    """x a column slice of a wider tensor (row stride > K), as a split projection output is."""
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    x_wide, weight, bias, out = _operands(rows, 40, 160, True, torch.float32, device, seed=7)
    x = x_wide[:, 30:130]  # (rows, 100), row stride 160
    weight = weight[:, :100].contiguous()
    got = skinny_linear(x, weight, bias, out=out, config=_small_config())
    assert relative_error(got, _reference(x, weight, bias)) < TOL[torch.float32]


@on_gpu_only
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("features,depth", MODEL_SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_autotuned_model_shapes(device, rows, features, depth, split_k):
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    x, weight, _, out = _operands(rows, features, depth, False, torch.bfloat16, device, seed=features + rows)
    got = skinny_linear(x, weight, out=out, split_k=split_k)
    assert relative_error(got, _reference(x, weight, None)) < TOL[torch.bfloat16]


@on_gpu_only
@pytest.mark.parametrize("rows", [1, 16])
def test_autotuned_with_bias(device, rows):
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    x, weight, bias, out = _operands(rows, 2048, 2048, True, torch.bfloat16, device, seed=11)
    got = skinny_linear(x, weight, bias, out=out)
    assert relative_error(got, _reference(x, weight, bias)) < TOL[torch.bfloat16]


@on_gpu_only
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("rows", [1, 16])
def test_cuda_graph_replay(device, rows, split_k):
    """Tuned eagerly, captured, then replayed on new x: the graph reads x and writes out by
    address; capture fails on a host synchronisation, and what a call allocates (split-K
    partials) comes from the graph's pool."""
    from engine.kernels.gpu.skinny_gemm import skinny_linear

    x, weight, bias, out = _operands(rows, 2048, 4096, True, torch.bfloat16, device, seed=12)
    skinny_linear(x, weight, bias, out=out, split_k=split_k)  # autotunes, outside the capture
    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        skinny_linear(x, weight, bias, out=out, split_k=split_k)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(x, weight, bias, out=out, split_k=split_k)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, _reference(x, weight, bias)) < TOL[torch.bfloat16]


def test_supports_and_layout_checks(device):
    from engine.kernels.gpu.skinny_gemm import layout_problem, skinny_linear, supports

    x = torch.randn(4, 64, device=device)
    weight = torch.randn(32, 64, device=device)
    assert layout_problem(x, weight, torch.randn(32, device=device)) is None
    assert supports(x, weight) == (device.type == "cuda")
    rejected = {
        "17 rows": (torch.randn(17, 64, device=device), weight, None),
        "non-contiguous weight": (x, torch.randn(64, 32, device=device).t(), None),
        "strided K": (torch.randn(4, 128, device=device)[:, ::2], weight, None),
        "dtype mismatch": (x, weight.double(), None),
        "integer dtype": (x.int(), weight.int(), None),
        "K mismatch": (x, torch.randn(32, 63, device=device), None),
        "bias shape": (x, weight, torch.randn(31, device=device)),
        "bias dtype": (x, weight, torch.randn(32, device=device, dtype=torch.float16)),
    }
    for name, (a, w, b) in rejected.items():
        assert layout_problem(a, w, b) is not None, name
        assert not supports(a, w, b), name
    with pytest.raises(AssertionError, match="rows"):
        skinny_linear(torch.randn(17, 64, device=device), weight)
