"""Load a Hugging Face GraniteMoeHybrid checkpoint directory into GraniteMoeHybridModel.

Every tensor of every *.safetensors file must map to exactly one model parameter and every
parameter must be filled, with the exact shape; anything else is a ValueError naming the tensor.
Loading one parameter happens in `load_parameter` only (tensor parallelism will cut each
parameter's shard there).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.model_config import HybridModelConfig, load_model_config
from engine.models.granite_moe_hybrid import GraniteMoeHybridModel

_TIED_LM_HEAD = "lm_head.weight"


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[GraniteMoeHybridModel, HybridModelConfig]:
    """Build the model from config.json and fill it from the safetensors files.

    Parameters are cast to `dtype` except those the model keeps in fp32 (Mamba A_log, D,
    dt_bias). The returned model is in eval mode with requires_grad off.
    """
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    with torch.device("meta"):
        model = GraniteMoeHybridModel(config, dtype=dtype)
    expected = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for checkpoint_name in f.keys():
                if config.tie_word_embeddings and checkpoint_name == _TIED_LM_HEAD:
                    continue  # tied to embed_tokens.weight, as transformers does
                name = parameter_name(checkpoint_name)
                if name not in expected:
                    raise ValueError(f"{file.name}: unexpected tensor {checkpoint_name!r}")
                if name in loaded:
                    raise ValueError(f"{file.name}: tensor {checkpoint_name!r} appears twice")
                value = load_parameter(checkpoint_name, expected[name], f.get_tensor(checkpoint_name), device)
                _set_parameter(model, name, value)
                loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks tensors for {missing}")
    return model.eval(), config


def parameter_name(checkpoint_name: str) -> str:
    """Checkpoint tensor name -> model parameter name ("model.layers.0..." -> "layers.0...")."""
    return checkpoint_name.removeprefix("model.")


def load_parameter(
    checkpoint_name: str, target: nn.Parameter, tensor: torch.Tensor, device: str | torch.device
) -> nn.Parameter:
    """The parameter for `target` (a meta tensor giving shape and dtype) from a checkpoint tensor."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(
            f"tensor {checkpoint_name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(target.shape)}"
        )
    return nn.Parameter(tensor.to(device=device, dtype=target.dtype), requires_grad=False)


def _set_parameter(model: nn.Module, name: str, value: nn.Parameter) -> None:
    module_path, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(module_path), leaf, value)
