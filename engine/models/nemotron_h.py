"""Nemotron-H: a stack of single-mixer blocks, each a Mamba2 mixer, an attention mixer, a
squared-ReLU MLP or a MoE block (routed squared-ReLU experts plus a shared expert,
engine/models/nemotron_h_moe.py), with its own pre-norm and residual (no MLP after a mixer).

Numerically the same model as transformers' NemotronHForCausalLM (Nemotron-H and the
Nemotron-3 MoE models alike), run over a ForwardBatch of chunks from many requests like
GraniteMoeHybridModel, whose docstrings state the HybridModel contracts this module keeps. The Mamba2 mixer's gated norm
is grouped (n_groups groups of I / n_groups channels, GroupParallelGatedRMSNorm), attention
has no positional embedding and the softmax scale 1/sqrt(head_dim).

Checkpoint tensor names are "backbone." + parameter name (transformers' save_pretrained and
the published checkpoints; "model." is also read) and lm_head.weight: `parameter_name`.
The embedding is `embeddings`, the final norm `norm_f`, block i's `layers.i.norm` and
`layers.i.mixer`; a MoE block's router and experts are renamed or stacked while loading
(nemotron_h_moe.parameter_name, nemotron_h_moe.stacked_piece).

Tensor parallel: as GraniteMoeHybridModel (engine/parallel/shard_layout.py): attention heads, Mamba
heads and groups, MLP channels and each expert's channels split; hidden states (T, D) whole
between blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.interfaces.forward_batch import ForwardBatch, ModelCaches
from engine.kernels.gpu.batch_plan import GpuBatchPlan
from engine.layers.attention import PagedAttention
from engine.layers.mamba2 import Mamba2Mixer
from engine.layers.mlp import SquaredReluMLP
from engine.layers.norm import RMSNorm
from engine.layers.vocab_parallel import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    vocab_parallel_logits,
)
from engine.model_config import (
    ATTENTION,
    MAMBA,
    MLP,
    MOE,
    HybridModelConfig,
    parse_dtype,
    parse_eos_token_ids,
    parse_time_step_limit,
    required,
)
from engine.models import nemotron_h_moe
from engine.models.model_caches import RankCaches
from engine.models.nemotron_h_moe import NemotronHMoE
from engine.parallel import cache_capacity
from engine.parallel.shard_layout import RankShardLayout, rank_shard_layout
from engine.parallel.tensor_parallel import TensorParallel, TensorShard, parameter_shards

MODEL_TYPE = "nemotron_h"

# layers_block_type: transformers 5 writes linear_attention/full_attention, older configs
# mamba/attention; hybrid_override_pattern is the published checkpoints' one letter a block.
_BLOCK_TYPE_SPELLINGS = {
    "mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION,
    "mlp": MLP, "moe": MOE,
}
_PATTERN_SPELLINGS = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}


def parameter_name(checkpoint_name: str) -> str:
    """"backbone.layers.0.mixer.A_log" (or "model. ...") -> "layers.0.mixer.A_log";
    lm_head.weight as is; a MoE block's router and fused experts as
    nemotron_h_moe.parameter_name renames them."""
    name = checkpoint_name
    for prefix in ("backbone.", "model."):
        if name.startswith(prefix):
            name = name.removeprefix(prefix)
            break
    return nemotron_h_moe.parameter_name(name) or name


def _read_block_kinds(spelled: list[str], spellings: dict[str, str], key: str) -> tuple[str, ...]:
    """Each block's kind (MAMBA, ATTENTION, MLP or MOE); ValueError naming `key` for an
    unknown spelling."""
    unknown = sorted({s for s in spelled if s not in spellings}, key=str)
    if unknown:
        raise ValueError(f"{key} holds unknown block types {unknown}; expected one of {sorted(spellings)}")
    return tuple(spellings[s] for s in spelled)


def parse_block_types(raw: dict[str, Any]) -> tuple[str, ...]:
    """The blocks' kinds from layers_block_type (a list) and/or hybrid_override_pattern (a
    string such as "M-M*-"); when both are given they must agree, and num_hidden_layers, when
    given, must count them. ValueError naming the key otherwise."""
    listed, pattern = raw.get("layers_block_type"), raw.get("hybrid_override_pattern")
    if listed is None and pattern is None:
        raise ValueError("config.json lacks both layers_block_type and hybrid_override_pattern")
    kinds = None
    if listed is not None:
        kinds = _read_block_kinds(list(listed), _BLOCK_TYPE_SPELLINGS, "layers_block_type")
    if pattern is not None:
        from_pattern = _read_block_kinds(list(pattern), _PATTERN_SPELLINGS, "hybrid_override_pattern")
        if kinds is not None and kinds != from_pattern:
            raise ValueError(
                f"layers_block_type {listed} and hybrid_override_pattern {pattern!r} disagree"
            )
        kinds = from_pattern
    num_layers = raw.get("num_hidden_layers")
    if num_layers is not None and int(num_layers) != len(kinds):
        raise ValueError(f"num_hidden_layers={num_layers} but the block pattern has {len(kinds)} blocks")
    return kinds


def _either(raw: dict[str, Any], key: str, alias: str, default: Any) -> Any:
    """raw[key], else raw[alias] (the older spelling transformers also reads), else default."""
    if raw.get(key) is not None:
        return raw[key]
    return raw[alias] if raw.get(alias) is not None else default


def _refuse(raw: dict[str, Any], key: str, allowed: tuple, why: str) -> None:
    value = raw.get(key)
    if value not in allowed:
        raise ValueError(f"{key}={value!r}: {why}")


def parse_config(raw: dict[str, Any]) -> HybridModelConfig:
    """Normalise a nemotron_h config.json dict (defaults: transformers' NemotronHConfig);
    raises ValueError naming the field it cannot accept."""
    _refuse(raw, "mlp_hidden_act", (None, "relu2"), "the MLP blocks support only 'relu2'")
    _refuse(raw, "mamba_hidden_act", (None, "silu"), "the Mamba2 mixer supports only 'silu'")
    _refuse(raw, "attention_bias", (None, False), "transformers' NemotronH attention has no biases")
    _refuse(raw, "mlp_bias", (None, False), "MLP biases are not supported")
    _refuse(raw, "position_embedding_type", (None, "nope"), "Nemotron-H attention has no positional embedding")
    _refuse(raw, "sliding_window", (None,), "sliding-window attention is not supported")
    _refuse(raw, "num_nextn_predict_layers", (None, 0), "multi-token prediction layers are not supported")
    # transformers' NemotronHForCausalLM never ties its lm_head to the embedding
    _refuse(raw, "tie_word_embeddings", (None, False), "tied embeddings are not supported")

    layer_types = parse_block_types(raw)
    # the experts' fields, intermediate_size (each expert's width) among them; 0: no experts
    experts = nemotron_h_moe.moe_fields(raw) if MOE in layer_types else dict(intermediate_size=0)
    hidden_size = required(raw, "hidden_size")
    num_heads = raw.get("num_attention_heads", 32)
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    head_dim = raw.get("head_dim", raw.get("attention_head_dim", 128))
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    mamba_n_heads = raw.get("mamba_num_heads", 128)
    mamba_n_groups = _either(raw, "n_groups", "mamba_n_groups", 8)
    if mamba_n_heads % mamba_n_groups != 0:
        raise ValueError(f"n_groups={mamba_n_groups} must divide mamba_num_heads={mamba_n_heads}")

    return HybridModelConfig(
        model_type=MODEL_TYPE,
        vocab_size=required(raw, "vocab_size"),
        hidden_size=hidden_size,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        attention_bias=False,
        # the MLP blocks' width, which engine/parallel/shard_layout.py splits as mlp_channels
        shared_intermediate_size=required(raw, "intermediate_size"),
        hidden_act="relu2",
        mamba_n_heads=mamba_n_heads,
        mamba_d_head=raw.get("mamba_head_dim", 64),  # I = mamba_num_heads * mamba_head_dim
        mamba_d_state=raw.get("ssm_state_size", 128),
        mamba_n_groups=mamba_n_groups,
        mamba_d_conv=_either(raw, "conv_kernel", "mamba_d_conv", 4),
        mamba_expand=_either(raw, "expand", "mamba_expand", 2),
        mamba_chunk_size=_either(raw, "chunk_size", "mamba_chunk_size", 128),
        mamba_conv_bias=bool(_either(raw, "use_conv_bias", "mamba_conv_bias", True)),
        mamba_proj_bias=bool(raw.get("use_bias", False)),  # in_proj and out_proj
        rms_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        rope_theta=None,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        embedding_multiplier=1.0,
        attention_multiplier=head_dim**-0.5,
        residual_multiplier=1.0,
        logits_scaling=1.0,
        # transformers' chunked scan clamps at (time_step_min, inf) instead, its decode step not
        # at all; the published checkpoints' (and mamba_ssm's) clamp is time_step_limit.
        time_step_limit=parse_time_step_limit(_either(raw, "time_step_limit", "mamba_dt_limit", None)),
        tie_word_embeddings=False,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=parse_eos_token_ids(raw),
        pad_token_id=raw.get("pad_token_id"),
        dtype=parse_dtype(raw),
        **experts,
    )


class NemotronHBlock(nn.Module):
    """x += mixer(norm(x)); the mixer is a Mamba2Mixer, a PagedAttention, a SquaredReluMLP or
    a NemotronHMoE (config.layer_types[layer_index]); `kind` says which."""

    def __init__(
        self, config: HybridModelConfig, layer_index: int, layout: RankShardLayout,
        tp: TensorParallel, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.kind = config.layer_types[layer_index]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if self.kind == MAMBA:
            self.mixer = Mamba2Mixer(config, layout, tp, dtype)
        elif self.kind == ATTENTION:
            self.mixer = PagedAttention(config, layout, tp, dtype)
        elif self.kind == MOE:
            self.mixer = NemotronHMoE(config, layout, tp, dtype)
        else:
            self.mixer = SquaredReluMLP(
                config.hidden_size, config.shared_intermediate_size, layout.mlp_channels, tp, dtype
            )

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """The PyTorch path: (T, D) -> (T, D); writes this block's KV or state slots (a Mamba
        or attention block) in `caches`."""
        return hidden + self.mix(self.norm(hidden), batch, caches, None)

    def forward_gpu(
        self,
        hidden: torch.Tensor,  # (T, D), the residual stream before the previous block's add
        pending: torch.Tensor | None,  # (T, D) the previous block's mixer output; None for block 0
        batch: ForwardBatch,
        caches: ModelCaches,
        gpu_plan: GpuBatchPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same block on CUDA: the previous block's residual add runs inside this block's
        RMSNorm (engine/kernels/gpu/fused_norm.py), and this block's output goes out as the
        next `pending`. Returns (hidden, pending): the stream is hidden + pending."""
        from engine.kernels.gpu.fused_norm import add_rms_norm

        hidden, mixer_in = add_rms_norm(hidden, pending, 1.0, self.norm.weight, self.norm.eps)
        return hidden, self.mix(mixer_in, batch, caches, gpu_plan)

    def mix(
        self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, gpu_plan: GpuBatchPlan | None,
    ) -> torch.Tensor:
        """The mixer on the normed input (T, D) -> (T, D): the PyTorch path without a plan,
        the kernels the plan chose with one."""
        i = self.layer_index
        if self.kind == MAMBA:
            captures = None
            if gpu_plan is not None and gpu_plan.in_pass is not None:
                captures = (gpu_plan.in_pass.conv_out[i], gpu_plan.in_pass.ssm_out[i])
            return self.mixer(x, batch, caches.conv_state[i], caches.ssm_state[i], gpu_plan, captures)
        if self.kind == ATTENTION:
            return self.mixer(x, batch, caches.key_cache[i], caches.value_cache[i], None, gpu_plan,
                              caches.kv_scale.get(i))
        return self.mixer(x) if gpu_plan is None else self.mixer.forward_gpu(x)


class NemotronHModel(RankCaches, nn.Module):
    """Embedding, blocks, final norm (norm_f); lm_head for logits (never tied: parse_config
    refuses tie_word_embeddings). tp: the rank this model is built for; None means unsharded."""

    def __init__(
        self, config: HybridModelConfig, dtype: torch.dtype = torch.float32,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp if tp is not None else TensorParallel.single()
        self.layout = rank_shard_layout(config, self.tp)
        self.embeddings = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, self.layout, self.tp, dtype
        )
        self.layers = nn.ModuleList(
            NemotronHBlock(config, i, self.layout, self.tp, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm_f = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = VocabParallelLMHead(config.vocab_size, config.hidden_size, self.layout, dtype)
        self.mtp = None  # no multi-token-prediction head (HybridModel.mtp)

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        """The embedding under the name the CUDA graph runners read its device from
        (engine/routes/decode_graphs.py, engine/routes/prefill_graphs.py)."""
        return self.embeddings

    def forward(
        self, batch: ForwardBatch, caches: ModelCaches, gpu_plan: GpuBatchPlan | None = None
    ) -> torch.Tensor:
        """Hidden states (T, D) after the final norm; the caches and gpu_plan contracts of
        GraniteMoeHybridModel.forward (MLP and MoE blocks touch no cache)."""
        if gpu_plan is None and self.embeddings.weight.is_cuda:
            raise ValueError("a forward pass on CUDA takes the step's GpuBatchPlan (engine/routes/forward_routes.py)")
        hidden = self.embeddings(batch.input_ids)  # (T, D)
        if gpu_plan is not None:
            return self._forward_layers_gpu(hidden, batch, caches, gpu_plan)
        for layer in self.layers:
            hidden = layer(hidden, batch, caches)
        return self.norm_f(hidden)

    def _forward_layers_gpu(self, hidden, batch, caches, gpu_plan) -> torch.Tensor:
        """The blocks and the final norm on CUDA, residual adds fused into the norms
        (NemotronHBlock.forward_gpu); the last block's add runs inside the final norm."""
        from engine.kernels.gpu.fused_norm import add_rms_norm

        pending = None
        for layer in self.layers:
            hidden, pending = layer.forward_gpu(hidden, pending, batch, caches, gpu_plan)
        return add_rms_norm(hidden, pending, 1.0, self.norm_f.weight, self.norm_f.eps)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, D) -> (n, vocab) fp32, the full vocabulary on every rank."""
        return vocab_parallel_logits(
            hidden, self.lm_head.weight, self.config.vocab_size, self.layout, self.tp
        ).float()

    def _blocks(self, kind: str) -> list[nn.Module]:
        return [layer.mixer for layer in self.layers if layer.kind == kind]

    def folds_gated_norm(self) -> bool:
        """Whether every Mamba2 mixer folds its gated norm at a one-row decode step (never with
        more than one norm group on a rank: Mamba2Mixer.folds_gated_norm)."""
        return all(mixer.folds_gated_norm() for mixer in self._blocks(MAMBA))

    def stack_projections(self) -> None:
        """Stack each attention mixer's q, k and v weights (PagedAttention.stack_projections)."""
        for mixer in self._blocks(ATTENTION):
            mixer.stack_projections()

    def parameter_shards(self) -> dict[str, TensorShard]:
        """Parameter name -> the shard of its checkpoint tensor this rank holds."""
        return parameter_shards(self)

    def mamba_state_shape(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """This rank's ((conv_dim, K-1), (H, P, N)) of one state slot of one Mamba2 block."""
        return cache_capacity.mamba_state_shape(self.config, self.layout)
