"""In-pass capture on CPU: the scan plan (the captured chunks front-padded so the capture
position is a chunk edge), the one-call scan reading the state there, and the conv state at a
split (engine/kernels/gpu/in_pass_capture.py is pure PyTorch; the GPU path passes fla's chunked
scan where these tests pass a token-by-token reference that records the same chunk-start states)."""

import pytest
import torch

from engine.kernels.conv_reference import causal_conv1d
from engine.kernels.gpu.in_pass_capture import (
    SCAN_CHUNK,
    CaptureSplit,
    build_in_pass_plan,
    capture_conv_states,
    scan_with_captures,
)
from engine.kernels.ssd_reference import ssd_chunk_scan


def _varlen_reference(q, k, v, g, initial, cu, chunks):
    """The recurrence on prepared inputs, token by token per sequence: state_t = exp(g_t)
    state_{t-1} + outer(v_t, k_t), y_t = state_t @ q_t; also the state at the start of every
    SCAN_CHUNK rows of each sequence. A stand-in for ssd.chunk_scan (chunks, where given,
    count as many chunks as it records)."""
    ys, finals, chunk_states = [], [], []
    bounds = cu.tolist()
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = initial[i].clone()  # (H, P, N)
        for t in range(s, e):
            if (t - s) % SCAN_CHUNK == 0:
                chunk_states.append(state)
            state = torch.exp(g[t])[:, None, None] * state + v[t][:, :, None] * k[t][:, None, :]
            ys.append(torch.einsum("hpn,hn->hp", state, q[t]))
        finals.append(state)
    assert chunks is None or chunks.count == len(chunk_states)
    return torch.stack(ys), torch.stack(finals), torch.stack(chunk_states)


def test_plan_pads_each_captured_chunk_to_a_chunk_edge():
    prefill = [(0, 0, 10), (2, 11, 5), (3, 16, 8)]  # chunk 1 (row 10) is a decode chunk
    splits = [CaptureSplit(0, 0, 4, 0, True), CaptureSplit(3, 16, 7, 3, False)]
    plan = build_in_pass_plan(prefill, splits, {}, {}, torch.device("cpu"))
    # chunk 0: 60 padding rows, then rows 0..9 (the capture after 4 tokens is scan row 64, the
    # start of scan chunk 1); chunk 2: rows 11..15, scan chunk 2; chunk 3: 57 padding rows,
    # then rows 16..23 (capture at scan row 64 of its sequence: chunk 3 + 1)
    assert plan.scan_rows.tolist() == [-1] * 60 + list(range(10)) + list(range(11, 16)) + [-1] * 57 + list(
        range(16, 24))
    assert plan.scan_cu.tolist() == [0, 70, 75, 140]
    # the scan's chunks: two of the first sequence (70 rows), one of the second, two of the third
    assert plan.scan_chunks.indices.tolist() == [[0, 0], [0, 1], [1, 0], [2, 0], [2, 1]]
    assert plan.scan_chunks.offsets.tolist() == [0, 2, 3, 5]
    assert plan.out_rows.tolist() == list(range(60, 70)) + list(range(70, 75)) + list(range(132, 140))
    assert plan.capture_chunks.tolist() == [1, 4]
    assert plan.out_start is None  # three sequences: the outputs are gathered
    one = build_in_pass_plan([(0, 3, 10)], [CaptureSplit(0, 3, 4, 0, True)], {}, {}, torch.device("cpu"))
    assert one.scan_rows.tolist() == [-1] * 60 + list(range(3, 13)) and one.out_start == 60
    with pytest.raises(ValueError):
        build_in_pass_plan(prefill, [CaptureSplit(2, 11, 5, 2, False)], {}, {}, torch.device("cpu"))


@pytest.mark.parametrize(
    "lengths,cuts",
    [([70, 20, 45], {0: 37, 2: 2}), ([70, 20, 45], {0: 64, 1: 19}), ([135], {0: 100})],  # 64: on an edge
)
def test_one_call_scan_equals_the_uncut_scan_and_the_state_at_the_split(lengths, cuts):
    torch.manual_seed(70)
    H, P, G, N = 4, 8, 2, 16
    T = sum(lengths)
    x = torch.randn(T, H, P, dtype=torch.float64)
    dt = torch.nn.functional.softplus(torch.randn(T, H, dtype=torch.float64) - 4)  # slow decay
    A = -torch.exp(torch.rand(H, dtype=torch.float64))
    B, C = torch.randn(T, G, N, dtype=torch.float64), torch.randn(T, G, N, dtype=torch.float64)
    initial = torch.randn(len(lengths), H, P, N, dtype=torch.float64)
    starts = [sum(lengths[:j]) for j in range(len(lengths))]
    prefill = [(j, starts[j], n) for j, n in enumerate(lengths)]
    splits = [CaptureSplit(j, starts[j], k, j, False) for j, k in cuts.items()]
    plan = build_in_pass_plan(prefill, splits, {}, {}, torch.device("cpu"))
    ssm_out = torch.full((len(cuts), H, P, N), float("nan"), dtype=torch.float64)
    q, k = (t.repeat_interleave(H // G, dim=1) for t in (C, B))  # (T, H, N)
    v, g = x * dt[..., None], dt * A
    # the scan's rows as scan_inputs lays them out: padding rows all zeros
    real = (plan.scan_rows >= 0)[:, None]
    on_scan_rows = lambda t: torch.where(  # noqa: E731
        real.view(-1, *[1] * (t.dim() - 1)), t[plan.scan_rows.clamp_min(0)], 0.0)

    y, final = scan_with_captures(_varlen_reference, *(on_scan_rows(t) for t in (q, k, v, g)), initial, plan,
                                  ssm_out)
    cu = torch.tensor([*starts, T])
    want_y, want_final, _ = _varlen_reference(q, k, v, g, initial, cu, None)
    assert torch.allclose(y, want_y, rtol=1e-9, atol=1e-9)
    assert torch.allclose(final, want_final, rtol=1e-9, atol=1e-9)
    for j, s in enumerate(starts):  # and the uncut chunks are the reference chunked scan's
        e = s + lengths[j]
        ref_y, ref_final = ssd_chunk_scan(x[s:e], dt[s:e], A, B[s:e], C[s:e], None, initial[j], chunk_size=16)
        assert torch.allclose(y[s:e], ref_y.double(), rtol=1e-5, atol=1e-5)  # (the reference is fp32)
        assert torch.allclose(final[j], ref_final.double(), rtol=1e-5, atol=1e-5)
    for c, (j, k) in enumerate(cuts.items()):
        s = starts[j]
        _, at_split = ssd_chunk_scan(x[s : s + k], dt[s : s + k], A, B[s : s + k], C[s : s + k], None,
                                     initial[j], chunk_size=16)
        assert torch.allclose(ssm_out[c], at_split.double(), rtol=1e-5, atol=1e-5), f"capture {c}"


@pytest.mark.parametrize("split,reset", [(1, False), (2, True), (3, False), (9, False)])
def test_conv_state_at_split(split, reset):
    torch.manual_seed(split)
    C, K, T, slot = 12, 4, 20, 2
    x = torch.randn(T + 3, C)[2 : 2 + T]
    state = torch.randn(4, C, K - 1)
    start = 5  # the chunk is rows [5, 20)
    out = torch.full((1, C, K - 1), float("nan"))
    capture_conv_states(x, state, (CaptureSplit(0, start, split, slot, reset),), out)
    old = torch.zeros(C, K - 1) if reset else state[slot]
    weight = torch.randn(C, K)
    _, want = causal_conv1d(x[start : start + split], old, weight, None, apply_silu=False)
    assert torch.equal(out[0], want)
