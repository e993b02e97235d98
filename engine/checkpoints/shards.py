"""One rank's side of a checkpoint transfer: gather a bundle into a CheckpointShard, and scatter
a shard into fresh KV blocks and a new bundle (docs/design.md section 5.1).

The engine sends the same op to every rank (ExportShardOp, ImportShardOp; a tensor-parallel
group passes them like steps, engine/execution/rank_worker.py); each rank answers with its own shard or
confirmation. Shard layouts are in engine/checkpoints/transfer.py. The ops run between steps,
with no step in flight: the engine collects its steps first.

Shards by reference (Ray rank actors) are imported in two phases so that a bad copy changes
nothing: every rank resolves its own shard and checks it (StageShardOp, ShardStage.stage,
answering a ShardVerdict); only when every rank accepted does the engine reserve blocks and
have them write what they hold (ImportShardOp with the transfer id, ShardStage.take).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.checkpoints.bundle_store import BundleTensors
from engine.checkpoints.import_checks import ImportRejection, Rejected, check_shard
from engine.checkpoints.transfer import CheckpointShard, ShardLayout, make_shard
from engine.interfaces.forward_batch import ModelCaches
from engine.kernels.attention_reference import select_rows, storage_view


@dataclass(frozen=True)
class ExportShardOp:
    """Gather published bundle `bundle_id` (num_tokens tokens, its full KV blocks block_ids)."""

    bundle_id: int
    block_ids: tuple[int, ...]
    num_tokens: int
    digest: str  # the checkpoint's digest, bound into each shard's checksum


@dataclass(frozen=True)
class ImportShardOp:
    """Write a shard's K/V into the fresh full blocks `block_ids` (num_tokens // B of them) and
    keep its state, tail and hidden row as bundle `bundle_id` (reserved, pending)."""

    bundle_id: int
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class StageShardOp:
    """Check the shard each rank resolved against checkpoint `digest` (num_tokens tokens, rank
    r's layout layouts[r], from the engine-checked header) and hold it as transfer
    `transfer_id` until the engine has it written or discarded."""

    transfer_id: int
    digest: str
    num_tokens: int
    layouts: tuple[ShardLayout, ...]


@dataclass(frozen=True)
class ShardVerdict:
    """A rank's answer to a StageShardOp: rejected None means it holds the shard (nbytes of
    tensors) for the transfer; otherwise why not, and it holds nothing."""

    rank: int
    rejected: Rejected | None
    nbytes: int = 0


class ShardStage:
    """The shard one rank resolved from a reference and checked, held until written or dropped.

    It holds at most one: staging another (the engine imports one checkpoint at a time) drops
    whatever an abandoned transfer left. Touches no cache: writing is Worker.import_shard's.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._held: tuple[int, CheckpointShard] | None = None

    def stage(self, op: StageShardOp, shard: object) -> ShardVerdict:
        """Check `shard` (check_shard against this rank's layout in op) and hold it for
        op.transfer_id if it passes; a rejected one is not held. Drops anything held before."""
        self._held = None
        if self.rank >= len(op.layouts):
            return ShardVerdict(self.rank, Rejected(ImportRejection.MALFORMED, f"no layout for rank {self.rank}"))
        rejected = check_shard(shard, self.rank, op.layouts[self.rank], op.num_tokens, op.digest)
        if rejected is not None:
            return ShardVerdict(self.rank, rejected)
        assert isinstance(shard, CheckpointShard)
        self._held = (op.transfer_id, shard)
        return ShardVerdict(self.rank, None, shard.nbytes)

    def take(self, transfer_id: int) -> CheckpointShard | None:
        """The shard held for `transfer_id`, no longer held; None when none is."""
        if self._held is None or self._held[0] != transfer_id:
            return None
        shard, self._held = self._held[1], None
        return shard

    def discard(self, transfer_id: int) -> None:
        """Drop the shard held for `transfer_id` (no-op for another or none)."""
        if self._held is not None and self._held[0] == transfer_id:
            self._held = None


def gather_shard(
    caches: ModelCaches, bundle: BundleTensors, block_ids: tuple[int, ...], num_tokens: int,
    rank: int, digest: str,
) -> CheckpointShard:
    """Rank `rank`'s shard of `bundle`: its state and hidden row, and the K/V of all num_tokens
    tokens (the full blocks' rows from the caches, then the bundle's tail), copied to the CPU.
    Reads only."""
    kv = _bundle_kv(caches, bundle, block_ids, num_tokens)
    return make_shard(rank, digest, bundle.conv_state, bundle.ssm_state, kv, bundle.hidden_row)


def gather_host_shard(
    caches: ModelCaches, bundle: BundleTensors, block_ids: tuple[int, ...], num_tokens: int, rank: int,
) -> CheckpointShard:
    """gather_shard for the host tier (engine/checkpoints/host_tier.py), without waiting for
    the device: on cuda the tensors are copied into pinned memory by non-blocking copies queued
    on the current stream, valid once it has passed them (record an event after this); on cpu
    the K/V rows are gathered and the bundle's own tensors, which nothing changes, are shared.
    No checksum (""): the shard stays in this process. Reads only."""
    kv = _bundle_kv(caches, bundle, block_ids, num_tokens)
    tensors = {"conv_state": bundle.conv_state, "ssm_state": bundle.ssm_state, "kv": kv,
               "hidden_row": bundle.hidden_row}
    if kv.device.type == "cuda":
        tensors = {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                   for name, t in tensors.items()}
    return CheckpointShard(rank=rank, checksum="", **tensors)


def _bundle_kv(caches: ModelCaches, bundle: BundleTensors, block_ids: tuple[int, ...], num_tokens: int) -> torch.Tensor:
    """(2, L_a, p, Hkv, Dh): the K/V of the bundle's p = num_tokens tokens, the full blocks'
    rows from the caches (a copy), then the bundle's tail."""
    block_size = caches.block_size
    if len(block_ids) != num_tokens // block_size:
        raise ValueError(f"{num_tokens} tokens need {num_tokens // block_size} full blocks, got {len(block_ids)}")
    kv_blocks = _gather_blocks(caches, block_ids)  # (2, L_a, n, B, Hkv, Dh)
    two, layers, n, _, heads, head_dim = kv_blocks.shape
    kv = kv_blocks.reshape(two, layers, n * block_size, heads, head_dim)
    if bundle.tail_kv is not None:  # (2, L_a, p, Hkv, Dh)
        kv = torch.cat([storage_view(kv), storage_view(bundle.tail_kv.to(kv.dtype))], dim=2).view(kv.dtype)
    return kv


def shard_misfit(
    caches: ModelCaches, shard: CheckpointShard, op: ImportShardOp, hidden_size: int, hidden_dtype: torch.dtype,
) -> str | None:
    """Why `shard` cannot be written into these caches for `op` (dtype or per-layer shape of a
    tensor, K/V rows, blocks), or None if it fits; hidden_dtype: the model's (the hidden row's;
    the K/V's is the caches', FP8 or the model's). Reads only."""
    shapes = _cache_shapes(caches)
    (kv_shape, kv_dtype), (conv, conv_dtype), (ssm, ssm_dtype) = shapes["kv"], shapes["conv"], shapes["ssm"]
    block_size = caches.block_size
    wanted = {
        "conv_state": ((conv[0], *conv[2:]), conv_dtype),
        "ssm_state": ((ssm[0], *ssm[2:]), ssm_dtype),
        "kv": ((*kv_shape[:2], op.num_tokens, *kv_shape[4:]), kv_dtype),
        "hidden_row": ((hidden_size,), hidden_dtype),
    }
    for name, tensor in shard.tensors().items():
        shape, dtype = wanted[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            return f"{name} is {tensor.dtype} {tuple(tensor.shape)}, the caches need {dtype} {shape}"
    if len(op.block_ids) != op.num_tokens // block_size:
        return f"{len(op.block_ids)} blocks for {op.num_tokens} tokens"
    if len(set(op.block_ids)) != len(op.block_ids) or (op.block_ids and (
            min(op.block_ids) < 0 or max(op.block_ids) >= kv_shape[2])):
        return "a block id repeated or outside the caches"
    return None


def scatter_shard(caches: ModelCaches, shard: CheckpointShard, block_ids: tuple[int, ...]) -> BundleTensors:
    """Write the shard's full-block K/V rows into `block_ids` of every attention layer and
    return its state, tail (the last p % B rows) and hidden row as bundle tensors on the
    caches' device. Writes only those blocks; check shard_misfit first."""
    device = caches.key_cache[min(caches.key_cache)].device
    block_size = caches.block_size
    kv = shard.kv.to(device)  # (2, L_a, p, Hkv, Dh)
    two, layers, num_tokens, heads, head_dim = kv.shape
    full = len(block_ids) * block_size
    if block_ids:
        rows = kv[:, :, :full].reshape(two, layers, len(block_ids), block_size, heads, head_dim)
        index = torch.tensor(block_ids, dtype=torch.int64, device=device)
        if caches.kv_stack is not None:
            storage_view(caches.kv_stack).index_copy_(2, index, storage_view(rows))
        else:
            for j, layer in enumerate(sorted(caches.key_cache)):
                storage_view(caches.key_cache[layer]).index_copy_(0, index, storage_view(rows[0, j]))
                storage_view(caches.value_cache[layer]).index_copy_(0, index, storage_view(rows[1, j]))
    tail = kv[:, :, full:].clone() if num_tokens > full else None
    return BundleTensors(
        conv_state=shard.conv_state.to(device, copy=True),
        ssm_state=shard.ssm_state.to(device, copy=True),
        tail_kv=tail,
        hidden_row=shard.hidden_row.to(device, copy=True),
    )


def _gather_blocks(caches: ModelCaches, block_ids: tuple[int, ...]) -> torch.Tensor:
    """(2, L_a, n, B, Hkv, Dh): a copy of blocks `block_ids` of every attention layer."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=caches.key_cache[min(caches.key_cache)].device)
    if caches.kv_stack is not None:
        return select_rows(caches.kv_stack, index, dim=2)
    layers = sorted(caches.key_cache)
    return torch.stack([torch.stack([select_rows(caches.key_cache[l], index) for l in layers]),
                        torch.stack([select_rows(caches.value_cache[l], index) for l in layers])])


def _cache_shapes(caches: ModelCaches) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of the stacks (real or as if stacked): "kv" (2, L_a, num_blocks, B, Hkv,
    Dh), "conv" (L_m, slots, conv_dim, K-1), "ssm" (L_m, slots, H, P, N). Copies nothing."""
    def stacked(layers: dict[int, torch.Tensor], lead: tuple[int, ...]) -> tuple[tuple[int, ...], torch.dtype]:
        first = layers[min(layers)]
        return (*lead, len(layers), *first.shape), first.dtype

    return {"kv": stacked(caches.key_cache, (2,)), "conv": stacked(caches.conv_state, ()),
            "ssm": stacked(caches.ssm_state, ())}
