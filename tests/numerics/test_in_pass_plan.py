"""In-pass capture bookkeeping on CPU: the scan split plan and the conv state at a split
(engine/kernels/gpu/in_pass_capture.py; pure PyTorch, the GPU path's helpers)."""

import pytest
import torch

from engine.kernels.conv_reference import causal_conv1d
from engine.kernels.gpu.in_pass_capture import CaptureSplit, build_in_pass_plan, capture_conv_states


def test_plan_splits_rows():
    prefill = [(0, 0, 10), (2, 11, 5), (3, 16, 8)]  # chunk 1 (row 10) is a decode chunk
    splits = [CaptureSplit(0, 0, 4, 0, True), CaptureSplit(3, 16, 7, 3, False)]
    plan = build_in_pass_plan(prefill, splits, {}, {}, torch.device("cpu"))
    assert plan.first_rows.tolist() == [0, 1, 2, 3, 11, 12, 13, 14, 15, *range(16, 23)]
    assert plan.first_cu_host.tolist() == [0, 4, 9, 16]
    assert plan.second_rows.tolist() == [4, 5, 6, 7, 8, 9, 23]
    assert plan.second_cu_host.tolist() == [0, 6, 7]
    assert plan.captured_prefill.tolist() == [0, 2]
    with pytest.raises(ValueError):
        build_in_pass_plan(prefill, [CaptureSplit(2, 11, 5, 2, False)], {}, {}, torch.device("cpu"))


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
