"""Model families, keyed by config.json's `model_type`: how to read a checkpoint directory's
config and build the model the engine runs.

A family is one module under engine/models/ that provides MODEL_TYPE, `parse_config(raw) ->
HybridModelConfig` and the model class; its shared layers come from engine/layers/. The engine
sees only the `HybridModel` protocol below, so adding a family touches this table and nothing
in the step loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.interfaces.forward_batch import ForwardBatch, ModelCaches
from engine.model_config import HybridModelConfig
from engine.models import bamba, falcon_h1
from engine.models import granite_moe_hybrid
from engine.models import nemotron_h, nemotron_h_moe
from engine.models import qwen3_next
from engine.parallel.tensor_parallel import StackedPiece, TensorParallel, TensorShard


class HybridModel(Protocol):
    """What the engine calls on a model (engine/execution/worker.py, forward_routes.py, cuda_graphs.py,
    loader.py). GraniteMoeHybridModel documents each method's contract."""

    config: HybridModelConfig
    tp: TensorParallel
    # The multi-token-prediction head (engine/models/mtp_head.py), or None: Qwen3-Next's mtp.*
    # weights, or a random one a GraniteMoeHybrid model attaches (random_mtp_head).
    mtp: Any

    def __call__(self, batch: ForwardBatch, caches: ModelCaches, gpu_plan: Any = None) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def folds_gated_norm(self) -> bool: ...
    def stack_projections(self) -> None: ...
    def parameter_shards(self) -> dict[str, TensorShard]: ...
    def allocate_caches(self, num_blocks: int, block_size: int, num_state_slots: int,
                        device: Any = None, drafter_layers: tuple[int, ...] = (),
                        kv_scale: torch.Tensor | None = None) -> ModelCaches: ...


def strip_model_prefix(checkpoint_name: str) -> str:
    """The usual checkpoint naming: "model.layers.0..." -> "layers.0..."; lm_head.weight as is."""
    return checkpoint_name.removeprefix("model.")


@dataclass(frozen=True)
class ModelFamily:
    """One supported architecture.

    parse_config: config.json dict -> HybridModelConfig; ValueError naming the key it refuses.
    build_model: (config, dtype, tp or None for unsharded) -> the model, on the current device
        (the loader builds it on the meta device and fills it).
    parameter_name: checkpoint tensor name -> model parameter name.
    stacked_piece: (checkpoint tensor name, the parsed config) -> the StackedPiece it is of a
        stacked parameter (experts stored one by one), or None for a tensor parameter_name maps
        whole; None (the default): every tensor maps whole.
    complete_config: (config.json dict, the checkpoint's tensor names) -> the dict with the
        keys a release leaves implicit filled from its tensors (Qwen3-Next's MTP layers);
        None (the default): config.json says everything.
    """

    model_type: str
    parse_config: Callable[[dict[str, Any]], HybridModelConfig]
    build_model: Callable[[HybridModelConfig, torch.dtype, TensorParallel | None], HybridModel]
    parameter_name: Callable[[str], str] = strip_model_prefix
    stacked_piece: Callable[[str, HybridModelConfig], StackedPiece | None] | None = None
    complete_config: Callable[[dict[str, Any], list[str]], dict[str, Any]] | None = None


FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family
    for family in (
        ModelFamily(
            model_type=granite_moe_hybrid.MODEL_TYPE,
            parse_config=granite_moe_hybrid.parse_config,
            build_model=granite_moe_hybrid.GraniteMoeHybridModel,
        ),
        ModelFamily(
            model_type=bamba.MODEL_TYPE,
            parse_config=bamba.parse_config,
            build_model=bamba.BambaModel,
            parameter_name=bamba.parameter_name,
        ),
        ModelFamily(
            model_type=falcon_h1.MODEL_TYPE,
            parse_config=falcon_h1.parse_config,
            build_model=falcon_h1.FalconH1Model,
            parameter_name=bamba.parameter_name,  # Falcon-H1 names its tensors as Bamba does
        ),
        ModelFamily(
            model_type=nemotron_h.MODEL_TYPE,
            parse_config=nemotron_h.parse_config,
            build_model=nemotron_h.NemotronHModel,
            parameter_name=nemotron_h.parameter_name,
            stacked_piece=nemotron_h_moe.stacked_piece,
        ),
        ModelFamily(
            model_type=qwen3_next.MODEL_TYPE,
            parse_config=qwen3_next.parse_config,
            build_model=qwen3_next.Qwen3NextModel,
            parameter_name=qwen3_next.parameter_name,
            stacked_piece=qwen3_next.stacked_piece,
            complete_config=qwen3_next.complete_config,
        ),
    )
}

# config.json files without a model_type predate the field; they are GraniteMoeHybrid.
DEFAULT_MODEL_TYPE = granite_moe_hybrid.MODEL_TYPE


def model_family(model_type: str) -> ModelFamily:
    """The family for a config.json model_type; ValueError listing the supported ones."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}"
        )
    return family


def parse_model_config(raw: dict[str, Any]) -> HybridModelConfig:
    """Normalise a config.json dict through its family's parser; ValueError naming the key."""
    return model_family(raw.get("model_type", DEFAULT_MODEL_TYPE)).parse_config(raw)


def load_model_config(model_dir: str | Path) -> HybridModelConfig:
    """Read `model_dir/config.json` (completed from the checkpoint's tensor names for a family
    with ModelFamily.complete_config); raises FileNotFoundError or ValueError."""
    with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
        raw = json.load(f)
    family = model_family(raw.get("model_type", DEFAULT_MODEL_TYPE))
    if family.complete_config is not None:
        raw = family.complete_config(raw, checkpoint_tensor_names(model_dir))
    return family.parse_config(raw)


def checkpoint_tensor_names(model_dir: str | Path) -> list[str]:
    """The tensor names of a checkpoint directory: model.safetensors.index.json's weight map
    when there is one, else the headers of its *.safetensors files (no tensor data read)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    names: list[str] = []
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names += list(f.keys())
    return names


def build_model(config: HybridModelConfig, dtype: torch.dtype = torch.float32,
                tp: TensorParallel | None = None) -> HybridModel:
    """The model of config's family for rank tp (None: unsharded)."""
    return model_family(config.model_type).build_model(config, dtype, tp)
