"""The fused Mamba2 decode step (engine/kernels/gpu/mamba_decode.py:conv_ssd_decode, then
conv.py:advance_conv_states) against the unfused pair it replaces (causal_conv1d_varlen, then
ssd_decode_update) and against the pure-PyTorch references (causal_conv1d_step, then
ssd_step_batched); and the mixer's decode-only GPU path against its general GPU path and its
PyTorch path.

Outputs are filled with NaN before each run; the slots of resetting rows hold NaN (they must
not be read); slots no row uses hold random values that must come back bit for bit.
Triton's interpreter does not emulate libdevice.log1p, which both SSD decode kernels call for
the dt softplus: those tests skip there with the reason printed, advance_conv_states runs there.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.kernels.conv_reference import causal_conv1d_step
from engine.kernels.ssd_reference import ssd_step_batched
from tests.gpu.conftest import INTERPRETED, needs_device, needs_log1p, relative_error

pytestmark = [pytest.mark.gpu, needs_device]

DTYPES = [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(INTERPRETED, reason="bf16 is checked on the GPU only")),
]
# relative error against the unfused pair (the same operations), and against the references
# (another summation order; in bf16 the conv output's rounding may flip a last bit)
TOL_UNFUSED = {torch.float32: 1e-6, torch.bfloat16: 2e-3}
TOL_REFERENCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

H, P, N, K = 8, 40, 48, 4  # P and N not powers of two: the masks of the last P block and of N
LIMIT = (1e-3, 0.08)
NUM_SLOTS = 12
SLOTS, RESETS = [4, 0, 11, 7, 2], [0, 1, 0, 0, 1]  # non-contiguous slots, two rows reset


@dataclass
class DecodeInputs:
    """One decode step's inputs; the conv and SSD states are the ones before the step."""

    xBC: torch.Tensor  # (T, conv_dim), a strided view as in_proj's split gives
    dt_raw: torch.Tensor  # (T, H), a strided view
    weight: torch.Tensor  # (conv_dim, K)
    bias: torch.Tensor | None  # (conv_dim,)
    dt_bias: torch.Tensor  # (H,) fp32
    A_log: torch.Tensor  # (H,) fp32
    conv_state: torch.Tensor  # (NUM_SLOTS, conv_dim, K-1)
    ssm_state: torch.Tensor  # (NUM_SLOTS, H, P, N) fp32
    rows: torch.Tensor  # (Bd,) int64
    slots: torch.Tensor  # (Bd,) int64
    resets: torch.Tensor  # (Bd,) int64
    groups: int


def _inputs(device, dtype, groups: int, with_bias: bool, rows: list[int], num_tokens: int) -> DecodeInputs:
    torch.manual_seed(50 + groups + 2 * with_bias + len(rows))
    conv_dim = H * P + 2 * groups * N
    projected = torch.randn(num_tokens, 5 + conv_dim + H, device=device, dtype=dtype)
    projected[:, 5 + conv_dim :] *= 4
    projected[rows[0], 5 + conv_dim] = 30.0  # dt past softplus's threshold
    conv_state = torch.randn(NUM_SLOTS, conv_dim, K - 1, device=device, dtype=dtype)
    ssm_state = torch.randn(NUM_SLOTS, H, P, N, device=device)
    for slot, reset in zip(SLOTS, RESETS):
        if reset:  # a resetting row's slot may hold anything: it must not be read
            conv_state[slot] = float("nan")
            ssm_state[slot] = float("nan")
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return DecodeInputs(
        xBC=projected[:, 5 : 5 + conv_dim],
        dt_raw=projected[:, 5 + conv_dim :],
        weight=torch.randn(conv_dim, K, device=device, dtype=dtype) * 0.5,
        bias=torch.randn(conv_dim, device=device, dtype=dtype) if with_bias else None,
        dt_bias=torch.randn(H, device=device) - 3,
        A_log=torch.rand(H, device=device) * 2,
        conv_state=conv_state,
        ssm_state=ssm_state,
        rows=as_t(rows),
        slots=as_t(SLOTS),
        resets=as_t(RESETS),
        groups=groups,
    )


def _nan(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _one_token_chunks(count: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens (count+1,), token_chunk (count,)) of count 1-token chunks, as a
    decode-only plan has them."""
    arange = torch.arange(count + 1, device=device)
    return arange, arange[:count]


def _run_fused(inp: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """conv_ssd_decode then advance_conv_states (over the decode rows as 1-token chunks):
    (y (T, H, P), x (T, H, P), conv_state, ssm_state), the states updated copies."""
    from engine.kernels.gpu.conv import advance_conv_states
    from engine.kernels.gpu.mamba_decode import conv_ssd_decode

    T, device = inp.xBC.shape[0], inp.xBC.device
    conv_state, ssm_state = inp.conv_state.clone(), inp.ssm_state.clone()
    y = _nan((T, H, P), torch.float32, device)
    x = _nan((T, H, P), inp.xBC.dtype, device)
    conv_ssd_decode(
        inp.xBC, inp.dt_raw, conv_state, inp.weight, inp.bias, inp.dt_bias, inp.A_log, LIMIT,
        ssm_state, x, y, inp.rows, inp.slots, inp.resets,
    )
    cu_seqlens, _ = _one_token_chunks(len(SLOTS), device)
    advance_conv_states(inp.xBC[inp.rows], conv_state, cu_seqlens, inp.slots, inp.resets)
    return y, x, conv_state, ssm_state


def _run_unfused(inp: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """causal_conv1d_varlen over the decode rows as 1-token chunks, then ssd_decode_update;
    the same returns as _run_fused (rows other than the decode rows NaN)."""
    from engine.kernels.gpu.conv import causal_conv1d_varlen
    from engine.kernels.gpu.ssd import ssd_decode_update

    T, device = inp.xBC.shape[0], inp.xBC.device
    Bd, GN = len(SLOTS), inp.groups * N
    conv_state, ssm_state = inp.conv_state.clone(), inp.ssm_state.clone()
    cu_seqlens, token_chunk = _one_token_chunks(Bd, device)
    out = causal_conv1d_varlen(
        inp.xBC[inp.rows], conv_state, inp.weight, inp.bias, cu_seqlens, inp.slots, inp.resets,
        token_chunk, apply_silu=True,
    )
    x, B, C = out.split([H * P, GN, GN], dim=-1)
    y_rows = _nan((Bd, H, P), torch.float32, device)
    ssd_decode_update(
        x.view(Bd, H, P), inp.dt_raw[inp.rows], inp.dt_bias, inp.A_log, LIMIT,
        B.view(Bd, inp.groups, N), C.view(Bd, inp.groups, N), ssm_state, y_rows, token_chunk,
        inp.slots, inp.resets,
    )
    y, x_full = _nan((T, H, P), torch.float32, device), _nan((T, H, P), inp.xBC.dtype, device)
    y[inp.rows], x_full[inp.rows] = y_rows, x.reshape(Bd, H, P)
    return y, x_full, conv_state, ssm_state


def _reference(inp: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PyTorch references in fp32, the conv output rounded to the model dtype before the
    SSD step (as the GPU paths do): (y (Bd, H, P), x (Bd, H, P), new conv states
    (Bd, conv_dim, K-1) in the model dtype, new SSM states (Bd, H, P, N)) of the decode rows."""
    Bd, GN, dtype = len(SLOTS), inp.groups * N, inp.xBC.dtype
    keep = (inp.resets == 0)[:, None, None]
    conv_in = torch.where(keep, inp.conv_state[inp.slots].float(), 0.0)
    ssm_in = torch.where(keep[..., None], inp.ssm_state[inp.slots], 0.0)
    bias = None if inp.bias is None else inp.bias.float()
    out, new_conv = causal_conv1d_step(
        inp.xBC[inp.rows].float(), conv_in, inp.weight.float(), bias, apply_silu=True
    )
    x, B, C = out.to(dtype).float().split([H * P, GN, GN], dim=-1)
    dt = torch.nn.functional.softplus(inp.dt_raw[inp.rows].float() + inp.dt_bias).clamp(*LIMIT)
    y, new_ssm = ssd_step_batched(
        x.view(Bd, H, P), dt, -torch.exp(inp.A_log), B.view(Bd, inp.groups, N),
        C.view(Bd, inp.groups, N), None, ssm_in,
    )
    return y, x.view(Bd, H, P).to(dtype), new_conv.to(dtype), new_ssm


@needs_log1p
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize(
    "rows,num_tokens",
    [([0, 1, 2, 3, 4], 5),  # every row a decode row (a decode-only plan)
     ([0, 2, 3, 5, 8], 9)],  # decode rows among others, which must stay untouched
)
def test_conv_ssd_decode(device, dtype, groups, with_bias, rows, num_tokens):
    inp = _inputs(device, dtype, groups, with_bias, rows, num_tokens)
    fused = _run_fused(inp)
    unfused = _run_unfused(inp)
    ref_y, ref_x, ref_conv, ref_ssm = _reference(inp)

    y, x, conv_state, ssm_state = fused
    for name, got, want in zip(("y", "x"), fused, unfused):
        assert relative_error(got[inp.rows], want[inp.rows]) < TOL_UNFUSED[dtype], f"{name} against the unfused pair"
    assert torch.equal(conv_state, unfused[2]), "conv states against the unfused pair"
    assert relative_error(ssm_state, unfused[3]) < TOL_UNFUSED[dtype], "SSM states against the unfused pair"
    assert relative_error(y[inp.rows], ref_y) < TOL_REFERENCE[dtype], "y against the reference"
    assert relative_error(x[inp.rows], ref_x) < TOL_REFERENCE[dtype], "x against the reference"
    assert torch.equal(conv_state[inp.slots], ref_conv), "conv states: the window shifted by one token"
    assert relative_error(ssm_state[inp.slots], ref_ssm) < TOL_REFERENCE[dtype], "SSM states"
    untouched_rows = [r for r in range(num_tokens) if r not in rows]
    assert torch.isnan(y[untouched_rows]).all() and torch.isnan(x[untouched_rows]).all(), "a stray row"
    unused = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert torch.equal(conv_state[unused], inp.conv_state[unused]), "a stray conv slot"
    assert torch.equal(ssm_state[unused], inp.ssm_state[unused]), "a stray SSM slot"


@pytest.mark.parametrize("dtype", DTYPES)
def test_advance_conv_states_one_token_chunks(device, dtype):
    """The conv window shift alone, over 1-token chunks with non-contiguous slots (what a
    decode-only step runs after the fused kernel): runs in the interpreter too."""
    from engine.kernels.gpu.conv import advance_conv_states

    inp = _inputs(device, dtype, 2, True, [0, 1, 2, 3, 4], 5)
    conv_state = inp.conv_state.clone()
    cu_seqlens, _ = _one_token_chunks(len(SLOTS), device)
    advance_conv_states(inp.xBC, conv_state, cu_seqlens, inp.slots, inp.resets)
    _, _, ref_conv, _ = _reference(inp)
    assert torch.equal(conv_state[inp.slots], ref_conv)
    unused = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert torch.equal(conv_state[unused], inp.conv_state[unused]), "a stray conv slot"


@needs_log1p
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixer_decode_only_path(device, dtype, monkeypatch):
    """Mamba2Mixer.mix_batch_gpu on a decode-only plan built as the decode CUDA graphs build it
    (decode_only_plan; the last two rows graph padding: reset, sharing a scratch slot) takes
    the fused path; it must match the general GPU path (mix_chunks_gpu) on the same plan: y,
    x, the real rows' state slots, the unused slots unchanged. In fp32 the whole mixer also
    matches its PyTorch path (no plan)."""
    from engine.engine_config import DEFAULT_MODEL_DIR
    from engine.kernels.gpu.batch_plan import decode_only_plan
    from engine.execution.loader import load_model
    from engine.interfaces.sampling_params import SamplingParams
    from engine.interfaces.step_io import ScheduledChunk
    from engine.interfaces.forward_batch import build_forward_batch

    model, config = load_model(DEFAULT_MODEL_DIR, dtype=dtype, device=device)
    mixer = next(layer.mamba for layer in model.layers if layer.mamba is not None)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the checkpoint's D is 1 in every head: draw one per head
        mixer.D.copy_(2 * torch.randn(mixer.num_heads, generator=g))
    slots, resets = [5, 2, 7, 3, 0, 0], [0, 1, 0, 1, 1, 1]  # slot 0: the graphs' scratch slot
    real_slots, unused_slots = [5, 2, 7, 3], [1, 4, 6]
    T = len(slots)
    (conv_dim, taps), ssm_shape = model.mamba_state_shape()
    conv_state = torch.randn(8, conv_dim, taps, generator=g).to(device, dtype)
    ssm_state = torch.randn(8, *ssm_shape, generator=g).to(device)
    for slot, reset in zip(slots, resets):
        if reset:
            conv_state[slot] = float("nan")
            ssm_state[slot] = float("nan")
    hidden = torch.randn(T, config.hidden_size, generator=g).to(device, dtype)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    plan = decode_only_plan(
        as_t(slots), as_t(resets), as_t([1] * T), torch.zeros(T, 1, dtype=torch.int64, device=device),
        torch.arange(T + 1, device=device),
    )
    states = {path: (conv_state.clone(), ssm_state.clone()) for path in ("fused", "general", "pytorch")}

    from engine.kernels.gpu import mamba_decode

    fused_calls = []
    fused_kernel = mamba_decode.conv_ssd_decode

    def counted(*args, **kwargs):
        fused_calls.append(1)
        return fused_kernel(*args, **kwargs)

    monkeypatch.setattr(mamba_decode, "conv_ssd_decode", counted)
    with torch.inference_mode():
        _, xBC, dt_raw = mixer.in_proj(hidden).split(
            [mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1
        )
        y, x = mixer.mix_batch_gpu(xBC, dt_raw, *states["fused"], plan)
        want_y, want_x = mixer.mix_chunks_gpu(xBC, dt_raw, *states["general"], plan)
    assert fused_calls == [1], "the decode-only plan did not take the fused kernel"
    tol = TOL_UNFUSED[dtype]
    assert relative_error(y, want_y) < tol, "y"
    assert relative_error(x, want_x) < tol, "x"
    for got, want, name in zip(states["fused"], states["general"], ("conv", "ssm")):
        assert relative_error(got[real_slots], want[real_slots]) < tol, f"{name} states"
    for got, before, name in zip(states["fused"], (conv_state, ssm_state), ("conv", "ssm")):
        assert torch.equal(got[unused_slots], before[unused_slots]), f"a stray {name} slot"

    if dtype != torch.float32:
        return
    chunks = [
        ScheduledChunk(
            request_id=f"r{i}", token_ids=(7 + i,), start_position=0 if reset else 3,
            block_table=(i,), state_slot=slot, reset_state=bool(reset), sample=True,
            sampling=SamplingParams(),
        )
        for i, (slot, reset) in enumerate(zip(slots, resets))
    ]
    batch = build_forward_batch(chunks, 16, device)
    forward_states = (conv_state.clone(), ssm_state.clone())
    with torch.inference_mode():
        got = mixer(hidden, batch, *forward_states, gpu_plan=plan)
        want = mixer(hidden, batch, *states["pytorch"])
    assert relative_error(got, want) < TOL_REFERENCE[dtype], "mixer output against its PyTorch path"
    for got, want, name in zip(forward_states, states["pytorch"], ("conv", "ssm")):
        assert relative_error(got[real_slots], want[real_slots]) < TOL_REFERENCE[dtype], f"{name} states"


@needs_log1p
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reset", [False, True])
def test_one_row_folds_the_gated_norm(device, dtype, reset, monkeypatch):
    """Mamba2Mixer.forward on a one-row decode-only plan that folds (built with the model's
    folds_gated_norm, as the decode graphs build it) takes mix_row_folded_gpu: no launch
    of the gated norm's kernel, out_proj's GEMM scaled by the norm (RowRms). Its output must
    match what it replaces, mix_decode_only_gpu then the gated norm's kernel then out_proj,
    within the model dtype's rounding (the rounding now falls before the norm's scale), and
    the row's conv and SSM states must agree (the same operations, up to fused multiply-adds);
    other slots stay untouched. A one-token chunk that resets (a new sequence's first token)
    too."""
    from engine.engine_config import DEFAULT_MODEL_DIR
    from engine.interfaces.forward_batch import build_forward_batch
    from engine.kernels.gpu import fused_norm
    from engine.kernels.gpu.batch_plan import decode_only_plan
    from engine.execution.loader import load_model
    from engine.interfaces.sampling_params import SamplingParams
    from engine.interfaces.step_io import ScheduledChunk

    model, config = load_model(DEFAULT_MODEL_DIR, dtype=dtype, device=device)
    mixer = next(layer.mamba for layer in model.layers if layer.mamba is not None)
    assert mixer.norm.group_size == mixer.intermediate_size, "the default model has one norm group"
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # the checkpoint's D is 1 and the norm weight 1: draw them
        mixer.D.copy_(2 * torch.randn(mixer.num_heads, generator=g))
        mixer.norm.weight.copy_(1 + 0.3 * torch.randn(mixer.intermediate_size, generator=g))
    slot = 3
    (conv_dim, taps), ssm_shape = model.mamba_state_shape()
    conv_state = torch.randn(6, conv_dim, taps, generator=g).to(device, dtype)
    ssm_state = torch.randn(6, *ssm_shape, generator=g).to(device)
    if reset:
        conv_state[slot], ssm_state[slot] = float("nan"), float("nan")
    hidden = torch.randn(1, config.hidden_size, generator=g).to(device, dtype)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    assert model.folds_gated_norm(), "the default model folds its gated norm on CUDA"
    plan = decode_only_plan(as_t([slot]), as_t([int(reset)]), as_t([1]), torch.zeros(1, 1, dtype=torch.int64, device=device),
                            torch.arange(2, device=device), fold_gated_norm=model.folds_gated_norm())
    chunk = ScheduledChunk(request_id="r0", token_ids=(7,), start_position=0 if reset else 3, block_table=(0,),
                           state_slot=slot, reset_state=reset, sample=True, sampling=SamplingParams())
    batch = build_forward_batch([chunk], 16, device)
    norm_launches = []
    gated_norm = fused_norm.gated_rms_norm
    monkeypatch.setattr(fused_norm, "gated_rms_norm", lambda *a, **k: norm_launches.append(1) or gated_norm(*a, **k))
    folded_states = (conv_state.clone(), ssm_state.clone())
    with torch.inference_mode():
        got = mixer(hidden, batch, *folded_states, gpu_plan=plan)
        assert norm_launches == [], "the one-row step launched the gated norm"
        replaced_states = (conv_state.clone(), ssm_state.clone())
        gate, xBC, dt_raw = mixer.in_proj(hidden).split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
        y, x = mixer.mix_decode_only_gpu(xBC, dt_raw, *replaced_states, plan)
        normed = mixer.norm.forward_gpu(y.view(1, -1), gate, dtype, skip=(x, mixer.D))
        want = mixer.out_proj(normed)
    assert norm_launches == [1]
    assert torch.isfinite(got).all()
    assert relative_error(got, want) < TOL_UNFUSED[dtype] * (10 if dtype == torch.float32 else 2), "output"
    for got_state, want_state, before, name in zip(folded_states, replaced_states, (conv_state, ssm_state), ("conv", "ssm")):
        # two compiled variants of one kernel: the same operations, up to fused multiply-adds
        assert relative_error(got_state[slot], want_state[slot]) < 1e-6, f"{name} state of the row's slot"
        others = [s for s in range(6) if s != slot]
        assert torch.equal(got_state[others], before[others]), f"a stray {name} slot"


@needs_log1p
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [1, 2])
def test_conv_ssd_decode_gated_norm_outputs(device, dtype, groups):
    """conv_ssd_decode with gated_norm (GatedNormOutputs) on rows other than the first, P = 40
    (a partial last block of P), one or two B/C groups, two rows resetting: for each decode
    row, normed = weight * (y + D[h] x) * silu(gate) rounded to the dtype and the per-program
    sums of squares of that product, where y and x are the plain kernel's on the same inputs;
    the new SSM states as the plain kernel's; a row that is not decoded stays NaN."""
    from engine.kernels.gpu.conv import advance_conv_states
    from engine.kernels.gpu.mamba_decode import GatedNormOutputs, conv_ssd_decode, num_sum_squares
    from engine.kernels.gpu.ssd import decode_block_p

    rows, num_tokens = [5, 1, 3, 0, 2], 6  # row 4 is not decoded
    inp = _inputs(device, dtype, groups, True, rows, num_tokens)
    g = torch.Generator().manual_seed(77)
    width = H * P
    gate = (2 * torch.randn(num_tokens, width + 3, generator=g)).to(device, dtype)[:, 3:]  # a strided view
    D = torch.randn(H, generator=g).to(device)
    norm_weight = (1 + 0.3 * torch.randn(width, generator=g)).to(device, dtype)
    y, x, _, plain_ssm = _run_fused(inp)
    normed = _nan((num_tokens, width), dtype, device)
    sums = _nan((num_tokens, num_sum_squares(H, P)), torch.float32, device)
    conv_state, ssm_state = inp.conv_state.clone(), inp.ssm_state.clone()
    conv_ssd_decode(
        inp.xBC, inp.dt_raw, conv_state, inp.weight, inp.bias, inp.dt_bias, inp.A_log, LIMIT,
        ssm_state, None, None, inp.rows, inp.slots, inp.resets,
        gated_norm=GatedNormOutputs(gate, D, norm_weight, normed, sums),
    )
    cu_seqlens, _ = _one_token_chunks(len(SLOTS), device)
    advance_conv_states(inp.xBC[inp.rows], conv_state, cu_seqlens, inp.slots, inp.resets)

    gated = (y[rows] + D[:, None] * x[rows].float()) * torch.nn.functional.silu(gate[rows].float().view(-1, H, P))
    want_normed = (norm_weight.float() * gated.reshape(len(rows), width)).to(dtype)
    block_p = decode_block_p(P)
    padded = torch.nn.functional.pad(gated, (0, -P % block_p))  # (Bd, H, blocks * block_p)
    want_sums = padded.pow(2).reshape(len(rows), H, -1, block_p).sum(-1).reshape(len(rows), -1)
    tol = TOL_UNFUSED[dtype]
    assert relative_error(normed[rows], want_normed) < 2 * tol, "normed rows"
    assert relative_error(sums[rows], want_sums) < tol + 1e-6, "sums of squares"
    assert torch.isnan(normed[4]).all() and torch.isnan(sums[4]).all(), "a row that is not decoded was written"
    real = [s for s, r in zip(SLOTS, RESETS) if not r]
    assert relative_error(ssm_state[real], plain_ssm[real]) < 1e-6, "SSM states"
    unused = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert torch.equal(ssm_state[unused], inp.ssm_state[unused]), "a stray SSM slot"
