"""Falcon-H1 (TII): in every layer attention and Mamba2 run side by side on the same normed
input and their scaled outputs are summed into the residual stream, then a gated MLP; as
transformers' FalconH1ForCausalLM.

Every layer is HYBRID (engine/model_config.py): it is in both config.attention_layers and
config.mamba_layers, so it owns a KV slot and a state slot, and the caches, budgets and
checkpoints sized from those lists count it in both.

Falcon-H1's muP multipliers, and where they act (all exact elementwise products, applied as
torch ops with scalars; none is folded into weights, so the loaded tensors stay the
checkpoint's and a multiplier of 1 costs nothing):
- embedding_multiplier on the embeddings, lm_head_multiplier on the logits (as logits_scaling
  = 1 / lm_head_multiplier: a division by its reciprocal, within an ulp of the product);
- ssm_in_multiplier / attention_in_multiplier on each mixer's input, ssm_out_multiplier /
  attention_out_multiplier on its output (mamba_in/out_multiplier, attention_in/out_multiplier);
- ssm_multipliers (the "mup vector") on in_proj's [z | x | B | C | dt] sections
  (Mamba2Mixer.scale_projection: five scalars, so each rank scales its own rows of each section);
- key_multiplier on the keys: folded into the softmax scale (key_multiplier / sqrt(head_dim)),
  since keys enter attention only through q.k;
- mlp_multipliers: the gate's before silu (SplitGatedMLP), the down projection's as the
  layer's residual_multiplier (on the MLP output as it joins the stream).

The model is GraniteMoeHybridModel with FalconH1DecoderLayer as its layer; checkpoint tensor
names map as Bamba's (engine/models/bamba.py parameter_name).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.interfaces.forward_batch import ForwardBatch, ModelCaches
from engine.kernels.gpu.batch_plan import GpuBatchPlan
from engine.layers.attention import PagedAttention
from engine.layers.mamba2 import Mamba2Mixer
from engine.layers.mlp import dense_mlp
from engine.layers.norm import RMSNorm
from engine.model_config import (
    HYBRID,
    MAMBA_GATE_ONLY,
    MAMBA_NORM_FIRST,
    MAMBA_NORM_GATE_FIRST,
    MLP_SPLIT,
    HybridModelConfig,
    as_float,
    parse_rope_base,
    required,
)
from engine.models.config_fields import attention_fields, mamba_fields, token_fields
from engine.models.granite_moe_hybrid import GraniteMoeHybridModel
from engine.parallel.shard_layout import RankShardLayout
from engine.parallel.tensor_parallel import TensorParallel

MODEL_TYPE = "falcon_h1"
MAMBA_D_SSM_DEFAULT = 1024  # transformers' FalconH1Config.mamba_d_ssm


def parse_config(raw: dict[str, Any]) -> HybridModelConfig:
    """Normalise a falcon_h1 config.json dict; raises ValueError naming the field it cannot
    accept."""
    attention = attention_fields(raw)
    hidden_size, num_layers, head_dim = (
        attention["hidden_size"], attention["num_hidden_layers"], attention["head_dim"]
    )
    # as transformers' FalconH1Config: a config.json without mamba_d_ssm gets its default
    # (1024); only an explicit null means mamba_expand * hidden_size
    mamba = mamba_fields({"mamba_d_ssm": MAMBA_D_SSM_DEFAULT, **raw}, hidden_size, inner_size_key="mamba_d_ssm")
    ssm_multipliers = _multipliers(raw, "ssm_multipliers", 5)
    gate_multiplier, down_multiplier = _multipliers(raw, "mlp_multipliers", 2)
    lm_head_multiplier = _multiplier(raw, "lm_head_multiplier")
    if lm_head_multiplier == 0.0:
        raise ValueError("lm_head_multiplier must not be 0")
    intermediate_size = required(raw, "intermediate_size")
    return HybridModelConfig(
        model_type=MODEL_TYPE,
        vocab_size=required(raw, "vocab_size"),
        **attention,
        layer_types=(HYBRID,) * num_layers,
        intermediate_size=intermediate_size,
        shared_intermediate_size=intermediate_size,
        **mamba,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        rope_theta=parse_rope_base(raw),
        max_position_embeddings=raw.get("max_position_embeddings", 8192),
        embedding_multiplier=_multiplier(raw, "embedding_multiplier"),
        attention_multiplier=_multiplier(raw, "key_multiplier") * head_dim**-0.5,
        residual_multiplier=down_multiplier,
        logits_scaling=1.0 / lm_head_multiplier,
        **token_fields(raw),
        # transformers' Falcon-H1 rotates whole heads: it ignores a
        # rope_parameters.partial_rotary_factor (which a config may carry), and so does this.
        partial_rotary_factor=1.0,
        mlp_layout=MLP_SPLIT,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        mlp_gate_multiplier=gate_multiplier,
        mamba_out_proj_bias=bool(raw.get("projectors_bias", False)),
        mamba_gated_norm=_gated_norm(raw),
        mamba_projection_multipliers=ssm_multipliers,
        attention_in_multiplier=_multiplier(raw, "attention_in_multiplier"),
        attention_out_multiplier=_multiplier(raw, "attention_out_multiplier"),
        mamba_in_multiplier=_multiplier(raw, "ssm_in_multiplier"),
        mamba_out_multiplier=_multiplier(raw, "ssm_out_multiplier"),
    )


def _multiplier(raw: dict[str, Any], field: str) -> float:
    """A scalar multiplier; absent or null means 1."""
    value = raw.get(field)
    return 1.0 if value is None else as_float(value, field)


def _multipliers(raw: dict[str, Any], field: str, count: int) -> tuple[float, ...]:
    """A list of `count` multipliers; absent or null means all 1."""
    values = raw.get(field)
    if values is None:
        return (1.0,) * count
    if not isinstance(values, (list, tuple)) or len(values) != count:
        raise ValueError(f"{field} must hold {count} numbers, got {values!r}")
    return tuple(as_float(v, field) for v in values)


def _gated_norm(raw: dict[str, Any]) -> str:
    """mamba_rms_norm false: y * silu(z), no norm; true: normed before the gate when
    mamba_norm_before_gate (transformers' default), after it otherwise."""
    if not raw.get("mamba_rms_norm", False):
        return MAMBA_GATE_ONLY
    return MAMBA_NORM_FIRST if raw.get("mamba_norm_before_gate", True) else MAMBA_NORM_GATE_FIRST


def _scaled(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    return x if multiplier == 1.0 else x * multiplier


class FalconH1DecoderLayer(nn.Module):
    """n = norm(x); x += m_out * mamba(m_in * n) + a_out * attn(a_in * n);
    x += r * mlp(norm(x)), r = residual_multiplier (Falcon-H1's MLP down multiplier).

    Both mixers read and write this layer's caches: the KV blocks (self_attn) and the state
    slot (mamba). Same constructor and forward contracts as granite_moe_hybrid.DecoderLayer,
    so GraniteMoeHybridModel runs it.
    """

    def __init__(
        self, config: HybridModelConfig, layer_index: int, layout: RankShardLayout,
        tp: TensorParallel, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.residual_multiplier = config.residual_multiplier
        self.mamba_in, self.mamba_out = config.mamba_in_multiplier, config.mamba_out_multiplier
        self.attention_in = config.attention_in_multiplier
        self.attention_out = config.attention_out_multiplier
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mamba = Mamba2Mixer(config, layout, tp, dtype)
        self.self_attn = PagedAttention(config, layout, tp, dtype)
        self.shared_mlp = dense_mlp(config, layout.mlp_channels, tp, dtype)

    def _mixers_sum(self, mamba_out: torch.Tensor, attention_out: torch.Tensor) -> torch.Tensor:
        """(T, D): the two mixers' outputs scaled and summed, as they join the stream."""
        return _scaled(mamba_out, self.mamba_out) + _scaled(attention_out, self.attention_out)

    def forward(
        self,
        hidden: torch.Tensor,  # (T, D)
        batch: ForwardBatch,
        caches: ModelCaches,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """The PyTorch path (no plan): returns the new hidden (T, D); writes this layer's KV
        and its state slots in `caches`."""
        i = self.layer_index
        mixer_in = self.input_layernorm(hidden)
        mamba_out = self.mamba(
            _scaled(mixer_in, self.mamba_in), batch, caches.conv_state[i], caches.ssm_state[i]
        )
        attention_out = self.self_attn(
            _scaled(mixer_in, self.attention_in), batch, caches.key_cache[i], caches.value_cache[i], rope,
            kv_scale=caches.kv_scale.get(i),
        )
        hidden = hidden + self._mixers_sum(mamba_out, attention_out)
        mlp_out = self.shared_mlp(self.post_attention_layernorm(hidden))
        return hidden + mlp_out * self.residual_multiplier

    def forward_gpu(
        self,
        hidden: torch.Tensor,  # (T, D), the residual stream before the previous layer's MLP add
        pending: torch.Tensor | None,  # (T, D) the previous layer's MLP output; None for layer 0
        batch: ForwardBatch,
        caches: ModelCaches,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        gpu_plan: GpuBatchPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer on CUDA, as DecoderLayer.forward_gpu: residual adds fused into the
        norms (the mixers' sum added with multiplier 1, the MLP's with residual_multiplier),
        both mixers on the kernels gpu_plan chose, the multipliers as torch ops."""
        from engine.kernels.gpu.fused_norm import add_rms_norm

        i, r = self.layer_index, self.residual_multiplier
        norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
        hidden, mixer_in = add_rms_norm(hidden, pending, r, norm_in.weight, norm_in.eps)
        in_pass = gpu_plan.in_pass
        captures = None if in_pass is None else (in_pass.conv_out[i], in_pass.ssm_out[i])
        mamba_out = self.mamba(
            _scaled(mixer_in, self.mamba_in), batch, caches.conv_state[i], caches.ssm_state[i],
            gpu_plan, captures,
        )
        attention_out = self.self_attn(
            _scaled(mixer_in, self.attention_in), batch, caches.key_cache[i], caches.value_cache[i],
            rope, gpu_plan, caches.kv_scale.get(i),
        )
        mixed = self._mixers_sum(mamba_out, attention_out)
        hidden, mlp_in = add_rms_norm(hidden, mixed, 1.0, norm_post.weight, norm_post.eps)
        return hidden, self.shared_mlp.forward_gpu(mlp_in)


class FalconH1Model(GraniteMoeHybridModel):
    """GraniteMoeHybridModel (embedding, layers, final norm, LM head, caches) with
    FalconH1DecoderLayer layers."""

    decoder_layer = FalconH1DecoderLayer
