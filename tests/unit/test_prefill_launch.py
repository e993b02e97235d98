"""The paged prefill-attention kernel's default launch (engine/kernels/gpu/prefill_launch.py):
grouped for the 1.5B config, unchanged where grouping does not apply."""

from __future__ import annotations

import torch

from engine.kernels.gpu.prefill_launch import (
    PrefillLaunch, prefill_block_m, prefill_heads_per_program, prefill_launch, prefill_max_rows, prefill_splits,
)


def test_heads_per_program_is_the_largest_power_of_two_that_fits():
    assert (prefill_max_rows(torch.bfloat16), prefill_max_rows(torch.float16), prefill_max_rows(torch.float32)) \
        == (128, 128, 64)
    cases = [(16, 4), (16, 16), (12, 4), (48, 8), (32, 2), (64, 1)]
    assert [prefill_heads_per_program(h, kv) for h, kv in cases] == [4, 1, 1, 2, 8, 8]
    assert [prefill_heads_per_program(h, kv, max_rows=64) for h, kv in cases] == [4, 1, 1, 2, 4, 4]


def test_block_m_keeps_the_tile_within_max_rows():
    assert [prefill_block_m(256, g) for g in (1, 2, 4, 8)] == [64, 64, 32, 16]
    assert [prefill_block_m(20, g) for g in (1, 4, 8)] == [16, 16, 16]
    assert [prefill_block_m(256, g, max_rows=64) for g in (1, 2, 4)] == [64, 32, 16]


def test_restore_plus_256_is_grouped():
    """256 queries, 16 heads over 4 KV heads, bf16: 4 heads x 32 queries a program, 8 warps,
    32 query blocks at one a SM: 4 splits (128 programs)."""
    assert prefill_launch(torch.bfloat16, 16, 4, 256, 1) == PrefillLaunch(4, 32, 64, 8, 3, 4)
    assert prefill_launch(torch.float32, 16, 4, 256, 1) == PrefillLaunch(4, 16, 64, 4, 3, 4)


def test_one_head_a_program_launches_as_before_grouping():
    """G = 1: 64 queries (16 for short chunks), 4 warps, splits for two programs an SM."""
    assert prefill_launch(torch.bfloat16, 16, 4, 256, 1, heads_per_program=1) == PrefillLaunch(1, 64, 64, 4, 3, 4)
    assert prefill_launch(torch.bfloat16, 16, 4, 20, 3, heads_per_program=1) == PrefillLaunch(1, 16, 64, 4, 3, 2)
    assert prefill_launch(torch.bfloat16, 16, 16, 256, 1) == PrefillLaunch(1, 64, 64, 4, 3, 4)
    assert prefill_splits(4 * 16) == 4 and prefill_splits(1000) == 1 and prefill_splits(1) == 8


def test_given_parameters_are_kept():
    launch = prefill_launch(torch.bfloat16, 16, 4, 256, 1, heads_per_program=2, block_m=16, block_n=32,
                            num_warps=2, num_stages=2, num_splits=3)
    assert launch == PrefillLaunch(2, 16, 32, 2, 2, 3)
