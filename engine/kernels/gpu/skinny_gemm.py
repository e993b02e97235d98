"""Skinny GEMM on the GPU: F.linear for a handful of rows, at the rate the weights stream from HBM.

`skinny_linear(x, weight, bias)` computes F.linear(x, weight, bias) = x @ weight.T + bias for
x (M, K) with 1 <= M <= 16, weight (N, K) in nn.Linear's layout (contiguous, K fastest), bias
(N,); fp32 accumulation, output (M, N) contiguous in x's dtype. F.linear itself is the reference
(there is no separate *_reference.py): the device test compares against it computed in fp32.

When it is used: decode steps, where every linear layer sees one row per sequence. There the
GEMM does ~M multiply-adds per weight element loaded, far below what a GPU computes per byte,
so its time is the time to read the weight once; nothing else matters. cuBLAS reaches about
57-74% of copy bandwidth on these shapes (split-K reduce kernels and small grids); this kernel
aims at the copy rate. `supports(x, weight, bias)` says when it applies; otherwise fall back to
F.linear. The engine uses it for single rows with at most 4,096 output features, where
it beat cuBLAS on the H200 (engine/layers/parallel_linear.py:linear says why).

Design (every weight byte is read exactly once, in wide loads along K):
- one program owns BLOCK_N output features (weight rows) and all M rows of x, and walks K in
  BLOCK_K steps; each step loads a (BLOCK_N, BLOCK_K) weight tile, BLOCK_K * 2 contiguous bytes
  per row, so the loads are coalesced and vectorised (16-byte accesses when K % 16 == 0, which
  Triton specialises on), and pipelined num_stages deep through shared memory (cp.async);
- M == 1, the vector path: weight tile times the x slice broadcast over the rows, accumulated
  elementwise in an fp32 (BLOCK_N, BLOCK_K) register tile and summed over K once at the end
  (no reduction per step). CUDA cores suffice: one multiply-add per loaded element;
- 2 <= M <= 16, the tile path: tl.dot(weight tile, x tile transposed) on tensor cores, x padded
  to 16 rows with masked (never loaded) zeros: (BLOCK_N, BLOCK_K) @ (BLOCK_K, 16). At M = 16
  the multiply-adds per weight byte would keep CUDA cores as busy as the memory system;
- the grid is cdiv(N, BLOCK_N) programs, times split_k. Small BLOCK_N (down to 4 rows on the
  vector path, 16 on the tile path, where tl.dot needs 16) already gives 128-512 programs for
  the model's N = 2048 layers on 132 SMs, so split-K is off by default (split_k = 1): it would
  buy parallelism the grid already has and pay a second launch for it;
- split_k > 1 is there for shapes whose grid is too small (k/v projections at M > 1: 32 tiles
  of 16 rows). Each split writes fp32 partials (split_k, M, N) and a tiny kernel sums them in
  split order, adds the bias and casts. That costs one extra launch and split_k * M * N * 4
  bytes through L2; atomic adds into an fp32 buffer would cost two (zeroing the buffer before,
  casting to x's dtype after), contend on every output, and sum in a different order each run.
  benchmarks/skinny_gemm.py times split_k 1, 2 and 4 as whole operations (GEMM + reduce) so the
  choice rests on measurements, not on the tuner (which would time the GEMM launch alone);
- BLOCK_N, BLOCK_K, num_warps and num_stages are tuned with @triton.autotune over a short list
  per path, keyed on (M bucket, N, K, split_k) and the dtypes; M buckets are 1, 2, 4, 8, 16
  (next power of two). Tuning times each config with the L2 flushed (the weights of a decode
  step never fit in L2) and a short budget, so the model's ~7 shapes x 5 buckets tune in a few
  seconds plus compiling the twelve configs (about 0.3-1 s each, checked offline for sm90: no
  register spills, at most 100 KiB of shared memory per program in bf16).

Contracts for callers: no host synchronisation and no allocation that depends on data (the
output and, with split_k > 1, the partials are allocated from the shapes, or passed in), so a
call can be captured in a CUDA graph; but the first call for a new (M bucket, N, K, split_k,
dtype) autotunes, which synchronises, so make it eagerly before capture (as engine/cuda_graphs.py
does with its warm-up pass). Under Triton's interpreter (TRITON_INTERPRET=1, no timing) a call
without an explicit config uses the first config of its path.

Shapes: M rows of x (tokens), K input features, N output features.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # the tile path pads x to this many rows (tl.dot needs >= 16 on every dimension)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_REDUCE_BLOCK = 1024  # output features per program of the split-K reduce kernel


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration: tile sizes, warps per program, software-pipeline depth.

    num_stages goes to the K loop's tl.range (Triton pipelines a loop's loads through shared
    memory with cp.async only when they feed a tl.dot or the loop asks for stages explicitly;
    the vector path has no tl.dot) and to the launch options, where it means the same."""

    block_n: int  # weight rows (output features) per program
    block_k: int  # input features per loop step
    num_warps: int = 4
    num_stages: int = 3

    def as_triton(self) -> triton.Config:
        return triton.Config(
            {"BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "STAGES": self.num_stages},
            num_warps=self.num_warps, num_stages=self.num_stages,
        )


# M == 1. Weight bytes per program and loop step: block_n * block_k * 2 (bf16) = 8-16 KiB;
# (num_stages - 1) steps in flight. Small block_n: 256-512 programs for N = 2048.
VECTOR_CONFIGS = (
    SkinnyConfig(block_n=8, block_k=512, num_warps=4, num_stages=4),
    SkinnyConfig(block_n=4, block_k=1024, num_warps=4, num_stages=3),
    SkinnyConfig(block_n=16, block_k=256, num_warps=4, num_stages=4),
    SkinnyConfig(block_n=16, block_k=512, num_warps=8, num_stages=3),
    SkinnyConfig(block_n=8, block_k=1024, num_warps=8, num_stages=3),
    SkinnyConfig(block_n=32, block_k=256, num_warps=8, num_stages=3),
)
# 2 <= M <= 16. With 16 rows per program, N = 2048 gives one program per SM, which then needs
# ~40 KiB of weights in flight to cover the memory latency: deep pipelines (56-100 KiB of
# shared memory per program in bf16).
TILE_CONFIGS = (
    SkinnyConfig(block_n=16, block_k=512, num_warps=4, num_stages=4),
    SkinnyConfig(block_n=16, block_k=256, num_warps=4, num_stages=6),
    SkinnyConfig(block_n=16, block_k=128, num_warps=4, num_stages=8),
    SkinnyConfig(block_n=32, block_k=256, num_warps=4, num_stages=4),
    SkinnyConfig(block_n=32, block_k=128, num_warps=4, num_stages=6),
    SkinnyConfig(block_n=64, block_k=128, num_warps=4, num_stages=5),
)


def _tuning_bench(kernel_call, quantiles):
    """The autotuner's timer: triton.testing.do_bench (L2 flushed before each run) on a short
    budget, 2 ms of warm-up and 10 ms of timed runs per config."""
    return triton.testing.do_bench(kernel_call, warmup=2, rep=10, quantiles=quantiles)


@triton.jit
def _split_bounds(K, split_index, split_k, BLOCK_K: tl.constexpr):
    """[k_begin, k_end) of one split: whole BLOCK_K tiles, split_index-th share of them. The
    last split may be short, or empty when the tiles run out (it then contributes zeros)."""
    tiles_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), split_k)
    k_begin = split_index * tiles_per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + tiles_per_split * BLOCK_K)
    return k_begin, k_end


@triton.jit
def _write_result(
    acc,  # (BLOCK_N, M_TILE) fp32: y[batch, features] transposed
    features, batch, M, N, split_index, split_k,
    b_ptr, y_ptr, stride_ym, partial_ptr,
    HAS_BIAS: tl.constexpr,
):
    """One split: + bias, cast to y's dtype, store into y (M, N). Several: store the fp32
    partial into partial[split_index] (split_k, M, N); the reduce kernel finishes."""
    mask = (features < N)[:, None] & (batch < M)[None, :]
    if split_k == 1:
        if HAS_BIAS:
            bias = tl.load(b_ptr + features, mask=features < N, other=0.0)
            acc += bias.to(tl.float32)[:, None]
        y_ptrs = y_ptr + batch[None, :] * stride_ym + features[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        partial_ptrs = partial_ptr + (split_index * M + batch[None, :]) * N + features[:, None]
        tl.store(partial_ptrs, acc, mask=mask)


@triton.jit(do_not_specialize=["split_k"])
def _vector_kernel(
    x_ptr,  # (1, K), unit K stride
    w_ptr,  # (N, K) contiguous
    b_ptr,  # (N,) or a placeholder when HAS_BIAS is False
    y_ptr, stride_ym,  # (1, N)
    partial_ptr,  # (split_k, 1, N) fp32, or a placeholder when split_k == 1
    N, K, split_k,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):
    """M == 1: program (i, s) computes y[0, i*BLOCK_N : (i+1)*BLOCK_N] over split s of K."""
    split_index = tl.program_id(1)
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_ok = features < N
    w_rows = w_ptr + features.to(tl.int64)[:, None] * K
    offs_k = tl.arange(0, BLOCK_K)
    k_begin, k_end = _split_bounds(K, split_index, split_k, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        k_idx = k + offs_k
        k_ok = k_idx < K
        w = tl.load(w_rows + k_idx[None, :], mask=feature_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + k_idx, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)[:, None]  # (BLOCK_N, 1)
    _write_result(y, features, tl.arange(0, 1), 1, N, split_index, split_k,
                  b_ptr, y_ptr, stride_ym, partial_ptr, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "M_BUCKET", "split_k"])
def _tile_kernel(
    x_ptr, stride_xm,  # (M, K), unit K stride
    w_ptr,  # (N, K) contiguous
    b_ptr,  # (N,) or a placeholder when HAS_BIAS is False
    y_ptr, stride_ym,  # (M, N)
    partial_ptr,  # (split_k, M, N) fp32, or a placeholder when split_k == 1
    M, N, K, split_k,
    M_BUCKET,  # next power of two of M: only a key of the autotuner, unused in the body
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    M_TILE: tl.constexpr = MAX_ROWS,
):
    """2 <= M <= 16: program (i, s) computes y[:, i*BLOCK_N : (i+1)*BLOCK_N] over split s of K
    as (weight tile) @ (x tile)^T on tensor cores, rows of x past M masked to zero."""
    split_index = tl.program_id(1)
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_ok = features < N
    batch = tl.arange(0, M_TILE)
    batch_ok = batch < M
    w_rows = w_ptr + features.to(tl.int64)[:, None] * K
    x_cols = x_ptr + batch[None, :] * stride_xm  # x^T: (BLOCK_K, M_TILE) tiles
    offs_k = tl.arange(0, BLOCK_K)
    k_begin, k_end = _split_bounds(K, split_index, split_k, BLOCK_K)
    acc = tl.zeros((BLOCK_N, M_TILE), dtype=tl.float32)
    for k in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        k_idx = k + offs_k
        k_ok = k_idx < K
        w = tl.load(w_rows + k_idx[None, :], mask=feature_ok[:, None] & k_ok[None, :], other=0.0)
        x_t = tl.load(x_cols + k_idx[:, None], mask=k_ok[:, None] & batch_ok[None, :], other=0.0)
        acc = tl.dot(w, x_t, acc, input_precision="ieee")  # ieee: fp32 inputs are not cut to tf32
    _write_result(acc, features, batch, M, N, split_index, split_k,
                  b_ptr, y_ptr, stride_ym, partial_ptr, HAS_BIAS)


@triton.jit(do_not_specialize=["split_k"])
def _split_k_reduce_kernel(
    partial_ptr,  # (split_k, M, N) fp32
    b_ptr,  # (N,) or a placeholder when HAS_BIAS is False
    y_ptr, stride_ym,  # (M, N)
    M, N, split_k,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    """y[m, block] = sum over splits, in split order (deterministic), + bias, in y's dtype."""
    m = tl.program_id(0)
    features = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = features < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, split_k):
        acc += tl.load(partial_ptr + (s * M + m) * N + features, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + features, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + features, acc.to(y_ptr.dtype.element_ty), mask=ok)


_tuned_vector_kernel = triton.autotune(
    configs=[c.as_triton() for c in VECTOR_CONFIGS], key=["N", "K", "split_k"], do_bench=_tuning_bench,
)(_vector_kernel)
_tuned_tile_kernel = triton.autotune(
    configs=[c.as_triton() for c in TILE_CONFIGS], key=["M_BUCKET", "N", "K", "split_k"],
    do_bench=_tuning_bench,
)(_tile_kernel)


def layout_problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """Why skinny_linear cannot take these operands (device aside), or None when it can."""
    if x.dim() != 2 or weight.dim() != 2:
        return f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}"
    if not 1 <= x.shape[0] <= MAX_ROWS:
        return f"x must have 1..{MAX_ROWS} rows, got {x.shape[0]}"
    if x.shape[1] != weight.shape[1] or weight.shape[0] == 0:
        return f"shapes do not chain: x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        return f"dtypes must match and be one of {SUPPORTED_DTYPES}: x {x.dtype}, weight {weight.dtype}"
    if x.stride(1) != 1 or not weight.is_contiguous():
        return "x needs unit stride along K and weight must be contiguous"
    if weight.device != x.device:
        return "x and weight are on different devices"
    if bias is not None:
        if bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.device != x.device:
            return f"bias must be ({weight.shape[0]},) {x.dtype} on x's device"
        if not bias.is_contiguous():
            return "bias must be contiguous"
    return None


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """True when skinny_linear(x, weight, bias) applies: CUDA tensors, 1 <= M <= 16, matching
    bf16/fp16/fp32 dtypes, x with unit K stride, contiguous weight and bias. Otherwise a caller
    falls back to F.linear."""
    return x.is_cuda and layout_problem(x, weight, bias) is None


def skinny_linear(
    x: torch.Tensor,  # (M, K), 1 <= M <= 16, unit K stride
    weight: torch.Tensor,  # (N, K) contiguous, x's dtype
    bias: torch.Tensor | None = None,  # (N,) contiguous, x's dtype
    *,
    out: torch.Tensor | None = None,  # (M, N) contiguous, x's dtype; allocated when None
    split_k: int = 1,
    config: SkinnyConfig | None = None,  # None: autotuned
) -> torch.Tensor:
    """F.linear(x, weight, bias) into `out` (returned): one launch, plus the reduce launch when
    split_k > 1 (partials allocated here, from the shapes). An explicit `config` skips the
    autotuner (tests, benchmarks)."""
    problem = layout_problem(x, weight, bias)
    assert problem is None, problem
    assert split_k >= 1, f"split_k must be >= 1, got {split_k}"
    rows, features = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty(rows, features, dtype=x.dtype, device=x.device)
    assert out.shape == (rows, features) and out.is_contiguous() and out.dtype == x.dtype, \
        f"out must be ({rows}, {features}) contiguous {x.dtype}"
    partial = (torch.empty(split_k, rows, features, dtype=torch.float32, device=x.device)
               if split_k > 1 else out)  # placeholder pointer when unused
    if config is None and _INTERPRETED:
        config = (VECTOR_CONFIGS if rows == 1 else TILE_CONFIGS)[0]
    if rows == 1:
        _launch_vector(x, weight, bias, out, partial, split_k, config)
    else:
        _launch_tile(x, weight, bias, out, partial, split_k, config)
    if split_k > 1:
        _launch_reduce(partial, bias, out)
    return out


def chosen_config(rows: int) -> SkinnyConfig | None:
    """The config the autotuner picked for the latest autotuned call on the path that `rows`
    takes (vector for 1, tile otherwise), for reports; None before any such call."""
    tuner = _tuned_vector_kernel if rows == 1 else _tuned_tile_kernel
    picked = getattr(tuner, "best_config", None)
    if picked is None:
        return None
    return SkinnyConfig(block_n=picked.kwargs["BLOCK_N"], block_k=picked.kwargs["BLOCK_K"],
                        num_warps=picked.num_warps, num_stages=picked.num_stages)


def _launch_vector(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
    partial: torch.Tensor, split_k: int, config: SkinnyConfig | None,
) -> None:
    features, depth = weight.shape
    args = (x, weight, bias if bias is not None else out, out, out.stride(0), partial,
            features, depth, split_k)
    grid = lambda meta: (triton.cdiv(features, meta["BLOCK_N"]), split_k)  # noqa: E731
    if config is None:
        _tuned_vector_kernel[grid](*args, HAS_BIAS=bias is not None)
    else:
        _vector_kernel[grid](*args, HAS_BIAS=bias is not None, **config.as_triton().all_kwargs())


def _launch_tile(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
    partial: torch.Tensor, split_k: int, config: SkinnyConfig | None,
) -> None:
    rows, depth = x.shape
    features = weight.shape[0]
    args = (x, x.stride(0), weight, bias if bias is not None else out, out, out.stride(0), partial,
            rows, features, depth, split_k, triton.next_power_of_2(rows))
    grid = lambda meta: (triton.cdiv(features, meta["BLOCK_N"]), split_k)  # noqa: E731
    if config is None:
        _tuned_tile_kernel[grid](*args, HAS_BIAS=bias is not None)
    else:
        _tile_kernel[grid](*args, HAS_BIAS=bias is not None, **config.as_triton().all_kwargs())


def _launch_reduce(partial: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    split_k, rows, features = partial.shape
    grid = (rows, triton.cdiv(features, _REDUCE_BLOCK))
    _split_k_reduce_kernel[grid](
        partial, bias if bias is not None else out, out, out.stride(0), rows, features, split_k,
        HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK, num_warps=4,
    )
