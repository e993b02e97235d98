"""The model's architecture, read from a Hugging Face config.json into one frozen object.

Checkpoints and transformers versions spell the same GraniteMoeHybrid fields differently
(docs/design.md section 7); `parse_model_config` accepts every spelling seen and normalises it, and
rejects what this engine cannot run (MoE layers, unknown layer kinds) with a ValueError that
names the offending field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAMBA = "mamba"
ATTENTION = "attention"

_LAYER_TYPE_SPELLINGS = {
    "mamba": MAMBA,
    "linear_attention": MAMBA,
    "attention": ATTENTION,
    "full_attention": ATTENTION,
}
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class HybridModelConfig:
    """A dense GraniteMoeHybrid model (Mamba2 + attention layers, each followed by a gated MLP).

    layer_types[i] is "mamba" or "attention".
    rope_theta: None means no positional embedding in attention (NoPE).
    attention_multiplier is the attention softmax scale (it replaces 1/sqrt(head_dim)).
    logits are lm_head(hidden) / logits_scaling.
    time_step_limit: (low, high) clamp applied to softplus(dt + dt_bias).
    dtype: the checkpoint's stored dtype name ("float32", "bfloat16", "float16").
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    intermediate_size: int
    shared_intermediate_size: int
    hidden_act: str
    mamba_n_heads: int
    mamba_d_head: int
    mamba_d_state: int
    mamba_n_groups: int
    mamba_d_conv: int
    mamba_expand: int
    mamba_chunk_size: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    rms_norm_eps: float
    rope_theta: float | None
    max_position_embeddings: int
    embedding_multiplier: float
    attention_multiplier: float
    residual_multiplier: float
    logits_scaling: float
    time_step_limit: tuple[float, float]
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    dtype: str

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == ATTENTION]

    @property
    def mamba_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == MAMBA]

    @property
    def mamba_intermediate_size(self) -> int:
        """Width of the Mamba inner stream x (and of the gate z): n_heads * d_head."""
        return self.mamba_n_heads * self.mamba_d_head

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C concatenated."""
        return self.mamba_intermediate_size + 2 * self.mamba_n_groups * self.mamba_d_state


def load_model_config(model_dir: str | Path) -> HybridModelConfig:
    """Read `model_dir/config.json`; raises FileNotFoundError or ValueError."""
    path = Path(model_dir) / "config.json"
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    return parse_model_config(raw)


def parse_model_config(raw: dict[str, Any]) -> HybridModelConfig:
    """Normalise a config.json dict; raises ValueError naming the field it cannot accept."""
    model_type = raw.get("model_type", "granitemoehybrid")
    if model_type != "granitemoehybrid":
        raise ValueError(f"model_type must be 'granitemoehybrid', got {model_type!r}")
    # transformers defaults num_local_experts to 8 (MoE) when the field is absent.
    num_experts = raw.get("num_local_experts", 8)
    if num_experts is None or int(num_experts) > 0:
        raise ValueError(
            f"num_local_experts={num_experts!r}: only dense GraniteMoeHybrid models "
            "(num_local_experts=0) are supported"
        )
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {hidden_act!r}")

    hidden_size = _required(raw, "hidden_size")
    num_layers = _required(raw, "num_hidden_layers")
    num_heads = _required(raw, "num_attention_heads")
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )

    mamba_expand = raw.get("mamba_expand", 2)
    mamba_n_heads = raw.get("mamba_n_heads", 128)
    mamba_n_groups = raw.get("mamba_n_groups", 1)
    mamba_d_head = raw.get("mamba_d_head", "auto")
    if mamba_d_head == "auto":
        mamba_d_head = mamba_expand * hidden_size // mamba_n_heads
    if mamba_d_head * mamba_n_heads != mamba_expand * hidden_size:
        raise ValueError(
            f"mamba_d_head={mamba_d_head} * mamba_n_heads={mamba_n_heads} must equal "
            f"mamba_expand * hidden_size = {mamba_expand * hidden_size}"
        )
    if mamba_n_heads % mamba_n_groups != 0:
        raise ValueError(f"mamba_n_groups={mamba_n_groups} must divide mamba_n_heads={mamba_n_heads}")

    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)

    return HybridModelConfig(
        vocab_size=_required(raw, "vocab_size"),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        layer_types=_parse_layer_types(raw.get("layer_types"), num_layers),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        attention_bias=bool(raw.get("attention_bias", False)),
        intermediate_size=raw.get("intermediate_size", 0),
        shared_intermediate_size=_required(raw, "shared_intermediate_size"),
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
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=_parse_rope_theta(raw),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        attention_multiplier=float(raw.get("attention_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
        time_step_limit=_parse_time_step_limit(raw.get("time_step_limit")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=raw.get("pad_token_id"),
        dtype=_parse_dtype(raw),
    )


def _required(raw: dict[str, Any], field: str) -> Any:
    if raw.get(field) is None:
        raise ValueError(f"config.json lacks the required field {field!r}")
    return raw[field]


def _parse_layer_types(layer_types: list[str] | None, num_layers: int) -> tuple[str, ...]:
    """mamba/attention (published checkpoints) or linear_attention/full_attention (transformers 5)."""
    if layer_types is None:  # transformers' default: every layer is Mamba
        return (MAMBA,) * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries, num_hidden_layers is {num_layers}")
    unknown = sorted({t for t in layer_types if t not in _LAYER_TYPE_SPELLINGS}, key=str)
    if unknown:
        raise ValueError(
            f"layer_types holds unknown layer types {unknown}; "
            f"expected one of {sorted(_LAYER_TYPE_SPELLINGS)}"
        )
    return tuple(_LAYER_TYPE_SPELLINGS[t] for t in layer_types)


def _parse_rope_theta(raw: dict[str, Any]) -> float | None:
    """None for NoPE (position_embedding_type "nope" or null), else the RoPE base."""
    kind = raw.get("position_embedding_type")
    if kind is None or kind == "nope":
        return None
    if kind != "rope":
        raise ValueError(f"position_embedding_type must be 'rope', 'nope' or null, got {kind!r}")
    rope_parameters = raw.get("rope_parameters") or {}
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type != "default" or raw.get("rope_scaling"):
        raise ValueError(f"rope_parameters.rope_type {rope_type!r} / rope_scaling is not supported")
    theta = rope_parameters.get("rope_theta", raw.get("rope_theta", 10000.0))
    return float(theta)


def _parse_time_step_limit(value: Any) -> tuple[float, float]:
    """[low, high] with numbers, "Infinity" strings or {"__float__": "Infinity"} objects."""
    if value is None:
        return (0.0, math.inf)
    if len(value) != 2:
        raise ValueError(f"time_step_limit must hold two numbers, got {value!r}")
    return (_as_float(value[0], "time_step_limit"), _as_float(value[1], "time_step_limit"))


def _as_float(value: Any, field: str) -> float:
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{field}: cannot read {value!r} as a number") from error


def _parse_dtype(raw: dict[str, Any]) -> str:
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype / torch_dtype must be one of {_DTYPES}, got {dtype!r}")
    return dtype
