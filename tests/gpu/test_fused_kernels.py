"""The fused elementwise kernels of the decode path against their PyTorch references (the code
the CPU path runs), on fresh random inputs with every output poisoned (NaN) before the run.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import norm_reference as ref
from engine.kernels.ssd_reference import ssd_step
from tests.gpu.conftest import INTERPRETED, needs_device, needs_log1p, relative_error

pytestmark = [pytest.mark.gpu, needs_device]

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _nan(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        INTERPRETED, reason="the interpreter rounds fp32 to bf16 differently from torch (checked on the GPU)")),
])
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_add_rms_norm(device, dtype, with_delta, num_tokens):
    from engine.kernels.gpu.fused_norm import add_rms_norm

    torch.manual_seed(10 + num_tokens)
    D = 2048
    hidden = torch.randn(num_tokens, D, device=device, dtype=dtype) * 3
    delta = torch.randn(num_tokens, D, device=device, dtype=dtype) if with_delta else None
    weight = (1 + 0.1 * torch.randn(D, device=device)).to(dtype)
    residual, out = _nan((num_tokens, D), dtype, device), _nan((num_tokens, D), dtype, device)
    got_residual, got = add_rms_norm(hidden, delta, 0.22, weight, 1e-5, residual_out=residual, out=out)
    want_residual, want = ref.add_rms_norm(hidden, delta, 0.22, weight, 1e-5)
    assert got.data_ptr() == out.data_ptr()
    assert relative_error(got, want) < TOL[dtype]
    assert relative_error(got_residual, want_residual) < TOL[dtype]
    if with_delta:
        assert got_residual.data_ptr() == residual.data_ptr()
        if dtype == torch.bfloat16:  # the same roundings as the reference: equal bits
            assert torch.equal(got_residual, want_residual)
    else:
        assert got_residual is hidden


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_groups", [1, 4])
@pytest.mark.parametrize("with_skip", [False, True])
def test_gated_rms_norm(device, dtype, num_groups, with_skip):
    """with_skip: Mamba2's D skip inside the norm, x a column slice of a conv output [x | B | C]
    in the model dtype (as the mixer passes it), against the reference applied to y + D * x
    computed here in fp32."""
    from engine.kernels.gpu.fused_norm import gated_rms_norm

    torch.manual_seed(20 + num_groups)
    T, H, P = 7, 64, 64
    I = H * P
    y = torch.randn(T, I, device=device)  # the scan's fp32 output
    projected = torch.randn(T, I + 300, device=device, dtype=dtype)
    gate = projected[:, 100 : 100 + I]  # a strided view, as the split of in_proj's output is
    weight = (1 + 0.1 * torch.randn(I, device=device)).to(dtype)
    skip, y_with_skip = None, y
    if with_skip:
        x = torch.randn(T, I + 2 * 128, device=device, dtype=dtype)[:, :I]
        D = torch.randn(H, device=device) * 2  # a head mix-up shows
        skip = (x, D)
        y_with_skip = (y.view(T, H, P) + D[:, None] * x.float().reshape(T, H, P)).view(T, I)
    out = _nan((T, I), dtype, device)
    gated_rms_norm(y, gate, weight, I // num_groups, 1e-5, dtype, out=out, skip=skip)
    want = ref.gated_rms_norm(y_with_skip, gate, weight, I // num_groups, 1e-5, dtype)
    assert relative_error(out, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 200])
def test_silu_and_mul(device, dtype, num_tokens):
    from engine.kernels.gpu.activation import silu_and_mul

    torch.manual_seed(30 + num_tokens)
    I = 5632
    x = torch.randn(num_tokens, 2 * I, device=device, dtype=dtype) * 2
    out = _nan((num_tokens, I), dtype, device)
    silu_and_mul(x, out=out)
    assert relative_error(out, ref.silu_and_mul(x)) < TOL[dtype]


@needs_log1p
def test_ssd_decode_update(device):
    """dt = clamp(softplus(dt_raw + dt_bias)) and A = -exp(A_log) inside the decode kernel, dt_raw
    read from a strided bf16 view (as in_proj's dt columns are); y without the D skip (the gated
    norm adds it), so the reference runs with D None."""
    from engine.kernels.gpu.ssd import ssd_decode_update

    torch.manual_seed(40)
    T, H, P, G, N, num_slots = 9, 8, 64, 2, 128, 12
    rows, slots, resets = [0, 2, 3, 5, 8], [4, 0, 11, 7, 2], [0, 1, 0, 0, 1]
    limit = (1e-3, 0.08)
    x = torch.randn(T, H, P, device=device, dtype=torch.bfloat16)
    projected = torch.randn(T, H + 40, device=device, dtype=torch.bfloat16) * 4
    projected[0, 0] = 30.0  # past softplus's threshold
    dt_raw = projected[:, 40:]
    dt_bias = torch.randn(H, device=device) - 3
    A_log = torch.rand(H, device=device) * 2
    B = torch.randn(T, G, N, device=device, dtype=torch.bfloat16)
    C = torch.randn(T, G, N, device=device, dtype=torch.bfloat16)
    state = torch.randn(num_slots, H, P, N, device=device)
    for slot, reset in zip(slots, resets):
        if reset:
            state[slot] = float("nan")
    unused = [s for s in range(num_slots) if s not in slots]
    state[unused] = float("nan")
    before = state.clone()
    y = _nan((T, H, P), torch.float32, device)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731

    ssd_decode_update(
        x, dt_raw, dt_bias, A_log, limit, B, C, state, y, as_t(rows), as_t(slots), as_t(resets)
    )
    dt = torch.nn.functional.softplus(dt_raw.float() + dt_bias).clamp(*limit)
    A = -torch.exp(A_log)
    for row, slot, reset in zip(rows, slots, resets):
        old = torch.zeros_like(before[slot]) if reset else before[slot]
        ref_y, ref_state = ssd_step(x[row], dt[row], A, B[row], C[row], None, old)
        assert relative_error(y[row], ref_y) < 1e-5, f"row {row} y"
        assert relative_error(state[slot], ref_state) < 1e-5, f"row {row} state"
    untouched = [r for r in range(T) if r not in rows]
    assert torch.isnan(y[untouched]).all(), "a non-decode row was written"
    assert torch.isnan(state[unused]).all(), "an unused slot was written"
