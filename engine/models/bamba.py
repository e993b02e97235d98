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
    parse_dtype,
    parse_eos_token_ids,
    parse_rope_base,
    parse_time_step_limit,
    required,
)
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
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {hidden_act!r}")
    hidden_size = required(raw, "hidden_size")
    num_layers = required(raw, "num_hidden_layers")
    num_heads = required(raw, "num_attention_heads")
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
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
    mamba_expand = raw.get("mamba_expand", 2)
    mamba_n_heads = raw.get("mamba_n_heads", 128)
    mamba_n_groups = raw.get("mamba_n_groups", 1)
    mamba_d_head = mamba_head_dim(raw, mamba_expand * hidden_size, mamba_n_heads, "mamba_expand * hidden_size")
    intermediate_size = required(raw, "intermediate_size")
    return HybridModelConfig(
        model_type=MODEL_TYPE,
        vocab_size=required(raw, "vocab_size"),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        layer_types=_layer_types(raw.get("attn_layer_indices"), num_layers),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        attention_bias=bool(raw.get("attention_bias", False)),
        intermediate_size=intermediate_size,
        shared_intermediate_size=intermediate_size,
        hidden_act=hidden_act,
        mamba_n_heads=mamba_n_heads,
        mamba_d_head=mamba_d_head,
        mamba_d_state=raw.get("mamba_d_state", 256),
        mamba_n_groups=mamba_n_groups,
        mamba_d_conv=raw.get("mamba_d_conv", 4),
        mamba_expand=mamba_expand,
        mamba_chunk_size=raw.get("mamba_chunk_size", 256),
        mamba_conv_bias=bool(raw.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(raw.get("mamba_proj_bias", False)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        rope_theta=parse_rope_base(raw),
        max_position_embeddings=raw.get("max_position_embeddings", 262144),
        embedding_multiplier=1.0,
        attention_multiplier=head_dim**-0.5,
        residual_multiplier=1.0,
        logits_scaling=1.0,
        time_step_limit=parse_time_step_limit(raw.get("time_step_limit")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=parse_eos_token_ids(raw),
        pad_token_id=raw.get("pad_token_id"),
        dtype=parse_dtype(raw),
        partial_rotary_factor=rotary_factor,
        mlp_layout=MLP_SPLIT,
        mlp_bias=bool(raw.get("mlp_bias", False)),
    )


def mamba_head_dim(raw: dict[str, Any], inner_size: int, num_heads: int, inner_name: str) -> int:
    """mamba_d_head as written, or inner_size / mamba_n_heads for "auto" (or absent);
    ValueError unless d_head * n_heads == inner_size and the groups divide the heads."""
    d_head = raw.get("mamba_d_head", "auto")
    if d_head == "auto":
        d_head = inner_size // num_heads
    if d_head * num_heads != inner_size:
        raise ValueError(
            f"mamba_d_head={d_head} * mamba_n_heads={num_heads} must equal {inner_name} = {inner_size}"
        )
    groups = raw.get("mamba_n_groups", 1)
    if num_heads % groups != 0:
        raise ValueError(f"mamba_n_groups={groups} must divide mamba_n_heads={num_heads}")
    return d_head


def _layer_types(attn_layer_indices: list[int] | None, num_layers: int) -> tuple[str, ...]:
    """Attention at attn_layer_indices, Mamba2 elsewhere (None: every layer Mamba2)."""
    indices = set(attn_layer_indices or ())
    outside = sorted(i for i in indices if not (isinstance(i, int) and 0 <= i < num_layers))
    if outside:
        raise ValueError(f"attn_layer_indices {outside} are not layers of num_hidden_layers={num_layers}")
    return tuple(ATTENTION if i in indices else MAMBA for i in range(num_layers))


# Bamba runs GraniteMoeHybrid's model: its layers are the same, with the multipliers at 1.
BambaModel = GraniteMoeHybridModel
