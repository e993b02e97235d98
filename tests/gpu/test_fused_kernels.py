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
# Triton's interpreter casts fp32 to bf16 by truncation where torch (and the GPU) round to
# nearest: every bf16 rounding in a kernel is off by up to one ulp, always the same way
TOL_HERE = {**TOL, torch.bfloat16: 3e-2} if INTERPRETED else TOL


def _nan(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _assert_rounded_as(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 on the GPU: a kernel that rounds where its reference does (and nowhere else) gives
    its bits but where the fp32 rsqrt or reduction order tips a rounding (under 0.1% of
    elements measured on the CPU); one extra or missing rounding to bf16 leaves about 75%."""
    if got.dtype == torch.bfloat16 and not INTERPRETED:
        assert (got == want).float().mean().item() > 0.98


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
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("num_tokens,D", [(1, 2048), (6, 1001), (64, 96)])
def test_add_rms_norm_zero_centered(device, dtype, with_delta, num_tokens, D):
    """Qwen3-Next's norm with the residual add before it (multiplier 1.0, as its layers add):
    (1 + w) * x / rms(x) in fp32, rounded once, against the reference; the stream equal to
    `hidden + delta` in the model dtype bit for bit."""
    from engine.kernels.gpu.fused_norm import add_rms_norm

    torch.manual_seed(50 + num_tokens)
    hidden = torch.randn(num_tokens, D, device=device, dtype=dtype) * 3
    delta = torch.randn(num_tokens, D, device=device, dtype=dtype) if with_delta else None
    weight = (0.3 * torch.randn(D, device=device)).to(dtype)  # centred on zero, as stored
    residual, out = _nan((num_tokens, D), dtype, device), _nan((num_tokens, D), dtype, device)
    got_residual, got = add_rms_norm(
        hidden, delta, 1.0, weight, 1e-6, residual_out=residual, out=out, zero_centered=True
    )
    want_residual, want = ref.add_rms_norm(hidden, delta, 1.0, weight, 1e-6, zero_centered=True)
    assert relative_error(got, want) < TOL_HERE[dtype]
    _assert_rounded_as(got, want)
    # the plain norm's result is far off: the mode changed the kernel's output
    assert relative_error(ref.add_rms_norm(hidden, delta, 1.0, weight, 1e-6)[1], want) > 0.5
    if with_delta:
        assert got_residual.data_ptr() == residual.data_ptr()
        assert relative_error(got_residual, want_residual) < TOL_HERE[dtype]
        if not INTERPRETED:  # the add rounded as the layer's `hidden + mixed`: equal bits
            assert torch.equal(got_residual, hidden + delta)
    else:
        assert got_residual is hidden


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,H,P", [(1, 32, 128), (5, 3, 75), (33, 8, 64)])
def test_rms_norm_then_gate(device, dtype, num_tokens, H, P):
    """The gated delta-net's output norm, weight * norm(y) * silu(gate) per head of P channels,
    against the reference: y the rule's output in the model dtype, the gate a strided view of
    a projection's output (each head's channels apart from the next's), as the mixer passes
    them."""
    from engine.kernels.gpu.fused_norm import rms_norm_then_gate

    torch.manual_seed(60 + num_tokens)
    y = torch.randn(num_tokens, H, P, device=device, dtype=dtype) * 2
    projected = torch.randn(num_tokens, H, 2 * P + 3, device=device, dtype=dtype) * 2
    gate = projected[:, :, 3 : 3 + P]
    weight = (1 + 0.3 * torch.randn(P, device=device)).to(dtype)
    for out_dtype in (dtype, torch.float32):
        got = rms_norm_then_gate(y, gate, weight, 1e-6, out_dtype)
        want = ref.rms_norm_then_gate(y, gate, weight, 1e-6, out_dtype)
        assert got.shape == (num_tokens, H, P) and got.dtype == out_dtype and got.is_contiguous()
        assert relative_error(got, want) < TOL_HERE[dtype]
        _assert_rounded_as(got, want)
    # each head normalised by its own rms: scaling one head's y leaves the output as it was
    y_scaled = y * torch.arange(1, H + 1, device=device, dtype=dtype)[None, :, None]
    scaled = rms_norm_then_gate(y_scaled, gate, weight, 1e-6, torch.float32)
    assert relative_error(scaled, ref.rms_norm_then_gate(y, gate, weight, 1e-6, torch.float32)) < TOL_HERE[dtype]


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
