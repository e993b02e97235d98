"""What an engine checks of an ExportedCheckpoint before it touches its caches (docs/design.md
section 5.1). Pure checks: nothing here changes anything.

The checks run in a fixed order and the first failure names the rejection:

    malformed        not an ExportedCheckpoint, another format version, an unknown kind, no
                     tokens, token ids outside the vocabulary or more than max_model_len of
                     them, not one shard per rank in rank order, a tensor not on the CPU
    model            another model directory, config.json, weights layout or dtype
    tensor_parallel  captured at another tensor_parallel_size
    block_size       captured with another KV block size
    kv_cache         its K/V stored in another KV format (kv_cache_dtype, or FP8 with other
                     scales): an FP8 checkpoint never enters a bf16 engine, nor the reverse
    namespace        the namespace is not this engine's (its model directory)
    digest           the namespace and token ids do not match the header's digest
    shape            a layout or tensor whose dtype or per-layer shape differs from this
                     engine's caches on that rank
    length           K/V rows that are not exactly one per covered token
    checksum         a shard whose bytes do not match its checksum

The engine adds `disabled` (its checkpoints are off), `no_space` (the KV blocks or checkpoint
bytes do not fit after evictions) and `worker` (a rank refused or failed the copy).

Shards by value are checked here in full (`check_exported`), but for a checkpoint that never
left this process (the host tier's, `verified`): its tensors may already be on the engine's
device, its digest and checksum, which this engine computed, are not recomputed (the digest
alone is a pass over every token id: about 0.5 ms at 4,000 tokens on the 2-core VM, in a
promotion that then copies the bundle), and its token ids, which this engine checked when it
admitted their request, are not scanned for their range again. Shards by reference (RemoteShard)
are never in the engine's process: the engine checks the header (`check_header`) and each rank
checks the shard it resolved with `check_shard` (shape, length, checksum), the same checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from cache.checkpoint_keys import CheckpointKind
from engine.checkpoints.transfer import (
    FORMAT_VERSION, CheckpointHeader, CheckpointShard, ExportedCheckpoint, ModelIdentity,
    ShardLayout, checkpoint_digest, shard_checksum,
)
from engine.model_config import HybridModelConfig
from engine.parallel.cache_capacity import recurrent_state_shape
from engine.parallel.shard_layout import rank_shard_layout, width
from engine.parallel.tensor_parallel import TensorParallel


class ImportRejection(str, Enum):
    MALFORMED = "malformed"
    MODEL = "model"
    TENSOR_PARALLEL = "tensor_parallel"
    BLOCK_SIZE = "block_size"
    KV_CACHE = "kv_cache"
    NAMESPACE = "namespace"
    DIGEST = "digest"
    SHAPE = "shape"
    LENGTH = "length"
    CHECKSUM = "checksum"
    DISABLED = "disabled"
    NO_SPACE = "no_space"
    WORKER = "worker"


@dataclass(frozen=True)
class Rejected:
    reason: ImportRejection
    detail: str  # for logs: what differed


@dataclass(frozen=True)
class ImportExpectations:
    """What this engine accepts: its model, split, block size, KV format and per-rank layouts."""

    model: ModelIdentity
    tensor_parallel_size: int
    block_size: int
    layouts: tuple[ShardLayout, ...]  # per rank
    vocab_size: int
    max_model_len: int
    kv_cache: str = "auto"  # KvCacheFormat.identity of this engine's KV blocks


def expected_shard_layout(
    config: HybridModelConfig, tp: TensorParallel, dtype: str, num_drafter_layers: int = 0,
    kv_dtype: str | None = None,
) -> ShardLayout:
    """The layout of rank tp.rank's shard for a model run in `dtype` (from its config alone;
    the same shapes Model.allocate_caches gives that rank), its K/V over the attention layers
    and num_drafter_layers more (the MTP drafter's, engine/parallel/cache_capacity.py drafter_kv_layers):
    an engine drafting with MTP and one that does not refuse each other's checkpoints (shape).
    kv_dtype: the K/V's dtype name when the KV blocks hold another ("float8_e4m3fn")."""
    layout = rank_shard_layout(config, tp)
    (conv_dim, taps), (heads, head_dim, state_size) = recurrent_state_shape(config, layout)
    num_recurrent = len(config.recurrent_layers)
    num_attention = len(config.attention_layers) + num_drafter_layers
    return ShardLayout(
        conv_state=(num_recurrent, conv_dim, taps),
        ssm_state=(num_recurrent, heads, head_dim, state_size),
        kv_row=(num_attention, width(layout.kv_heads), config.head_dim),
        hidden_size=config.hidden_size,
        dtype=dtype,
        kv_dtype=kv_dtype if kv_dtype != dtype else None,
    )


def check_exported(exported: object, expected: ImportExpectations, verified: bool = False) -> Rejected | None:
    """The first check `exported` (shards by value) fails, in the order of the module doc, or
    None if it passes them all. Reads only; checksums cost one pass over the shards' bytes.
    Shards by reference pass only the header's checks here (see check_header). verified: the
    checkpoint never left this process (this engine exported it); its tensors may be on any
    device, and what this engine computed or checked before (the checksums, the digest, the
    token ids' range) is not computed or scanned again; every size and shape is checked."""
    rejected = check_header(exported, expected, verified)
    if rejected is not None or exported.by_reference:
        return rejected
    header = exported.header
    for rank, shard in enumerate(exported.shards):
        rejected = _check_shard_layout(shard, expected.layouts[rank], header.num_tokens)
        if rejected is not None:
            return rejected
    for rank, shard in enumerate(exported.shards):
        if not verified and shard_checksum(rank, header.digest, shard.tensors()) != shard.checksum:
            return Rejected(ImportRejection.CHECKSUM, f"rank {rank}'s shard does not match its checksum")
    return None


def check_header(exported: object, expected: ImportExpectations, verified: bool = False) -> Rejected | None:
    """The checks of the module doc up to `shape` for the layouts (malformed, model,
    tensor_parallel, block_size, kv_cache, namespace, digest, the header's layouts), none of a shard's
    tensors: what the engine checks of a checkpoint whose shards are references. Reads only.
    verified: shards by value may hold tensors on any device; the token ids are not scanned
    and the digest not recomputed (this engine made both)."""
    if not isinstance(exported, ExportedCheckpoint):
        return Rejected(ImportRejection.MALFORMED, f"not an ExportedCheckpoint: {type(exported).__name__}")
    rejected = _check_header(exported, expected, verified)
    return rejected if rejected is not None else _check_identity(exported, expected, verified)


def check_shard(shard: object, rank: int, layout: ShardLayout, num_tokens: int, digest: str) -> Rejected | None:
    """What the rank `rank` checks of the shard it resolved from a reference, against the
    checkpoint's (already checked) header: a CheckpointShard of this rank holding CPU tensors
    (malformed), the layout's dtypes and shapes (shape), one K/V row per token (length), its
    checksum over `digest` (checksum). Reads only; one pass over the shard's bytes."""
    if not isinstance(shard, CheckpointShard) or shard.rank != rank:
        return Rejected(ImportRejection.MALFORMED, f"rank {rank} got {type(shard).__name__} "
                        f"{getattr(shard, 'rank', '?')}, not its own CheckpointShard")
    if any(not isinstance(t, torch.Tensor) or t.device.type != "cpu" for t in shard.tensors().values()):
        return Rejected(ImportRejection.MALFORMED, f"rank {rank}'s shard holds something that is not a CPU tensor")
    rejected = _check_shard_layout(shard, layout, num_tokens)
    if rejected is not None:
        return rejected
    if shard_checksum(rank, digest, shard.tensors()) != shard.checksum:
        return Rejected(ImportRejection.CHECKSUM, f"rank {rank}'s shard does not match its checksum")
    return None


def _check_header(exported: ExportedCheckpoint, expected: ImportExpectations, verified: bool) -> Rejected | None:
    """The header is well formed and there is one shard per rank, in order."""
    header = exported.header
    bad = lambda detail: Rejected(ImportRejection.MALFORMED, detail)  # noqa: E731
    if not isinstance(header, CheckpointHeader) or not isinstance(exported.shards, (tuple, list)):
        return bad("the header or the shards are not what export_checkpoint makes")
    if header.format_version != FORMAT_VERSION:
        return bad(f"format version {header.format_version}, this engine reads {FORMAT_VERSION}")
    if header.kind not in set(CheckpointKind):
        return bad(f"unknown kind {header.kind!r}")
    tokens = header.token_ids
    if not isinstance(tokens, tuple) or not tokens or len(tokens) > expected.max_model_len:
        return bad(f"token ids must be a tuple of 1 to {expected.max_model_len}")
    # C-level passes (a generator over 8,000 ids costs milliseconds); bool and other int
    # subclasses are refused. A verified checkpoint's ids are those of a request this engine
    # admitted (checked then), so they are not scanned again.
    if not verified and (set(map(type, tokens)) != {int} or min(tokens) < 0 or max(tokens) >= expected.vocab_size):
        return bad(f"token ids must be ints in [0, {expected.vocab_size})")
    if len(header.layouts) != header.tensor_parallel_size or len(exported.shards) != header.tensor_parallel_size:
        return bad(f"{len(exported.shards)} shards and {len(header.layouts)} layouts for "
                   f"tensor_parallel_size {header.tensor_parallel_size}")
    if exported.by_reference:  # each rank checks its own object (check_shard)
        if any(shard.rank != rank for rank, shard in enumerate(exported.shards)):
            return bad("the shard references are not in rank order")
        return None
    for rank, shard in enumerate(exported.shards):
        if not isinstance(shard, CheckpointShard) or shard.rank != rank:
            return bad(f"shard {rank} is not rank {rank}'s")
        if any(not isinstance(t, torch.Tensor) or (t.device.type != "cpu" and not verified)
               for t in shard.tensors().values()):
            return bad(f"rank {rank}'s shard holds something that is not a CPU tensor")
    return None


def _check_identity(exported: ExportedCheckpoint, expected: ImportExpectations,
                    verified: bool = False) -> Rejected | None:
    """Same model, split, block size and KV format; the namespace is this engine's and matches
    the digest (not recomputed when `verified`: this engine computed it)."""
    header = exported.header
    if header.model != expected.model:
        return Rejected(ImportRejection.MODEL, f"captured by {header.model}, this engine runs {expected.model}")
    if header.tensor_parallel_size != expected.tensor_parallel_size:
        return Rejected(ImportRejection.TENSOR_PARALLEL, f"tensor_parallel_size {header.tensor_parallel_size}, "
                        f"this engine runs {expected.tensor_parallel_size}")
    if header.block_size != expected.block_size:
        return Rejected(ImportRejection.BLOCK_SIZE, f"block_size {header.block_size}, "
                        f"this engine uses {expected.block_size}")
    if header.kv_cache != expected.kv_cache:
        return Rejected(ImportRejection.KV_CACHE, f"K/V stored as {header.kv_cache!r}, "
                        f"this engine's KV cache is {expected.kv_cache!r}")
    namespace = header.namespace
    if (not isinstance(namespace, tuple) or len(namespace) != 2
            or not all(isinstance(part, str) for part in namespace)
            or namespace[0] != expected.model.model_dir):
        return Rejected(ImportRejection.NAMESPACE, f"namespace {namespace!r} is not this engine's")
    if not verified and checkpoint_digest(namespace, header.token_ids) != header.digest:
        return Rejected(ImportRejection.DIGEST, "the namespace and token ids do not match the digest")
    if header.layouts != expected.layouts:
        return Rejected(ImportRejection.SHAPE, f"layouts {header.layouts}, this engine's {expected.layouts}")
    return None


def _check_shard_layout(shard: CheckpointShard, layout: ShardLayout, num_tokens: int) -> Rejected | None:
    """Every tensor of `shard` has the layout's dtype and per-layer shape; kv has one row per
    covered token."""
    wanted = {
        "conv_state": (layout.conv_state, layout.dtype),
        "ssm_state": (layout.ssm_state, layout.ssm_dtype),
        "hidden_row": ((layout.hidden_size,), layout.dtype),
    }
    for name, tensor in shard.tensors().items():
        if name == "kv":
            continue
        shape, dtype = wanted[name]
        if tuple(tensor.shape) != shape or tensor.dtype != getattr(torch, dtype):
            return Rejected(ImportRejection.SHAPE, f"rank {shard.rank}'s {name} is {tensor.dtype} "
                            f"{tuple(tensor.shape)}, this engine needs {dtype} {shape}")
    kv = shard.kv
    expected_kv = layout.kv_shape(num_tokens)
    if kv.dtype != getattr(torch, layout.kv_storage_dtype) or kv.dim() != 5 or (
            kv.shape[:2] + kv.shape[3:]) != (expected_kv[:2] + expected_kv[3:]):
        return Rejected(ImportRejection.SHAPE, f"rank {shard.rank}'s kv is {kv.dtype} {tuple(kv.shape)}, "
                        f"this engine needs {layout.kv_storage_dtype} {expected_kv}")
    if kv.shape[2] != num_tokens:
        return Rejected(ImportRejection.LENGTH, f"rank {shard.rank}'s kv holds {kv.shape[2]} token rows "
                        f"for {num_tokens} tokens")
    return None
