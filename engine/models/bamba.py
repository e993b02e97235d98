"""Bamba (IBM): Mamba2 or attention in each layer, then a gated MLP, as transformers'
BambaForCausalLM.

Structurally GraniteMoeHybrid without its multipliers (embedding, residual and logits all 1;
the softmax scale 1/sqrt(head_dim)), so the model is engine/models/granite_moe_hybrid.py's
GraniteMoeHybridModel, built from the config this module parses. What differs is spelled in
the config: the attention layers come as `attn_layer_indices` (no layer_types), RoPE always
rotates the first half of each head (transformers fixes partial_rotary_factor at 0.5), and the
MLP has the Llama layout (gate_proj, up_proj, down_proj; mlp_layout "split").

Checkpoint tensor names map onto the model's by `parameter_name` (feed_forward -> shared_mlp,
pre_ff_layernorm -> post_attention_layernorm, final_layernorm -> norm); Falcon-H1 names its
tensors the same way and uses it too.
"""

from __future__ import annotations

import re
from typing import Any

from engine.model_config import (
    ATTENTION,
    MAMBA,
    MLP_SPLIT,
    HybridModelConfig,
    as_float,
    parse_rope_base,
    required,
)
from engine.models.config_fields import attention_fields, mamba_fields, token_fields
from engine.models.granite_moe_hybrid import GraniteMoeHybridModel

MODEL_TYPE = "bamba"

# transformers' BambaConfig rotates half of each head whatever config.json says.
_ROTARY_FACTOR = 0.5

# checkpoint name (after "model.") -> model parameter name, for Bamba and Falcon-H1
_RENAMES = (
    (re.compile(r"^layers\.(\d+)\.feed_forward\."), r"layers.\1.shared_mlp."),
    (re.compile(r"^layers\.(\d+)\.pre_ff_layernorm\."), r"layers.\1.post_attention_layernorm."),
    (re.compile(r"^final_layernorm\."), "norm."),
)


def parameter_name(checkpoint_name: str) -> str:
    """"model.layers.3.feed_forward.gate_proj.weight" -> "layers.3.shared_mlp.gate_proj.weight",
    "model.layers.3.pre_ff_layernorm.weight" -> "layers.3.post_attention_layernorm.weight",
    "model.final_layernorm.weight" -> "norm.weight"; other names lose "model." (lm_head.weight
    stays as it is)."""
    name = checkpoint_name.removeprefix("model.")
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


def parse_config(raw: dict[str, Any]) -> HybridModelConfig:
    """Normalise a bamba config.json dict; raises ValueError naming the field it cannot accept."""
    attention = attention_fields(raw)
    hidden_size, num_layers, head_dim = (
        attention["hidden_size"], attention["num_hidden_layers"], attention["head_dim"]
    )
    rotary_factor = as_float(
        (raw.get("rope_parameters") or {}).get("partial_rotary_factor", _ROTARY_FACTOR),
        "rope_parameters.partial_rotary_factor",
    )
    if rotary_factor != _ROTARY_FACTOR:
        raise ValueError(
            f"rope_parameters.partial_rotary_factor={rotary_factor}: Bamba rotates half of each "
            f"head ({_ROTARY_FACTOR})"
        )
    # older configs also give the rotated width itself (Bamba-9B: 64 of head_dim 128)
    rotary_width = raw.get("attn_rotary_emb")
    if rotary_width is not None and rotary_width != int(head_dim * rotary_factor):
        raise ValueError(
            f"attn_rotary_emb={rotary_width}: Bamba rotates {int(head_dim * rotary_factor)} "
            f"channels of head_dim {head_dim}"
        )
    mamba = mamba_fields(raw, hidden_size)
    intermediate_size = required(raw, "intermediate_size")
    return HybridModelConfig(
        model_type=MODEL_TYPE,
        vocab_size=required(raw, "vocab_size"),
        **attention,
        layer_types=_layer_types(raw.get("attn_layer_indices"), num_layers),
        intermediate_size=intermediate_size,
        shared_intermediate_size=intermediate_size,
        **mamba,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        rope_theta=parse_rope_base(raw),
        max_position_embeddings=raw.get("max_position_embeddings", 262144),
        embedding_multiplier=1.0,
        attention_multiplier=head_dim**-0.5,
        residual_multiplier=1.0,
        logits_scaling=1.0,
        **token_fields(raw),
        partial_rotary_factor=rotary_factor,
        mlp_layout=MLP_SPLIT,
        mlp_bias=bool(raw.get("mlp_bias", False)),
    )


def _layer_types(attn_layer_indices: list[int] | None, num_layers: int) -> tuple[str, ...]:
    """Attention at attn_layer_indices, Mamba2 elsewhere (None: every layer Mamba2)."""
    indices = set(attn_layer_indices or ())
    outside = sorted(i for i in indices if not (isinstance(i, int) and 0 <= i < num_layers))
    if outside:
        raise ValueError(f"attn_layer_indices {outside} are not layers of num_hidden_layers={num_layers}")
    return tuple(ATTENTION if i in indices else MAMBA for i in range(num_layers))


# Bamba runs GraniteMoeHybrid's model: its layers are the same, with the multipliers at 1.
BambaModel = GraniteMoeHybridModel
