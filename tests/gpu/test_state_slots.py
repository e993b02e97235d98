"""Device tests of engine/kernels/gpu/state_slots.py against the PyTorch expressions they
replace (bit-exact: copies only)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import needs_device

pytestmark = [pytest.mark.gpu, needs_device]

SLOT_SHAPE = (3, 8, 160)  # (H, P, N): 3840 elements, not a multiple of the kernel's block


def _pool(device: torch.device, num_slots: int, strided: bool) -> torch.Tensor:
    """(num_slots, H, P, N) fp32; strided: every slot contiguous but slots 2 slots apart (a
    layer's view of a stacked pool)."""
    if strided:
        return torch.randn(num_slots, 2, *SLOT_SHAPE, device=device)[:, 1]
    return torch.randn(num_slots, *SLOT_SHAPE, device=device)


@pytest.mark.parametrize("strided", [False, True])
def test_gather_states_reads_slots_and_zeros_for_reset(device, strided):
    from engine.kernels.gpu.state_slots import gather_states

    pool = _pool(device, 9, strided)
    slots = torch.tensor([7, 2, 4, 0], device=device)
    reset = torch.tensor([0, 1, 0, 1], device=device)
    pool[2] = float("nan")  # a reset slot may hold anything
    before = pool.clone()
    got = gather_states(pool, slots, reset)
    expected = torch.where((reset == 0).view(-1, 1, 1, 1), pool.index_select(0, slots), 0.0)
    assert torch.equal(got, expected)
    assert not got[1].isnan().any()
    assert torch.equal(pool.nan_to_num(), before.nan_to_num())  # read only


@pytest.mark.parametrize("strided", [False, True])
def test_scatter_states_writes_only_the_given_slots(device, strided):
    from engine.kernels.gpu.state_slots import scatter_states

    pool = _pool(device, 9, strided)
    slots = torch.tensor([5, 1, 8], device=device)
    states = torch.randn(3, *SLOT_SHAPE, device=device)
    expected = pool.clone().index_copy_(0, slots, states)
    scatter_states(states, pool, slots)
    assert torch.equal(pool, expected)


def test_gather_then_scatter_round_trips_through_other_slots(device):
    from engine.kernels.gpu.state_slots import gather_states, scatter_states

    pool = _pool(device, 6, False)
    source = torch.tensor([3, 0], device=device)
    taken = gather_states(pool, source, torch.zeros(2, dtype=torch.long, device=device))
    scatter_states(taken, pool, torch.tensor([1, 5], device=device))
    assert torch.equal(pool[1], pool[3]) and torch.equal(pool[5], pool[0])


def test_scatter_states_rejects_a_mismatched_shape(device):
    from engine.kernels.gpu.state_slots import scatter_states

    pool = _pool(device, 4, False)
    with pytest.raises(AssertionError):
        scatter_states(torch.zeros(2, 3, 8, 128, device=device), pool, torch.tensor([0, 1], device=device))
