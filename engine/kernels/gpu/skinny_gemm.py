"""Skinny GEMM on the GPU: F.linear for a single row, at the rate the weight streams from HBM.

`skinny_linear(x, weight, bias)` computes F.linear(x, weight, bias) = x @ weight.T + bias for
one row x (1, K), weight (N, K) in nn.Linear's layout (contiguous, K fastest), bias (N,); fp32
accumulation, output (1, N) contiguous in x's dtype. F.linear itself is the reference (there is
no separate *_reference.py): the device test compares against it computed in fp32.

`skinny_linear(gate_up, weight, bias, gated=True)` computes F.linear(silu_and_mul(gate_up),
weight, bias) for the MLP's row gate_up (1, 2K) = [gate | up] in the same one launch: no
separate SiLU-and-mul kernel, no (1, K) intermediate in memory. Each program computes
silu(gate) * up for the x slice of each K step as it loads it, with the roundings of
engine/kernels/gpu/activation.py (silu in fp32 rounded to the dtype, then the product rounded
to the dtype). Under the same config the result is meant to equal
skinny_linear(activation.silu_and_mul(gate_up), weight, bias) bit for bit (the same operations
in the same order; the device test checks it); the reference is F.linear in fp32 after
norm_reference.silu_and_mul. Every program recomputes the whole activation (2K loads, from L2
after the first programs, and K sigmoids) next to the BLOCK_N * K weight elements it streams.
benchmarks/skinny_gemm.py on the H200 at the MLP output shape (N 2048, K 5632): 7.65 us per
call against 8.07 us for silu_and_mul then skinny_linear.

`skinny_linear(x, weight, bias, row_rms=RowRms(sum_squares, eps))` folds an RMS norm of the row
into the GEMM: x holds the norm's weight times its input, and the output is scaled by
rsqrt(sum(sum_squares) / K + eps) before the bias (the Mamba mixer's gated norm at batch 1:
engine/kernels/gpu/mamba_decode.py writes x and the sums of squares).

When it is used: decode steps at batch size 1, where every linear layer sees one row. There
the GEMM does one multiply-add per weight element loaded, so its time is the time to read the
weight once. engine/layers/parallel_linear.py:linear sends every single row of the model's
linear layers here and everything else to F.linear (the LM head stays on F.linear:
engine/layers/vocab_parallel.py says why); `supports(x, weight, bias)` says whether the
operands fit.
engine/layers/mlp.py:GatedMLP.forward_gpu sends the MLP's single [gate | up] row to the gated
variant under the same rule (RowParallelLinear.forward_gated). A caller that has checked it
launches through `skinny_linear_unchecked` (skinny_linear checks again). benchmarks/skinny_gemm.py
on the H200, in bf16, weights read from HBM, calls replayed back to back in CUDA graphs with
programmatic dependent launch, per call against cuBLAS (the MLP output row without the gated
prologue):
  attention k/v   N   512, K 2048:  2.12 us vs  5.70 us (2.69x)
  attention q/o   N  2048, K 2048:  4.55 us vs  6.01 us (1.32x)
  Mamba out_proj  N  2048, K 4096:  5.65 us vs  9.26 us (1.64x)
  MLP output      N  2048, K 5632:  7.14 us vs 11.02 us (1.54x)
  Mamba in_proj   N  8512, K 2048: 10.21 us vs 11.37 us (1.11x)
  MLP input       N 11264, K 2048: 13.21 us vs 13.29 us (1.01x)
  LM head         N 49152, K 2048: 47.03 us vs 50.52 us (1.07x)
cuBLAS splits K and adds a reduce launch on the narrow shapes, reaching 9-49% of copy bandwidth
there. Summed over a decode step's linear layers the kernel takes 0.906 ms against 1.140 ms
with cuBLAS alone; streaming the weights at the copy rate would take 0.697 ms.

Design (every weight byte is read exactly once, in wide loads along K):
- one program owns BLOCK_N output features (weight rows) and walks K in BLOCK_K steps; each
  step loads a (BLOCK_N, BLOCK_K) weight tile, BLOCK_K * 2 contiguous bytes per row in bf16, so
  the loads are coalesced and vectorised (16-byte accesses when K % 16 == 0, which Triton
  specialises on), and pipelined num_stages deep through shared memory (cp.async);
- the tile times the x slice broadcast over its rows is accumulated elementwise in an fp32
  (BLOCK_N, BLOCK_K) register tile and summed over K once at the end (no reduction per step).
  CUDA cores suffice: one multiply-add per loaded element;
- the grid is cdiv(N, BLOCK_N) programs, each reading whole weight rows (K is not split):
  BLOCK_N of 4-32 gives 64-512 programs for N = 2048, 128 for N = 512 at BLOCK_N 4, on the
  H200's 132 SMs;
- with PDL each program loads its first PRELOAD_TILES weight tiles (into registers) before it
  waits for the kernel that writes x (engine/kernels/gpu/pdl.py allows touching weights
  there): the weight stream starts while the kernel ahead of the GEMM (a norm, the Mamba
  mixer, the GEMM before) still runs. At K = 2,048 and BLOCK_K 512, four tiles are a
  program's whole slice; PRELOAD_TILES gives the default and the figure behind it;
- BLOCK_N, BLOCK_K, num_warps and num_stages are tuned with @triton.autotune over CONFIGS,
  keyed on (N, K, GATED, ROW_RMS) and the dtypes (the gated and the row-RMS variants are
  tuned on their own). Every config keeps 32 fp32 accumulators per thread and at most 48 KiB
  of weight tiles in flight per program in bf16. Tuning times each config with the L2 flushed (the weights of a decode step
  never fit in L2) and a short budget.

Contracts for callers: no host synchronisation and no allocation that depends on data (the
output is allocated from the shapes, or passed in), so a call can be captured in a CUDA graph;
but the first call for a new (N, K, gated, dtype) autotunes, which synchronises, so make it
eagerly before capture (as engine/routes/decode_graphs.py does with its warm-up pass). Under Triton's
interpreter (TRITON_INTERPRET=1, no timing) a call without an explicit config uses CONFIGS[0].

Shapes: K input features, N output features.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.gpu.pdl import launch_options, release_next, wait_for_previous

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# How many BLOCK_K-column tiles of its weight rows (0 to 4) a program under PDL loads before
# it waits for the kernel that writes x (read at each launch). Two: benchmarks/gpu_roofline.py's
# batch-1 decode graph takes 1.165-1.197 ms on the H200's GPU with two, 1.190-1.237 ms with
# four and 1.266-1.281 ms with none; the output is the same bits for 0-4.
PRELOAD_TILES = 2
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration: tile sizes, warps per program, software-pipeline depth.

    num_stages goes to the K loop's tl.range (Triton pipelines a loop's loads through shared
    memory with cp.async only when they feed a tl.dot or the loop asks for stages explicitly;
    this kernel has no tl.dot) and to the launch options, where it means the same."""

    block_n: int  # weight rows (output features) per program
    block_k: int  # input features per loop step
    num_warps: int = 4
    num_stages: int = 3

    def as_triton(self) -> triton.Config:
        return triton.Config(
            {"BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "STAGES": self.num_stages},
            num_warps=self.num_warps, num_stages=self.num_stages,
        )


# Weight bytes per program and loop step: block_n * block_k * 2 (bf16) = 8-16 KiB;
# (num_stages - 1) steps in flight. Small block_n: 64-512 programs for N = 2048.
CONFIGS = (
    SkinnyConfig(block_n=8, block_k=512, num_warps=4, num_stages=4),
    SkinnyConfig(block_n=4, block_k=1024, num_warps=4, num_stages=3),
    SkinnyConfig(block_n=16, block_k=256, num_warps=4, num_stages=4),
    SkinnyConfig(block_n=16, block_k=512, num_warps=8, num_stages=3),
    SkinnyConfig(block_n=8, block_k=1024, num_warps=8, num_stages=3),
    SkinnyConfig(block_n=32, block_k=256, num_warps=8, num_stages=3),
)


def _tuning_bench(kernel_call, quantiles):
    """The autotuner's timer: triton.testing.do_bench (L2 flushed before each run) on a short
    budget, 2 ms of warm-up and 10 ms of timed runs per config."""
    return triton.testing.do_bench(kernel_call, warmup=2, rep=10, quantiles=quantiles)


@triton.jit
def _silu_and_mul(gate, up):
    """silu(gate) * up in gate's dtype with engine/kernels/gpu/activation.py's roundings (those
    of norm_reference.silu_and_mul): silu in fp32 rounded to the dtype, then the product
    computed in fp32 and rounded to the dtype. Masked lanes (gate = up = 0) give 0."""
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    activated = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    return (activated * up.to(tl.float32)).to(dtype)


@triton.jit
def _x_slice(x_ptr, K, k_idx, k_ok, GATED: tl.constexpr):
    """x[k_idx] (masked lanes 0); GATED: silu(gate) * up of those columns of [gate | up]."""
    if GATED:
        return _silu_and_mul(
            tl.load(x_ptr + k_idx, mask=k_ok, other=0.0),
            tl.load(x_ptr + K + k_idx, mask=k_ok, other=0.0),
        )
    return tl.load(x_ptr + k_idx, mask=k_ok, other=0.0)


@triton.jit
def _weight_tile(w_rows, feature_ok, k0, K, BLOCK_K: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) weight tile of columns k0 .. k0 + BLOCK_K - 1 (masked: 0)."""
    k_idx = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_rows + k_idx[None, :], mask=feature_ok[:, None] & (k_idx < K)[None, :], other=0.0)


@triton.jit
def _tile_products(w, x_ptr, k0, K, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
    """w times the x slice of columns k0 .. k0 + BLOCK_K - 1, elementwise in fp32."""
    k_idx = k0 + tl.arange(0, BLOCK_K)
    return w.to(tl.float32) * _x_slice(x_ptr, K, k_idx, k_idx < K, GATED).to(tl.float32)[None, :]


@triton.jit
def _row_kernel(
    x_ptr,  # (1, K), unit K stride; GATED: (1, 2K) = [gate | up], unit stride
    w_ptr,  # (N, K) contiguous
    b_ptr,  # (N,) or a placeholder when HAS_BIAS is False
    y_ptr,  # (1, N) contiguous
    sum_sq_ptr,  # (num_sum_sq,) fp32 (ROW_RMS) or a placeholder
    N, K, num_sum_sq, rms_eps,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ROW_RMS: tl.constexpr, SUM_SQ_BLOCK: tl.constexpr,
    PRELOAD_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program i computes y[0, i*BLOCK_N : (i+1)*BLOCK_N]; GATED: of x = silu(gate) * up, each
    x slice computed from gate and up as it is loaded (every program computes the whole x);
    ROW_RMS: the products' sums scaled by rsqrt(sum(sum_sq) / K + rms_eps), before the bias.
    With PDL the program loads the first PRELOAD_TILES (0-4) BLOCK_K-column tiles of its weight
    rows into registers before it waits for the kernel that writes x, so its weight stream
    starts while that kernel runs; they are accumulated ahead of the loop in the loop's order
    (the same bits)."""
    tl.static_assert(PRELOAD_TILES <= 4, "at most four tiles are loaded before the wait")
    release_next(USE_PDL)
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_ok = features < N
    w_rows = w_ptr + features.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if USE_PDL and PRELOAD_TILES >= 1:
        w0 = _weight_tile(w_rows, feature_ok, 0, K, BLOCK_K)
        if PRELOAD_TILES >= 2:
            w1 = _weight_tile(w_rows, feature_ok, BLOCK_K, K, BLOCK_K)
        if PRELOAD_TILES >= 3:
            w2 = _weight_tile(w_rows, feature_ok, 2 * BLOCK_K, K, BLOCK_K)
        if PRELOAD_TILES >= 4:
            w3 = _weight_tile(w_rows, feature_ok, 3 * BLOCK_K, K, BLOCK_K)
        wait_for_previous(USE_PDL)
        acc += _tile_products(w0, x_ptr, 0, K, BLOCK_K, GATED)
        if PRELOAD_TILES >= 2:
            acc += _tile_products(w1, x_ptr, BLOCK_K, K, BLOCK_K, GATED)
        if PRELOAD_TILES >= 3:
            acc += _tile_products(w2, x_ptr, 2 * BLOCK_K, K, BLOCK_K, GATED)
        if PRELOAD_TILES >= 4:
            acc += _tile_products(w3, x_ptr, 3 * BLOCK_K, K, BLOCK_K, GATED)
        k_start = PRELOAD_TILES * BLOCK_K
    else:
        wait_for_previous(USE_PDL)
        k_start = 0
    for k in tl.range(k_start, K, BLOCK_K, num_stages=STAGES):
        acc += _tile_products(_weight_tile(w_rows, feature_ok, k, K, BLOCK_K), x_ptr, k, K, BLOCK_K, GATED)
    y = tl.sum(acc, axis=1)  # (BLOCK_N,)
    if ROW_RMS:
        j = tl.arange(0, SUM_SQ_BLOCK)
        sum_squares = tl.sum(tl.load(sum_sq_ptr + j, mask=j < num_sum_sq, other=0.0), axis=0)
        y *= tl.rsqrt(sum_squares / K + rms_eps)
    if HAS_BIAS:
        y += tl.load(b_ptr + features, mask=feature_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + features, y.to(y_ptr.dtype.element_ty), mask=feature_ok)


_tuned_row_kernel = triton.autotune(
    configs=[c.as_triton() for c in CONFIGS], key=["N", "K", "GATED", "ROW_RMS"], do_bench=_tuning_bench,
)(_row_kernel)


def layout_problem(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, gated: bool = False
) -> str | None:
    """Why skinny_linear(x, weight, bias, gated=gated) cannot take these operands (device
    aside), or None when it can."""
    if x.dim() != 2 or weight.dim() != 2:
        return f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}"
    if x.shape[0] != 1:
        return f"x must have exactly one row, got {x.shape[0]}"
    width = 2 * weight.shape[1] if gated else weight.shape[1]
    if x.shape[1] != width or weight.shape[0] == 0:
        needs = "2K ([gate | up])" if gated else "K"
        return f"shapes do not chain (x needs {needs} columns): x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        return f"dtypes must match and be one of {SUPPORTED_DTYPES}: x {x.dtype}, weight {weight.dtype}"
    if x.stride(1) != 1 or not weight.is_contiguous():
        return "x needs unit column stride and weight must be contiguous"
    if weight.device != x.device:
        return "x and weight are on different devices"
    if bias is not None:
        if bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.device != x.device:
            return f"bias must be ({weight.shape[0]},) {x.dtype} on x's device"
        if not bias.is_contiguous():
            return "bias must be contiguous"
    return None


def supports(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, gated: bool = False
) -> bool:
    """True when skinny_linear(x, weight, bias, gated=gated) applies: CUDA tensors, exactly one
    row (of K columns, or 2K when gated), matching bf16/fp16/fp32 dtypes, x with unit column
    stride, contiguous weight and bias. Otherwise a caller falls back to F.linear (after
    silu_and_mul when gated)."""
    return x.is_cuda and layout_problem(x, weight, bias, gated=gated) is None


def skinny_linear(
    x: torch.Tensor,  # (1, K), unit K stride; gated: (1, 2K) = [gate | up], unit stride
    weight: torch.Tensor,  # (N, K) contiguous, x's dtype
    bias: torch.Tensor | None = None,  # (N,) contiguous, x's dtype
    *,
    gated: bool = False,
    out: torch.Tensor | None = None,  # (1, N) contiguous, x's dtype; allocated when None
    config: SkinnyConfig | None = None,  # None: autotuned
    row_rms: RowRms | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) into `out` (returned), in one launch; gated:
    F.linear(silu_and_mul(x), weight, bias) (x = [gate | up], silu_and_mul with the roundings
    of engine/kernels/gpu/activation.py); row_rms: with a folded RMS norm (RowRms). An explicit
    `config` skips the autotuner (tests, benchmarks). Checks the operands (AssertionError
    naming the problem), then runs skinny_linear_unchecked."""
    problem = layout_problem(x, weight, bias, gated=gated)
    assert problem is None, problem
    features = weight.shape[0]
    if out is not None:
        assert out.shape == (1, features) and out.is_contiguous() and out.dtype == x.dtype, \
            f"out must be (1, {features}) contiguous {x.dtype}"
    if row_rms is not None:
        squares = row_rms.sum_squares
        assert not gated, "row_rms does not combine with gated"
        assert squares.dtype == torch.float32 and squares.dim() == 1 and squares.is_contiguous() \
            and squares.device == x.device, "row_rms.sum_squares must be a contiguous (n,) fp32 on x's device"
    return skinny_linear_unchecked(x, weight, bias, gated=gated, out=out, config=config, row_rms=row_rms)


@dataclass(frozen=True)
class RowRms:
    """An RMS norm of x folded into the GEMM: the output becomes
    (x @ weight.T) * rsqrt(sum(sum_squares) / K + eps) + bias, for an x that holds the norm's
    weight times its input, and sum_squares that input's sum of squares in pieces
    (mamba_decode.GatedNormOutputs has both). That is F.linear(norm(input), weight, bias) up
    to where the rounding to x's dtype falls (before the scale instead of after it)."""

    sum_squares: torch.Tensor  # (n,) fp32, contiguous, summed in the kernel
    eps: float


def skinny_linear_unchecked(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    gated: bool = False,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    row_rms: RowRms | None = None,
) -> torch.Tensor:
    """skinny_linear without its checks, for callers that have already established
    supports(x, weight, bias, gated=gated) (engine/layers/parallel_linear.py does, once per
    call): the checks take 1-2 us of host time a call. Operands that do not fit make the kernel
    read or write out of bounds; `out`, when given, must be (1, N) contiguous in x's dtype.
    row_rms (not with gated): the output scaled by the folded norm's rsqrt (RowRms)."""
    features, depth = weight.shape
    if out is None:
        out = torch.empty(1, features, dtype=x.dtype, device=x.device)
    if config is None and _INTERPRETED:
        config = CONFIGS[0]
    sum_sq, eps = (out, 0.0) if row_rms is None else (row_rms.sum_squares, float(row_rms.eps))
    num_sum_sq = sum_sq.numel() if row_rms is not None else 1
    args = (x, weight, bias if bias is not None else out, out, sum_sq, features, depth, num_sum_sq, eps)
    flags = dict(HAS_BIAS=bias is not None, GATED=gated, ROW_RMS=row_rms is not None,
                 SUM_SQ_BLOCK=triton.next_power_of_2(num_sum_sq), PRELOAD_TILES=PRELOAD_TILES)
    grid = lambda meta: (triton.cdiv(features, meta["BLOCK_N"]),)  # noqa: E731
    if config is None:
        _tuned_row_kernel[grid](*args, **flags, **launch_options())
    else:
        _row_kernel[grid](*args, **flags, **config.as_triton().all_kwargs(), **launch_options())
    return out


def chosen_config() -> SkinnyConfig | None:
    """The config the autotuner picked for the latest autotuned call, for reports; None before
    any such call."""
    picked = getattr(_tuned_row_kernel, "best_config", None)
    if picked is None:
        return None
    return SkinnyConfig(block_n=picked.kwargs["BLOCK_N"], block_k=picked.kwargs["BLOCK_K"],
                        num_warps=picked.num_warps, num_stages=picked.num_stages)
