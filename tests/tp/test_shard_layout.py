"""The splitting rules (engine/parallel/shard_layout.py) and TensorShard.cut, without torch.distributed."""

from __future__ import annotations

import pytest
import torch

from engine.models.registry import parse_model_config
from engine.parallel.shard_layout import rank_shard_layout
from engine.parallel.tensor_parallel import TensorParallel, TensorShard
from tp_support import RANDOM_CONFIG


def layouts(world: int):
    config = parse_model_config(RANDOM_CONFIG)
    return [rank_shard_layout(config, TensorParallel(rank=r, world_size=world)) for r in range(world)]


def test_two_kv_heads_and_groups_split_at_tp2():
    assert [l.kv_heads for l in layouts(2)] == [(0, 1), (1, 2)]
    assert [l.mamba_groups for l in layouts(2)] == [(0, 1), (1, 2)]


def test_two_kv_heads_and_groups_replicated_at_tp4_to_the_ranks_that_read_them():
    # 4 query heads, 2 KV heads: query head h reads KV head h // 2; 8 Mamba heads, 2 groups.
    four = layouts(4)
    assert [l.attention_heads for l in four] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [l.kv_heads for l in four] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [l.mamba_heads for l in four] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [l.mamba_groups for l in four] == [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_uneven_vocabulary_is_cut_in_padded_pieces():
    assert [l.vocab_rows for l in layouts(4)] == [(0, 25), (25, 50), (50, 75), (75, 97)]
    assert {l.vocab_rows_per_rank for l in layouts(4)} == {25}


def test_group_count_that_neither_divides_nor_is_divided_is_refused():
    raw = {**RANDOM_CONFIG, "mamba_n_heads": 12, "mamba_n_groups": 3, "mamba_expand": 3}
    with pytest.raises(ValueError, match="mamba_n_groups=3"):
        rank_shard_layout(parse_model_config(raw), TensorParallel(rank=0, world_size=2))


class RecordingSource:
    """A full tensor that records which slices were read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.reads = tensor, []

    def __getitem__(self, index):
        self.reads.append(index)
        return self.tensor[index]


def test_cut_reads_only_the_shard_ranges():
    full = torch.arange(40.0).view(10, 4)
    source = RecordingSource(full)
    shard = TensorShard((10, 4), 0, ((1, 3), (7, 8)))
    assert torch.equal(shard.cut(source), full[[1, 2, 7]])
    assert source.reads == [(slice(1, 3),), (slice(7, 8),)]
    columns = TensorShard((10, 4), 1, ((2, 4),))
    assert torch.equal(columns.cut(RecordingSource(full)), full[:, 2:4])
    assert columns.shape == (10, 2)
