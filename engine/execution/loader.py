"""Load a Hugging Face checkpoint directory into the model of its family (engine/models/registry.py).

Every tensor of every *.safetensors file must map to exactly one model parameter and every
parameter must be filled, with the exact shape; anything else is a ValueError naming the tensor.
Loading shows a progress bar over the shard files' bytes (stderr) and logs the time it took.
Loading one parameter happens in `load_parameter` only: under tensor parallelism it reads just
the rank's shard of the checkpoint tensor (safetensors slices), so no rank holds the full model.
A family whose checkpoints store stacked parameters in pieces (experts one by one) names them
(ModelFamily.stacked_piece): each piece is written into its parameter by `load_piece`, and the
parameter counts as loaded once its pieces cover it.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from engine.model_config import HybridModelConfig
from engine.models.registry import HybridModel, load_model_config, model_family
from engine.parallel.tensor_parallel import SliceSource, StackedPiece, TensorParallel, TensorShard

_TIED_LM_HEAD = "lm_head.weight"

logger = logging.getLogger(__name__)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp: TensorParallel | None = None,
) -> tuple[HybridModel, HybridModelConfig]:
    """Build the model (for rank tp, default unsharded) from config.json and fill it from the
    safetensors files, reading only this rank's shard of each sharded tensor.

    Parameters are cast to `dtype` except those the model keeps in fp32 (Mamba A_log, D,
    dt_bias). The returned model is in eval mode with requires_grad off, its attention
    projections stacked (HybridModel.stack_projections; a later .to() stacks them
    again, see PagedAttention.stack_projections).
    """
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    if torch.device(device).type == "cuda":
        check_cuda_shapes(config)
    family = model_family(config.model_type)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    with torch.device("meta"):
        model = family.build_model(config, dtype, tp)
    expected = dict(model.named_parameters())
    shards = model.parameter_shards()
    loaded: set[str] = set()
    pieces_seen: set[tuple[str, int, int]] = set()  # (parameter, index, offset)
    filled: dict[str, int] = {}  # stacked parameter -> elements its pieces wrote so far
    started = time.monotonic()
    progress = tqdm(total=sum(file.stat().st_size for file in files), unit="B", unit_scale=True,
                    mininterval=1.0, desc=f"loading {model_dir.name} ({len(files)} shards)")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for checkpoint_name in f.keys():
                progress.update(_checkpoint_bytes(f.get_slice(checkpoint_name)))
                if config.tie_word_embeddings and checkpoint_name == _TIED_LM_HEAD:
                    continue  # tied to embed_tokens.weight, as transformers does
                piece = family.stacked_piece(checkpoint_name, config) if family.stacked_piece else None
                if piece is not None:
                    key = (piece.parameter, piece.index, piece.offset)
                    if piece.parameter not in expected or key in pieces_seen:
                        raise ValueError(f"{file.name}: unexpected or repeated tensor {checkpoint_name!r}")
                    pieces_seen.add(key)
                    filled[piece.parameter] = filled.get(piece.parameter, 0) + load_piece(
                        checkpoint_name, piece, model, expected[piece.parameter],
                        f.get_slice(checkpoint_name), shards[piece.parameter], device,
                    )
                    if filled[piece.parameter] == expected[piece.parameter].numel():
                        loaded.add(piece.parameter)
                    continue
                name = family.parameter_name(checkpoint_name)
                if name not in expected:
                    raise ValueError(f"{file.name}: unexpected tensor {checkpoint_name!r}")
                if name in loaded:
                    raise ValueError(f"{file.name}: tensor {checkpoint_name!r} appears twice")
                value = load_parameter(
                    checkpoint_name, expected[name], f.get_slice(checkpoint_name),
                    shards.get(name), device,
                )
                _set_parameter(model, name, value)
                loaded.add(name)
    progress.update(progress.total - progress.n)  # the files' headers
    progress.close()
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks tensors for {missing}")
    model.stack_projections()
    logger.info("loaded %s (%s): %d tensors from %d shard file(s), %.2f GiB, in %.1f s",
                model_dir, "unsharded" if tp is None else f"rank {tp.rank} of {tp.world_size}",
                len(loaded), len(files), progress.total / 2**30, time.monotonic() - started)
    return model.eval(), config


# Bytes per element of the safetensors dtypes (for the progress bar's byte count).
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
                "I16": 2, "U16": 2}


def check_cuda_shapes(config: HybridModelConfig) -> None:
    """ValueError naming the key when the CUDA path's kernels cannot serve the model's shapes:
    the paged attention kernels hold a whole head in one power-of-two tile, so an attention
    head_dim must be a power of two (every published hybrid checkpoint's is: 64, 128, 256)."""
    head_dim = config.head_dim
    if config.attention_layers and head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim}: the CUDA attention kernels need a power of two "
                         "(this model runs on the CPU only)")


def _checkpoint_bytes(source: SliceSource) -> int:
    """Bytes of a checkpoint tensor in its file (1 per element for 8-bit and unknown dtypes)."""
    return math.prod(source.get_shape()) * _DTYPE_BYTES.get(source.get_dtype(), 1)


def load_parameter(
    checkpoint_name: str,
    target: nn.Parameter,
    source: SliceSource,
    shard: TensorShard | None,
    device: str | torch.device,
) -> nn.Parameter:
    """The parameter for `target` (a meta tensor giving shape and dtype) from a checkpoint
    tensor `source` (a safetensors slice, or a tensor): its `shard` cut while reading, or all
    of it when shard is None (a replicated parameter)."""
    full_shape = _full_shape(source)
    expected_full = shard.full_shape if shard is not None else tuple(target.shape)
    if full_shape != expected_full:
        raise ValueError(
            f"tensor {checkpoint_name!r} has shape {full_shape}, the model expects {expected_full}"
        )
    tensor = source[:] if shard is None else shard.cut(source)
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(
            f"tensor {checkpoint_name!r}: shard {tuple(tensor.shape)} is not the parameter's "
            f"shape {tuple(target.shape)}"
        )
    return nn.Parameter(tensor.to(device=device, dtype=target.dtype), requires_grad=False)


def load_piece(
    checkpoint_name: str,
    piece: StackedPiece,
    model: nn.Module,
    target: nn.Parameter,
    source: SliceSource,
    shard: TensorShard,
    device: str | torch.device,
) -> int:
    """Write this rank's part of one piece of a stacked parameter (E, out, in) into it,
    allocating the parameter (empty, target's shape and dtype) at its first piece; returns the
    elements written. ValueError when the piece's shape or place does not fit the full
    stacked tensor."""
    full = _full_shape(source)
    num_stacked, *matrix = shard.full_shape
    other = 3 - piece.dim  # the dimension the piece covers whole
    length = full[piece.dim - 1] if len(full) == 2 else -1
    if (len(full) != 2 or full[other - 1] != matrix[other - 1] or not 0 <= piece.index < num_stacked
            or piece.offset + length > matrix[piece.dim - 1]):
        raise ValueError(
            f"tensor {checkpoint_name!r} of shape {full} does not fit {piece.parameter} "
            f"{tuple(shard.full_shape)} at index {piece.index}, offset {piece.offset}"
        )
    parameter = model.get_parameter(piece.parameter)
    if parameter.is_meta:
        parameter = nn.Parameter(torch.empty(target.shape, dtype=target.dtype, device=device),
                                 requires_grad=False)
        _set_parameter(model, piece.parameter, parameter)
    written = 0
    for (start, end), tensor in piece.cut(source, length, shard):
        where = [piece.index, slice(None), slice(None)]
        where[piece.dim] = slice(start, end)
        parameter.data[tuple(where)] = tensor.to(device=device, dtype=target.dtype)
        written += tensor.numel()
    return written


def _full_shape(source: SliceSource) -> tuple[int, ...]:
    """A safetensors slice reports get_shape(); a torch.Tensor has .shape."""
    if isinstance(source, torch.Tensor):
        return tuple(source.shape)
    return tuple(source.get_shape())


def _set_parameter(model: nn.Module, name: str, value: nn.Parameter) -> None:
    module_path, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(module_path), leaf, value)
