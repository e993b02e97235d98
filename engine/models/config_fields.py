"""config.json fields that GraniteMoeHybrid, Bamba and Falcon-H1 read alike: transformers gives
their configs the same names and defaults for the attention shape, the Mamba2 mixer and the
token / dtype entries. Each function returns HybridModelConfig keyword arguments (a family's
parse_config passes them on with **) and raises ValueError naming the field it cannot accept.
"""

from __future__ import annotations

from typing import Any

from engine.model_config import parse_dtype, parse_eos_token_ids, parse_time_step_limit, required


def attention_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """hidden_act (silu only), hidden_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads (absent: the attention heads; must divide them), head_dim (absent:
    hidden_size / heads) and attention_bias."""
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {hidden_act!r}")
    hidden_size = required(raw, "hidden_size")
    num_layers = required(raw, "num_hidden_layers")
    num_heads = required(raw, "num_attention_heads")
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    return dict(
        hidden_act=hidden_act,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=raw.get("head_dim") or hidden_size // num_heads,
        attention_bias=bool(raw.get("attention_bias", False)),
    )


def mamba_fields(raw: dict[str, Any], hidden_size: int, inner_size_key: str | None = None) -> dict[str, Any]:
    """The Mamba2 mixer's shape and biases (mamba_n_heads, mamba_d_head, mamba_d_state,
    mamba_n_groups, mamba_d_conv, mamba_expand, mamba_chunk_size, mamba_conv_bias,
    mamba_proj_bias). The mixer's inner width is raw[inner_size_key] when that key is given and
    set (Falcon-H1's mamba_d_ssm), else mamba_expand * hidden_size."""
    expand = raw.get("mamba_expand", 2)
    num_heads = raw.get("mamba_n_heads", 128)
    inner_size = (raw.get(inner_size_key) if inner_size_key else None) or expand * hidden_size
    inner_name = inner_size_key or "mamba_expand * hidden_size"
    return dict(
        mamba_n_heads=num_heads,
        mamba_d_head=mamba_head_dim(raw, inner_size, num_heads, inner_name),
        mamba_d_state=raw.get("mamba_d_state", 256),
        mamba_n_groups=raw.get("mamba_n_groups", 1),
        mamba_d_conv=raw.get("mamba_d_conv", 4),
        mamba_expand=expand,
        mamba_chunk_size=raw.get("mamba_chunk_size", 256),
        mamba_conv_bias=bool(raw.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(raw.get("mamba_proj_bias", False)),
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


def token_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """time_step_limit, tie_word_embeddings, bos/eos/pad token ids and the checkpoint dtype."""
    return dict(
        time_step_limit=parse_time_step_limit(raw.get("time_step_limit")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=parse_eos_token_ids(raw),
        pad_token_id=raw.get("pad_token_id"),
        dtype=parse_dtype(raw),
    )
