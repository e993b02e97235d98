"""The exchange format of a checkpoint moved between engines (docs/design.md section 5.1).

An ExportedCheckpoint is one published bundle as plain picklable objects: a CheckpointHeader
(what it covers and which model, tensor-parallel split and block size it was captured with)
and one CheckpointShard per tensor-parallel rank, in rank order. A shard is everything that
rank needs to restore the bundle, as CPU tensors:

    conv_state  (L_mamba, conv_dim, K-1)      model dtype   the rank's conv channels at p
    ssm_state   (L_mamba, H, P, N)            fp32          the rank's SSM heads at p
    kv          (2, L_attention, p, Hkv, Dh)  KV dtype      keys [0] and values [1] of all p
                                                            covered tokens, the rank's KV heads;
                                                            the last p % B rows are the bundle's
                                                            attention tail, the others fill
                                                            p // B full KV blocks
    hidden_row  (D,)                          model dtype   the final hidden row at p - 1

(the KV dtype is the caches' own: the model dtype, or float8_e4m3fn with an FP8 KV cache,
whose bytes are meaningful only with the scales they were written with: the header's kv_cache
names the format and a digest of its scales, engine/parallel/kv_cache_format.py)

and a checksum over the rank, the checkpoint's digest (namespace and token ids) and every
tensor's dtype, shape and bytes, so a shard is verified on its own and cannot be mixed into
another checkpoint. The header and each shard are separate objects so that each rank can put
its own shard into an object store and the importer fetch them rank by rank; the importing
engine checks everything (engine/checkpoints/import_checks.py) before it touches its caches.

A shard travels either as a value (CheckpointShard: in process, spawned ranks) or as a
RemoteShard, a reference to the object its rank put into Ray's object store (Ray rank actors,
deployments/worker_group.py): the engine's process then sees the header and the references
only, and each rank of the importing engine resolves and checks its own shard.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from cache.checkpoint_keys import CheckpointKind, Namespace

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ModelIdentity:
    """Which weights, run how, a checkpoint's tensors come from. Two engines agree only if all
    five do.

    weights_digest covers each safetensors file's name, size and header (tensor names, dtypes,
    shapes, offsets), not the weight values: hashing the values would cost a pass over every
    weight. A model directory must therefore name one fixed set of weights. device_type keeps
    states computed by the CPU path and the GPU kernels apart (they agree only within
    floating-point tolerance, and a restore must match what this engine computes itself).
    """

    model_dir: str
    config_sha256: str  # of config.json's bytes
    weights_digest: str
    dtype: str  # EngineConfig.dtype the model runs in
    device_type: str  # "cpu" or "cuda"


def model_identity(model_dir: str, dtype: str, device_type: str) -> ModelIdentity:
    """The identity of the model in `model_dir` run in `dtype` on `device_type` (reads
    config.json and the safetensors headers only)."""
    directory = Path(model_dir)
    config_sha = hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()
    weights = hashlib.sha256()
    for path in sorted(directory.glob("*.safetensors")):
        with path.open("rb") as file:
            header_len = int.from_bytes(file.read(8), "little")
            header = file.read(header_len)
        weights.update(f"{path.name}:{path.stat().st_size}:".encode())
        weights.update(header)
    return ModelIdentity(str(model_dir), config_sha, weights.hexdigest(), dtype, device_type)


def checkpoint_digest(namespace: tuple[str, str], token_ids: tuple[int, ...]) -> str:
    """sha256 of the namespace and token ids a checkpoint covers (hex)."""
    canonical = json.dumps([list(namespace), list(token_ids)], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class ShardLayout:
    """The shapes and dtypes of one rank's shard, but for the token axis of kv."""

    conv_state: tuple[int, ...]  # (L_mamba, conv_dim, K-1)
    ssm_state: tuple[int, ...]  # (L_mamba, H, P, N)
    kv_row: tuple[int, ...]  # (L_attention, Hkv, Dh): kv is (2, L_attention, p, Hkv, Dh)
    hidden_size: int  # D
    dtype: str  # of conv_state, hidden_row and (unless kv_dtype says otherwise) kv
    ssm_dtype: str = "float32"
    kv_dtype: str | None = None  # of kv when it is not `dtype`: "float8_e4m3fn" (FP8 KV cache)

    @property
    def kv_storage_dtype(self) -> str:
        """The dtype name of kv: kv_dtype, else dtype."""
        return self.kv_dtype or self.dtype

    def kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        layers, heads, head_dim = self.kv_row
        return (2, layers, num_tokens, heads, head_dim)

    def nbytes(self, num_tokens: int) -> int:
        """Tensor bytes of a shard of this layout covering num_tokens tokens."""
        size = getattr(torch, self.dtype).itemsize
        count = lambda shape: math.prod(shape)  # noqa: E731
        return (size * (count(self.conv_state) + self.hidden_size)
                + getattr(torch, self.kv_storage_dtype).itemsize * count(self.kv_shape(num_tokens))
                + getattr(torch, self.ssm_dtype).itemsize * count(self.ssm_state))


@dataclass(frozen=True)
class CheckpointHeader:
    """What an exported checkpoint covers and what it was captured with (no tensors)."""

    namespace: Namespace
    token_ids: tuple[int, ...]
    digest: str  # checkpoint_digest(namespace, token_ids)
    kind: CheckpointKind  # checked on import (import_checks)
    owner: str  # the tenant that captured it ("" without API keys)
    model: ModelIdentity
    tensor_parallel_size: int
    block_size: int
    layouts: tuple[ShardLayout, ...]  # per rank
    format_version: int = FORMAT_VERSION
    kv_cache: str = "auto"  # the KV format its K/V bytes are in (KvCacheFormat.identity)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class CheckpointShard:
    """One rank's tensors of an exported checkpoint (CPU; layouts in the module doc)."""

    rank: int
    conv_state: torch.Tensor
    ssm_state: torch.Tensor
    kv: torch.Tensor
    hidden_row: torch.Tensor
    checksum: str  # shard_checksum(rank, digest, tensors)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"conv_state": self.conv_state, "ssm_state": self.ssm_state, "kv": self.kv,
                "hidden_row": self.hidden_row}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass(frozen=True)
class RemoteShard:
    """Rank `rank`'s CheckpointShard as an object in Ray's object store, not in this process.

    `ref` (a ray.ObjectRef; the engine does not import Ray) resolves to the CheckpointShard.
    rank and nbytes are what the rank that put it said: nothing here is verified, the rank that
    takes the shard checks the object itself (engine/checkpoint_shards.ShardStage). The object
    lives as long as its owner (the rank actor that put it, or the index actor that keeps a
    stored copy) and some reference to it.
    """

    rank: int
    nbytes: int  # tensor bytes of the shard, as its rank reported them
    ref: object


@dataclass(frozen=True)
class ExportedCheckpoint:
    """A published bundle, ready to cross to another engine: header and one shard per rank,
    all values (CheckpointShard) or all references (RemoteShard)."""

    header: CheckpointHeader
    shards: tuple[CheckpointShard | RemoteShard, ...]  # shards[r] is rank r's (a list is accepted too)

    @property
    def nbytes(self) -> int:
        """Tensor bytes of every shard (for references: as their ranks reported them)."""
        return sum(shard.nbytes for shard in self.shards)

    @property
    def by_reference(self) -> bool:
        """Its shards are references (RemoteShard), not values."""
        return bool(self.shards) and all(isinstance(shard, RemoteShard) for shard in self.shards)


def shard_checksum(rank: int, digest: str, tensors: dict[str, torch.Tensor]) -> str:
    """blake2b over the rank, the checkpoint digest and each tensor's name, dtype, shape and
    bytes (hex). Tensors must be on the CPU."""
    h = hashlib.blake2b(digest_size=32)
    h.update(f"v{FORMAT_VERSION}:rank{rank}:{digest}".encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        h.update(f"|{name}:{tensor.dtype}:{tuple(tensor.shape)}|".encode())
        h.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def make_shard(
    rank: int, digest: str, conv_state: torch.Tensor, ssm_state: torch.Tensor, kv: torch.Tensor,
    hidden_row: torch.Tensor,
) -> CheckpointShard:
    """A shard of CPU copies of the given tensors, with its checksum."""
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in
               {"conv_state": conv_state, "ssm_state": ssm_state, "kv": kv,
                "hidden_row": hidden_row}.items()}
    return CheckpointShard(rank=rank, checksum=shard_checksum(rank, digest, tensors), **tensors)
