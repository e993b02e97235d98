"""The model's architecture as one frozen object, and the readers family parsers share.

Each model family (engine/models/registry.py) parses its config.json into a HybridModelConfig:
checkpoints and transformers versions spell the same fields differently (docs/design.md
section 7), so a family's `parse_config` accepts every spelling seen and normalises it, and
rejects what this engine cannot run with a ValueError that names the offending field. The
readers below (`required`, `parse_layer_types`, ...) are the spellings more than one family
uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAMBA = "mamba"
ATTENTION = "attention"
# A block whose mixer is an MLP (Nemotron-H's "-"): no KV, no recurrent state.
MLP = "mlp"
# A block whose mixer is routed experts plus a shared expert (Nemotron-H's "E"): no KV, no
# recurrent state.
MOE = "moe"
MLP_FUSED, MLP_SPLIT = "fused", "split"  # HybridModelConfig.mlp_layout
# HybridModelConfig.mamba_gated_norm: the forms of the norm between the SSD scan and out_proj.
MAMBA_NORM_GATE_FIRST, MAMBA_NORM_FIRST, MAMBA_GATE_ONLY = "gate_first", "norm_first", "gate_only"
GATED_DELTA_NET = "gated_delta_net"  # Qwen3-Next's linear attention (engine/layers/gated_delta_net.py)
# Attention and Mamba2 side by side in one layer (Falcon-H1): it owns a KV slot and a state slot.
HYBRID = "hybrid"
RECURRENT_KINDS = (MAMBA, GATED_DELTA_NET, HYBRID)  # layers whose per-request state lives in a state slot

_LAYER_TYPE_SPELLINGS = {
    "mamba": MAMBA,
    "linear_attention": MAMBA,
    "attention": ATTENTION,
    "full_attention": ATTENTION,
}
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class HybridModelConfig:
    """A hybrid model: Mamba2 and attention layers, each followed by a gated MLP.

    model_type: the config.json model_type of the family that parsed it (engine/models/registry.py).
    layer_types[i] is "mamba", "attention" or "gated_delta_net" (engine/layers/gated_delta_net.py).
    rope_theta: None means no positional embedding in attention (NoPE).
    attention_multiplier is the attention softmax scale (it replaces 1/sqrt(head_dim)).
    logits are lm_head(hidden) / logits_scaling.
    time_step_limit: (low, high) clamp applied to softplus(dt + dt_bias).
    dtype: the checkpoint's stored dtype name ("float32", "bfloat16", "float16").
    """

    model_type: str
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
    # Gated delta-net layers (GATED_DELTA_NET, Qwen3-Next): key heads (q and k), value heads
    # (v, the gate z, beta and the decay), their head dims and the causal conv's width.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Attention options (Qwen3-Next): q_proj also yields a per-head output gate (output *
    # sigmoid(gate) before o_proj); q and k RMS-normed over head_dim before RoPE; RoPE on the
    # first rotary_dim = int(head_dim * partial_rotary_factor) channels of a head only.
    attention_output_gate: bool = False
    qk_norm: bool = False
    partial_rotary_factor: float = 1.0
    # RMSNorm weights stored zero-centred: the scale is (1 + weight), computed in fp32.
    zero_centered_norm: bool = False
    # Multi-token prediction layers whose weights (mtp.*) the checkpoint carries.
    num_mtp_layers: int = 0
    # Routed experts after each block (engine/layers/routed_experts.py): 0 means dense (the
    # shared MLP only). Each expert is a gated MLP of intermediate_size channels; each token
    # goes to num_experts_per_tok of them.
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    # Layers whose MLP is dense in a model with routed experts (Qwen3-Next's mlp_only_layers /
    # decoder_sparse_step): a gated MLP of dense_intermediate_size channels in place of the
    # experts and their shared MLP. Empty: every layer's MLP is alike (has_routed_experts).
    dense_mlp_layers: tuple[int, ...] = ()
    dense_intermediate_size: int = 0
    # The dense MLP's weight layout: MLP_FUSED (input_linear = [gate | up], output_linear;
    # GraniteMoeHybrid) or MLP_SPLIT (Llama's gate_proj, up_proj, down_proj; Bamba, Falcon-H1),
    # which may have biases on all three and gate_proj's output scaled by mlp_gate_multiplier.
    mlp_layout: str = "fused"
    mlp_bias: bool = False
    mlp_gate_multiplier: float = 1.0
    # Mamba2 options (Falcon-H1): out_proj's bias (None: mamba_proj_bias, as in_proj's); the
    # gated norm's form (MAMBA_NORM_GATE_FIRST: weight * norm(y * silu(z)), Mamba2's;
    # MAMBA_NORM_FIRST: weight * norm(y) * silu(z); MAMBA_GATE_ONLY: y * silu(z), no norm);
    # in_proj's output scaled per section [z, x, B, C, dt] (Falcon-H1's mup vector).
    mamba_out_proj_bias: bool | None = None
    mamba_gated_norm: str = "gate_first"
    mamba_projection_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    # Parallel attention + Mamba2 layers (HYBRID, Falcon-H1): the normed input is scaled by
    # *_in_multiplier before each mixer and each mixer's output by *_out_multiplier before
    # their sum joins the residual stream.
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    mamba_in_multiplier: float = 1.0
    mamba_out_multiplier: float = 1.0
    # Routed experts' weights (Qwen3-Next: softmax over all experts, then the top k):
    # renormalised to sum 1 over a token's k experts.
    norm_topk_prob: bool = False
    # Nemotron-H's MoE blocks (MOE; engine/models/nemotron_h_moe.py): experts picked by sigmoid
    # scores plus a per-expert selection bias among the topk_group best of n_group equal expert
    # groups, their weights times routed_scaling_factor; each expert a non-gated squared-ReLU
    # MLP on moe_latent_size-wide inputs (0: hidden_size, no latent projections); a shared
    # expert of shared_expert_intermediate_size channels.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    moe_latent_size: int = 0
    shared_expert_intermediate_size: int = 0

    def has_routed_experts(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP holds the routed experts: the model has experts and the
        layer is not one of dense_mlp_layers."""
        return self.num_local_experts > 0 and layer not in self.dense_mlp_layers

    @property
    def rotary_dim(self) -> int:
        """Channels of a head RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        """Width of a gated delta-net's q (and of its k): key heads * key head dim."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        """Width of a gated delta-net's v (and of its gate z): value heads * value head dim."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind in (ATTENTION, HYBRID)]

    @property
    def mamba_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind in (MAMBA, HYBRID)]

    @property
    def recurrent_layers(self) -> list[int]:
        """Layers with a recurrent state slot (conv state + recurrent state): Mamba2 or gated
        delta-net; a model holds one kind of them (its family refuses a mix)."""
        return [i for i, kind in enumerate(self.layer_types) if kind in RECURRENT_KINDS]

    @property
    def recurrent_kind(self) -> str | None:
        """The kind of the recurrent layers (MAMBA or GATED_DELTA_NET); None without any."""
        kinds = {MAMBA if self.layer_types[i] == HYBRID else self.layer_types[i] for i in self.recurrent_layers}
        if len(kinds) > 1:
            raise ValueError(f"layer_types mixes recurrent kinds {sorted(kinds)}")
        return kinds.pop() if kinds else None

    @property
    def mamba_intermediate_size(self) -> int:
        """Width of the Mamba inner stream x (and of the gate z): n_heads * d_head."""
        return self.mamba_n_heads * self.mamba_d_head

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C concatenated."""
        return self.mamba_intermediate_size + 2 * self.mamba_n_groups * self.mamba_d_state


def required(raw: dict[str, Any], field: str) -> Any:
    if raw.get(field) is None:
        raise ValueError(f"config.json lacks the required field {field!r}")
    return raw[field]


def parse_eos_token_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """eos_token_id as one id, a list of ids, or absent (no ids)."""
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def parse_layer_types(
    layer_types: list[str] | None, num_layers: int, spellings: dict[str, str] | None = None,
) -> tuple[str, ...]:
    """mamba/attention (published checkpoints) or linear_attention/full_attention (transformers 5).

    spellings: a family's own config spelling -> kind table (e.g. Qwen3-Next's
    "linear_attention" is a gated delta-net); default GraniteMoeHybrid's, where it is Mamba2.
    """
    spellings = _LAYER_TYPE_SPELLINGS if spellings is None else spellings
    if layer_types is None:  # transformers' default: every layer is Mamba
        return (MAMBA,) * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries, num_hidden_layers is {num_layers}")
    unknown = sorted({t for t in layer_types if t not in spellings}, key=str)
    if unknown:
        raise ValueError(
            f"layer_types holds unknown layer types {unknown}; "
            f"expected one of {sorted(spellings)}"
        )
    return tuple(spellings[t] for t in layer_types)


def parse_rope_theta(raw: dict[str, Any]) -> float | None:
    """None for NoPE (position_embedding_type "nope" or null), else the RoPE base."""
    kind = raw.get("position_embedding_type")
    if kind is None or kind == "nope":
        return None
    if kind != "rope":
        raise ValueError(f"position_embedding_type must be 'rope', 'nope' or null, got {kind!r}")
    return parse_rope_base(raw)


def parse_rope_base(raw: dict[str, Any]) -> float:
    """The RoPE base of a model that always rotates (no position_embedding_type key): from
    rope_parameters (transformers 5) or the top-level rope_theta (older configs), default
    10000; ValueError for any RoPE scaling."""
    rope_parameters = raw.get("rope_parameters") or {}
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type != "default" or raw.get("rope_scaling"):
        raise ValueError(f"rope_parameters.rope_type {rope_type!r} / rope_scaling is not supported")
    theta = rope_parameters.get("rope_theta", raw.get("rope_theta", 10000.0))
    return float(theta)


def parse_time_step_limit(value: Any) -> tuple[float, float]:
    """[low, high] with numbers, "Infinity" strings or {"__float__": "Infinity"} objects."""
    if value is None:
        return (0.0, math.inf)
    if len(value) != 2:
        raise ValueError(f"time_step_limit must hold two numbers, got {value!r}")
    return (as_float(value[0], "time_step_limit"), as_float(value[1], "time_step_limit"))


def as_float(value: Any, field: str) -> float:
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{field}: cannot read {value!r} as a number") from error


def parse_dtype(raw: dict[str, Any]) -> str:
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype / torch_dtype must be one of {_DTYPES}, got {dtype!r}")
    return dtype
