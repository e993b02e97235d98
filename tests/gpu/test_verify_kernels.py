"""The one-pass verification kernels (engine/kernels/gpu/mamba_verify.py, delta_rule_verify.py)
against their pure-PyTorch references (engine/kernels/verification_reference.py), fp32 and
bf16, on a CUDA device and on the CPU under Triton's interpreter (small shapes, so that the
interpreter run takes seconds).

A step of three verification chunks of 4, 1 and 3 positions (k = 3) on non-contiguous slots:
every written row and scratch slot matches the reference (the conv windows exactly: data
movement), and every other slot (the chunks' own, the scratch slots past a chunk's length,
slots no chunk names) and every other output row come back bit for bit. The references are
checked against the mixers' own one-token decode steps chained (the CPU verification path)
in tests/engine/test_verify_gpu_host.py and test_delta_rule_verify_gpu_host.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.verification_reference import delta_rule_verify_reference, mamba_verify_reference
from tests.gpu.conftest import needs_device, relative_error

pytestmark = [pytest.mark.gpu, needs_device]

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # over up to 4 chained positions
NUM_SLOTS = 20
FIRST_ROWS, LENGTHS, SOURCES = [2, 7, 9], [4, 1, 3], [5, 0, 11]  # rows 0..1, 6, 8: another chunk's
SCRATCH = [[12, 16, 1], [13, 17, 2], [14, 18, 3], [15, 19, 4]]  # (n, V): n slots per chunk
T = 12
LIMIT = (1e-3, 0.08)


def _plan(device):
    as_long = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
    return as_long(FIRST_ROWS), as_long(LENGTHS), as_long(SOURCES), as_long(SCRATCH)


def _written_slots() -> set[int]:
    return {SCRATCH[i][v] for v, length in enumerate(LENGTHS) for i in range(length)}


def _written_rows() -> list[int]:
    return [first + i for first, length in zip(FIRST_ROWS, LENGTHS) for i in range(length)]


def _check_untouched(name, got, before):
    untouched = [s for s in range(NUM_SLOTS) if s not in _written_slots()]
    assert torch.equal(got[untouched], before[untouched]), f"{name}: a slot no position owns was written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups,with_bias", [(1, True), (2, False)])
def test_mamba_verify_matches_the_reference(device, dtype, groups, with_bias):
    from engine.kernels.gpu.mamba_verify import mamba_verify

    H, P, N, K = 4, 24, 12, 4  # P and N not powers of two: the masks of the last P block and of N
    conv_dim = H * P + 2 * groups * N
    g = torch.Generator().manual_seed(7 + groups)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    projected = rand(T, conv_dim + H + 3).to(device, dtype)
    xBC, dt_raw = projected[:, :conv_dim], projected[:, conv_dim : conv_dim + H]  # strided, as in_proj's split
    weight = (0.5 * rand(conv_dim, K)).to(device, dtype)
    bias = (0.1 * rand(conv_dim)).to(device, dtype) if with_bias else None
    dt_bias, A_log = (0.5 * rand(H)).to(device), torch.log(torch.rand(H, generator=g) * 4 + 0.5).to(device)
    conv_state = rand(NUM_SLOTS, conv_dim, K - 1).to(device, dtype)
    ssm_state = rand(NUM_SLOTS, H, P, N).to(device)
    plan = _plan(device)
    outputs = {}
    for name, run in (("kernel", mamba_verify), ("reference", mamba_verify_reference)):
        conv, ssm = conv_state.clone(), ssm_state.clone()
        x_out = torch.full((T, H, P), float("nan"), device=device, dtype=dtype)
        y = torch.full((T, H, P), float("nan"), device=device)
        with torch.inference_mode():
            run(xBC, dt_raw, conv, weight, bias, dt_bias, A_log, LIMIT, ssm, x_out, y, *plan)
        outputs[name] = conv, ssm, x_out, y
    conv, ssm, x_out, y = outputs["kernel"]
    want_conv, want_ssm, want_x, want_y = outputs["reference"]
    rows, slots = _written_rows(), sorted(_written_slots())
    assert torch.equal(conv[slots], want_conv[slots]), "conv windows after each position"
    for name, got, want in (("ssm", ssm[slots], want_ssm[slots]), ("y", y[rows], want_y[rows]),
                            ("x", x_out[rows].float(), want_x[rows].float())):
        error = relative_error(got, want)
        assert error < TOL[dtype], f"{name}: relative error {error:.2e}"
    _check_untouched("conv", conv, conv_state)
    _check_untouched("ssm", ssm, ssm_state)
    others = [r for r in range(T) if r not in rows]
    assert torch.isnan(y[others]).all() and torch.isnan(x_out[others].float()).all(), "a row of no chunk was written"


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_rule_verify_matches_the_reference(device, dtype):
    from engine.kernels.gpu.delta_rule_verify import delta_rule_verify

    Hk, Hv, dk, dv, K = 2, 4, 16, 40, 4  # dv not a power of two: the mask of the last V block
    channels = 2 * Hk * dk + Hv * dv
    g = torch.Generator().manual_seed(3)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    qkv = rand(T, channels).to(device, dtype)
    ba = rand(T, 2 * Hv).to(device, dtype)
    b, a = ba[:, :Hv], ba[:, Hv:]  # strided views, as in_proj_ba's split
    weight = (0.5 * rand(channels, K)).to(device, dtype)
    A_log = torch.log(torch.rand(Hv, generator=g) * 8 + 0.5).to(device)
    dt_bias = (0.3 * rand(Hv)).to(device)
    conv_state = rand(NUM_SLOTS, channels, K - 1).to(device, dtype)
    recurrent_state = (0.3 * rand(NUM_SLOTS, Hv, dk, dv)).to(device)
    plan = _plan(device)
    outputs = {}
    for name, run in (("kernel", delta_rule_verify), ("reference", delta_rule_verify_reference)):
        conv, rec = conv_state.clone(), recurrent_state.clone()
        y = torch.full((T, Hv, dv), float("nan"), device=device, dtype=dtype)
        with torch.inference_mode():
            run(qkv, b, a, conv, weight, A_log, dt_bias, dk ** -0.5, rec, y, *plan, num_key_heads=Hk)
        outputs[name] = conv, rec, y
    conv, rec, y = outputs["kernel"]
    want_conv, want_rec, want_y = outputs["reference"]
    rows, slots = _written_rows(), sorted(_written_slots())
    assert torch.equal(conv[slots], want_conv[slots]), "conv windows after each position"
    for name, got, want in (("recurrent", rec[slots], want_rec[slots]), ("y", y[rows].float(), want_y[rows].float())):
        error = relative_error(got, want)
        assert error < TOL[dtype], f"{name}: relative error {error:.2e}"
    _check_untouched("conv", conv, conv_state)
    _check_untouched("recurrent", rec, recurrent_state)
    others = [r for r in range(T) if r not in rows]
    assert torch.isnan(y[others].float()).all(), "a row of no chunk was written"
