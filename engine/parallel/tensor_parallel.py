"""The tensor-parallel context one rank runs in, and how a rank's piece of a tensor is described.

`TensorParallel` is passed to the model at construction; the sharded layers keep it and call
its collectives. There is no module-level state: a model built with `TensorParallel.single()`
(world_size 1) never calls torch.distributed and computes exactly what the unsharded model does.

`TensorShard` says which part of a full checkpoint tensor a rank holds: the concatenation,
along one dimension, of index ranges of the full tensor. The loader cuts it while reading
(engine/execution/loader.py), so no rank ever materialises a sharded parameter in full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

IndexRange = tuple[int, int]  # [start, end) in the full tensor's indexing


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among `world_size` ranks joined in `group` (None: the default group).

    The collectives return their result and may reuse the input's storage; at world_size 1 they
    return the input untouched without calling torch.distributed.
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup | None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.world_size})")

    @classmethod
    def single(cls) -> TensorParallel:
        return cls(rank=0, world_size=1, group=None)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks, written into `tensor` (made contiguous first) and returned."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all ranks) concatenated along `dim` in rank order."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)

    def min_over_ranks(self, values: tuple[int, ...], device: torch.device) -> tuple[int, ...]:
        """Elementwise minimum of every rank's `values` (the same length on all ranks), so that
        all ranks decide alike; at world_size 1 the values themselves."""
        if self.world_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return tuple(int(v) for v in tensor.tolist())

    def split_evenly(self, size: int, what: str) -> IndexRange:
        """This rank's range of `size` units split into world_size equal parts; ValueError
        naming `what` if size does not divide."""
        if size % self.world_size != 0:
            raise ValueError(
                f"{what}={size} does not divide by tensor_parallel_size={self.world_size}"
            )
        per_rank = size // self.world_size
        return (self.rank * per_rank, (self.rank + 1) * per_rank)

    def split_padded(self, size: int) -> IndexRange:
        """This rank's range of `size` units cut in pieces of ceil(size / world_size); the last
        ranks get a shorter (possibly empty) piece."""
        per_rank = -(-size // self.world_size)
        start = min(size, self.rank * per_rank)
        return (start, min(size, start + per_rank))


def covering_range(units: IndexRange, units_per_owner: int) -> IndexRange:
    """The owners (KV heads, Mamba groups) that units [start, end) (query heads, Mamba heads)
    belong to, when owner o holds units [o * units_per_owner, (o + 1) * units_per_owner)."""
    start, end = units
    return (start // units_per_owner, -(-end // units_per_owner))


def scaled(index_range: IndexRange, factor: int, offset: int = 0) -> IndexRange:
    """[start, end) in units -> [offset + start * factor, offset + end * factor) in elements."""
    return (offset + index_range[0] * factor, offset + index_range[1] * factor)


class SliceSource(Protocol):
    """A full tensor that can be read in slices (a safetensors slice, or a torch.Tensor)."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class TensorShard:
    """This rank's piece of a checkpoint tensor of `full_shape`: along `dim`, the given
    ranges of the full tensor concatenated in order (other dimensions whole)."""

    full_shape: tuple[int, ...]
    dim: int
    ranges: tuple[IndexRange, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = sum(end - start for start, end in self.ranges)
        return tuple(shape)

    def cut(self, source: SliceSource) -> torch.Tensor:
        """Read only this shard's ranges from `source` and concatenate them."""
        lead = (slice(None),) * self.dim
        parts = [source[(*lead, slice(start, end))] for start, end in self.ranges]
        return torch.cat(parts, dim=self.dim) if len(parts) != 1 else parts[0]


@dataclass(frozen=True)
class StackedPiece:
    """A checkpoint tensor that is one part of a stacked parameter (E, out, in), as checkpoints
    that store experts one by one hold them: the (out_p, in) or (out, in_p) matrix of stacked
    index `index`, starting at `offset` along `dim` (1: rows, 2: columns) of the full stacked
    tensor. engine/execution/loader.py writes this rank's part of it (cut) into the parameter."""

    parameter: str  # the model parameter's name
    index: int
    dim: int  # 1 or 2
    offset: int

    def cut(
        self, source: SliceSource, length: int, shard: TensorShard
    ) -> list[tuple[IndexRange, torch.Tensor]]:
        """The parts of the piece (`length` along `dim`) that fall in the shard's ranges (along
        the same dim): each (its [start, end) in the rank's parameter along dim, the slice of
        `source` read for it)."""
        if shard.dim != self.dim:
            raise ValueError(f"{self.parameter}: a piece along dim {self.dim}, the shard along {shard.dim}")
        lead = (slice(None),) * (self.dim - 1)  # the source has no stacked dimension
        parts, local = [], 0
        for start, end in shard.ranges:
            low, high = max(start, self.offset), min(end, self.offset + length)
            if low < high:
                read = source[(*lead, slice(low - self.offset, high - self.offset))]
                parts.append(((local + low - start, local + high - start), read))
            local += end - start
        return parts


class ShardedModule(nn.Module):
    """A module some of whose parameters are shards of checkpoint tensors.

    checkpoint_shards maps the module's own parameter names ("weight", "bias", ...) to the
    shard this rank holds; a parameter not listed is replicated (held whole on every rank).
    """

    checkpoint_shards: dict[str, TensorShard]

    def __init__(self) -> None:
        super().__init__()
        self.checkpoint_shards = {}


def parameter_shards(model: nn.Module) -> dict[str, TensorShard]:
    """Full parameter name -> TensorShard, for every sharded parameter of `model`."""
    shards: dict[str, TensorShard] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, ShardedModule):
            for leaf, shard in module.checkpoint_shards.items():
                shards[f"{module_name}.{leaf}" if module_name else leaf] = shard
    return shards
