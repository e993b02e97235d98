"""engine/execution/worker.py's row references (RowRef): what a step samples from and what a capture saves."""

from __future__ import annotations

import torch

from engine.execution.worker import store_sampled
from engine.interfaces.output_rows import RowRef, gather_rows


def test_all_rows_in_order_are_the_step_output_itself():
    hidden = torch.randn(4, 8)
    rows = gather_rows([RowRef(hidden, i) for i in range(4)])
    assert rows is hidden  # no copy, no launch


def test_some_rows_of_one_output_are_gathered_in_order():
    hidden = torch.randn(5, 8)
    rows = gather_rows([RowRef(hidden, i) for i in (3, 0, 4)])
    assert torch.equal(rows, hidden[[3, 0, 4]])


def test_rows_of_several_outputs_are_stacked():
    decoded, restored = torch.randn(3, 8), torch.randn(8)
    refs = [RowRef(decoded, 2), RowRef(restored[None], 0), RowRef(decoded, 0)]
    assert torch.equal(gather_rows(refs), torch.stack([decoded[2], restored, decoded[0]]))
    assert torch.equal(refs[1].row(), restored)


def test_consecutive_rows_of_one_output_are_a_view():
    """A prefill's last row (or a run of rows): no gather, so no index list to copy and wait for."""
    hidden = torch.randn(6, 8)
    rows = gather_rows([RowRef(hidden, 3), RowRef(hidden, 4)])
    assert torch.equal(rows, hidden[3:5]) and rows.data_ptr() == hidden[3].data_ptr()


def test_sampled_tokens_further_into_the_pool_are_stored_at_its_start():
    """A decode graph's argmax rows 1..3 (its first chunk sampled nothing) overlap pool[:3]:
    they are copied first, not written onto themselves."""
    pool = torch.arange(10, 18)
    store_sampled(pool, pool[1:4])
    assert pool[:4].tolist() == [11, 12, 13, 13]


def test_sampled_tokens_already_in_place_or_elsewhere():
    pool = torch.zeros(4, dtype=torch.int64)
    store_sampled(pool, torch.tensor([7, 8]))
    assert pool.tolist() == [7, 8, 0, 0]
    store_sampled(pool, pool[:2])  # a decode graph's own argmax: nothing to do
    assert pool.tolist() == [7, 8, 0, 0]
