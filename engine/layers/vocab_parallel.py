"""Token embedding and LM head split by vocabulary rows across tensor-parallel ranks.

Rank r holds rows layout.vocab_rows of the (vocab, hidden) matrix. The embedding looks up the
ids it holds, writes zeros for the others and sums over ranks; the LM head computes the logits
of its rows and gathers every rank's (padded to vocab_rows_per_rank) into the full vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.shard_layout import RankShardLayout, width
from engine.parallel.tensor_parallel import ShardedModule, TensorParallel, TensorShard


class VocabParallelEmbedding(ShardedModule):
    """ids (T,) -> (T, hidden); `weight` holds this rank's vocabulary rows."""

    def __init__(
        self, vocab_size: int, hidden_size: int, layout: RankShardLayout, tp: TensorParallel,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_rows = layout.vocab_rows
        self.weight = nn.Parameter(torch.empty(width(layout.vocab_rows), hidden_size, dtype=dtype))
        self.checkpoint_shards["weight"] = TensorShard(
            (vocab_size, hidden_size), 0, (layout.vocab_rows,)
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        start, end = self.vocab_rows
        elsewhere = (input_ids < start) | (input_ids >= end)  # (T,) held by another rank
        local_ids = (input_ids - start).masked_fill(elsewhere, 0)
        if end == start:  # this rank holds no rows: contribute zeros
            rows = self.weight.new_zeros(input_ids.shape[0], self.weight.shape[1])
        else:
            rows = F.embedding(local_ids, self.weight).masked_fill(elsewhere[:, None], 0.0)
        return self.tp.all_reduce(rows)


class VocabParallelLMHead(ShardedModule):
    """The untied LM head: `weight` holds this rank's vocabulary rows of lm_head.weight."""

    def __init__(
        self, vocab_size: int, hidden_size: int, layout: RankShardLayout, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width(layout.vocab_rows), hidden_size, dtype=dtype))
        self.checkpoint_shards["weight"] = TensorShard(
            (vocab_size, hidden_size), 0, (layout.vocab_rows,)
        )


def vocab_parallel_logits(
    hidden: torch.Tensor,  # (n, hidden)
    weight: torch.Tensor,  # (rows of this rank, hidden)
    vocab_size: int,
    layout: RankShardLayout,
    tp: TensorParallel,
) -> torch.Tensor:
    """(n, vocab) logits in the weight's dtype, gathered from every rank's rows. F.linear
    even for one row: the single-row GEMM would gain 3.5 us of kernel time
    (benchmarks/skinny_gemm.py), but eager callers (the sampled row of a prefill step) would
    pay for its launch through Triton's autotuner; on one device the decode graphs capture
    this call (engine/routes/decode_graphs.py)."""
    local = F.linear(hidden, weight)  # (n, local rows)
    if tp.world_size == 1:
        return local
    padded = F.pad(local, (0, layout.vocab_rows_per_rank - local.shape[-1]))
    return tp.all_gather(padded, dim=-1)[:, :vocab_size]
