"""Qwen3-Next: gated delta-net (linear attention) and gated full-attention blocks, each followed
by an MLP, with zero-centred RMSNorms and multi-token-prediction weights.

Numerically the same model as transformers' Qwen3NextForCausalLM, run over a ForwardBatch
like every family (engine/interfaces/forward_batch.py). Each layer's MLP is the one transformers chooses:
a sparse MoE block (SparseMoeBlock: routed experts, engine/layers/routed_experts.py, plus a
gated shared expert) when num_experts > 0, the layer is not in mlp_only_layers and (layer + 1)
divides by decoder_sparse_step; otherwise a dense MLP (SplitGatedMLP of intermediate_size
channels), so one model may mix the two (HybridModelConfig.dense_mlp_layers). A gated
delta-net's per-request state lives in the same state slot tensors as a Mamba2 layer's, with
its own shapes (conv (2 Hk dk + Hv dv, K-1), recurrent (Hv, dk, dv) fp32;
engine/parallel/cache_capacity.py recurrent_state_shape), so checkpoints, import checks and transfer
move it unchanged.

Parameter names equal the checkpoint's with the leading "model." removed (lm_head.weight and
mtp.* stay as they are), except the experts': the router `mlp.gate.weight` is
`mlp.experts.router.layer.weight`, and each expert's `mlp.experts.{e}.gate_proj / up_proj /
down_proj.weight` is a piece (stacked_piece) of the stacked `mlp.experts.input_linear.weight`
(E, 2I, D) = [gate | up] and `mlp.experts.output_linear.weight` (E, D, I), written there by the
loader (engine/execution/loader.py load_piece), each rank its channels of every expert.

MTP: with num_mtp_layers > 0 (config.json's num_nextn_predict_layers or
mtp_num_hidden_layers; the published releases name neither, so complete_config counts the
checkpoint's mtp.layers.{j}) the checkpoint's mtp.* tensors load into `self.mtp`
(engine/models/mtp_head.py MultiTokenPredictionHead), which the forward does not use: the MTP
drafter runs it (speculative_drafter mtp, engine/speculative/mtp.py).

Tensor parallel: as GraniteMoeHybrid (engine/parallel/shard_layout.py: attention heads, KV heads,
gated delta-net key and value heads, MLP channels, vocabulary rows); hidden states (T, D) are
whole on every rank between layers.
"""

from __future__ import annotations

from typing import Any

import re

import torch
from torch import nn

from engine.interfaces.forward_batch import ForwardBatch, ModelCaches
from engine.kernels.gpu.batch_plan import GpuBatchPlan
from engine.layers.attention import PagedAttention
from engine.layers.gated_delta_net import GatedDeltaNet
from engine.layers.mlp import SplitGatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.parallel_linear import linear
from engine.layers.rotary import RotaryEmbedding
from engine.layers.routed_experts import RoutedExperts, Routing, RoutingRule
from engine.layers.vocab_parallel import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    vocab_parallel_logits,
)
from engine.model_config import (
    ATTENTION,
    GATED_DELTA_NET,
    MLP_SPLIT,
    HybridModelConfig,
    as_float,
    parse_dtype,
    parse_eos_token_ids,
    parse_layer_types,
    parse_rope_base,
    required,
)
from engine.models.model_caches import RankCaches
from engine.models.mtp_head import MultiTokenPredictionHead
from engine.parallel.shard_layout import RankShardLayout, rank_shard_layout
from engine.parallel.tensor_parallel import StackedPiece, TensorParallel, TensorShard, parameter_shards

MODEL_TYPE = "qwen3_next"

_LAYER_TYPES = {"linear_attention": GATED_DELTA_NET, "full_attention": ATTENTION}


def parse_config(raw: dict[str, Any]) -> HybridModelConfig:
    """Normalise a qwen3_next config.json dict; ValueError naming the field it cannot accept
    (another activation, RoPE scaling, head counts that do not group, MTP layers in a model
    that mixes dense and sparse MLP layers).

    The layers transformers gives a sparse MoE block (_sparse_layers) hold the experts; in a
    model with experts the others are dense_mlp_layers, each a dense MLP of intermediate_size
    channels (dense_intermediate_size)."""
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {hidden_act!r}")
    hidden_size = required(raw, "hidden_size")
    num_layers = required(raw, "num_hidden_layers")
    sparse = _sparse_layers(raw, num_layers)
    dense_mlp_layers = tuple(i for i in range(num_layers) if i not in sparse) if sparse else ()
    num_mtp_layers = int(raw.get("num_nextn_predict_layers") or raw.get("mtp_num_hidden_layers") or 0)
    if dense_mlp_layers and num_mtp_layers:
        raise ValueError(
            f"mlp_only_layers / decoder_sparse_step leave layers {list(dense_mlp_layers)} dense "
            f"and the others sparse, with {num_mtp_layers} MTP layers (num_nextn_predict_layers, "
            "or the checkpoint's mtp.layers.*): MTP layers in such a model are not supported"
        )
    num_experts = raw.get("num_experts", 512) if sparse else 0  # transformers' default: 512
    top_k = raw.get("num_experts_per_tok", 10) if sparse else 0
    if sparse and not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
    layer_types = raw.get("layer_types")
    if layer_types is None:  # transformers' default: every full_attention_interval-th layer
        interval = raw.get("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(num_layers)]
    num_heads = required(raw, "num_attention_heads")
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    head_dim = raw.get("head_dim") or 256  # transformers' default
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    key_heads, value_heads = raw.get("linear_num_key_heads", 16), raw.get("linear_num_value_heads", 32)
    if value_heads % key_heads != 0:
        raise ValueError(
            f"linear_num_value_heads={value_heads} is not a multiple of linear_num_key_heads={key_heads}"
        )
    rope_parameters = raw.get("rope_parameters") or {}
    partial_rotary_factor = as_float(
        rope_parameters.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)),
        "partial_rotary_factor",
    )
    if int(head_dim * partial_rotary_factor) % 2 != 0:
        raise ValueError(f"partial_rotary_factor={partial_rotary_factor} gives an odd rotary dim")
    # the MLP widths in the engine's terms: routed experts' (intermediate_size) and the dense
    # MLP's or the shared expert's (shared_intermediate_size)
    if sparse:
        intermediate_size = raw.get("moe_intermediate_size", 512)
        shared_size = raw.get("shared_expert_intermediate_size", 512)
    else:
        intermediate_size = shared_size = required(raw, "intermediate_size")
    dense_intermediate_size = required(raw, "intermediate_size") if dense_mlp_layers else 0
    return HybridModelConfig(
        model_type=MODEL_TYPE,
        vocab_size=required(raw, "vocab_size"),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        layer_types=parse_layer_types(layer_types, num_layers, _LAYER_TYPES),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        attention_bias=bool(raw.get("attention_bias", False)),
        intermediate_size=intermediate_size,
        shared_intermediate_size=shared_size,
        hidden_act=hidden_act,
        mamba_n_heads=0, mamba_d_head=0, mamba_d_state=0, mamba_n_groups=1, mamba_d_conv=0,
        mamba_expand=0, mamba_chunk_size=0, mamba_conv_bias=False, mamba_proj_bias=False,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=parse_rope_base(raw),
        max_position_embeddings=raw.get("max_position_embeddings", 32768),
        embedding_multiplier=1.0,
        attention_multiplier=head_dim ** -0.5,
        residual_multiplier=1.0,
        logits_scaling=1.0,
        time_step_limit=(0.0, float("inf")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=parse_eos_token_ids(raw),
        pad_token_id=raw.get("pad_token_id"),
        dtype=parse_dtype(raw),
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=raw.get("linear_key_head_dim", 128),
        linear_value_head_dim=raw.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=raw.get("linear_conv_kernel_dim", 4),
        attention_output_gate=True,
        qk_norm=True,
        partial_rotary_factor=partial_rotary_factor,
        zero_centered_norm=True,
        num_mtp_layers=num_mtp_layers,
        mlp_layout=MLP_SPLIT,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)) if sparse else False,
        dense_mlp_layers=dense_mlp_layers,
        dense_intermediate_size=dense_intermediate_size,
    )


_MTP_LAYER_TENSOR = re.compile(r"^mtp\.layers\.(\d+)\.")


def complete_config(raw: dict[str, Any], tensor_names: list[str]) -> dict[str, Any]:
    """config.json with num_nextn_predict_layers set to the checkpoint's count of
    mtp.layers.{j} when it names no MTP layer count (the published releases ship the MTP
    weights without the key); as it is otherwise."""
    if "num_nextn_predict_layers" in raw or "mtp_num_hidden_layers" in raw:
        return raw
    layers = {int(m.group(1)) for name in tensor_names if (m := _MTP_LAYER_TENSOR.match(name))}
    return {**raw, "num_nextn_predict_layers": len(layers)} if layers else raw


def _sparse_layers(raw: dict[str, Any], num_layers: int) -> list[int]:
    """The layers transformers gives a sparse MoE block: not in mlp_only_layers, num_experts >
    0 and (i + 1) divisible by decoder_sparse_step."""
    num_experts = raw.get("num_experts", 512)  # transformers' default
    step = raw.get("decoder_sparse_step", 1)
    dense = set(raw.get("mlp_only_layers") or [])
    if not num_experts:
        return []
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]


_EXPERT_TENSOR = re.compile(
    r"^(?:model\.)?((?:mtp\.)?layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_ROUTER_TENSOR = re.compile(r"^(?:model\.)?((?:mtp\.)?layers\.\d+\.mlp)\.gate\.weight$")


def parameter_name(checkpoint_name: str) -> str:
    """"model." stripped; a sparse block's router `...mlp.gate.weight` is
    `...mlp.experts.router.layer.weight` (RoutedExperts' name)."""
    router = _ROUTER_TENSOR.match(checkpoint_name)
    if router is not None:
        return f"{router.group(1)}.experts.router.layer.weight"
    return checkpoint_name.removeprefix("model.")


def stacked_piece(checkpoint_name: str, config: HybridModelConfig) -> StackedPiece | None:
    """An expert's gate_proj / up_proj (I, D) is rows [0, I) / [I, 2I) of its slice of the
    stacked input_linear (E, 2I, D); its down_proj (D, I) is its slice of output_linear
    (E, D, I). None for every other tensor."""
    match = _EXPERT_TENSOR.match(checkpoint_name)
    if match is None:
        return None
    experts, index, projection = match.group(1), int(match.group(2)), match.group(3)
    if projection == "down_proj":
        return StackedPiece(f"{experts}.output_linear.weight", index, dim=2, offset=0)
    offset = 0 if projection == "gate_proj" else config.intermediate_size
    return StackedPiece(f"{experts}.input_linear.weight", index, dim=1, offset=offset)


class SparseMoeBlock(nn.Module):
    """experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x): routed experts
    (softmax over all experts, the top num_experts_per_tok, renormalised with norm_topk_prob)
    and a gated shared expert (Llama-layout MLP of shared_intermediate_size channels).

    Tensor parallel: the experts split each expert's channels (layout.expert_channels), the
    shared expert its channels (layout.mlp_channels); the router and the (1, D) shared-expert
    gate are replicated, so the gate scales each rank's partial sum of the shared expert alike,
    and the two partial sums are added before one all-reduce.
    """

    def __init__(
        self, config: HybridModelConfig, layout: RankShardLayout, tp: TensorParallel,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        D = config.hidden_size
        routing = Routing(RoutingRule.SOFTMAX_THEN_TOP_K, config.num_experts_per_tok, config.norm_topk_prob)
        self.experts = RoutedExperts(
            D, config.intermediate_size, config.num_local_experts, routing, layout.expert_channels, tp, dtype
        )
        self.shared_expert = SplitGatedMLP(D, config.shared_intermediate_size, layout.mlp_channels, tp, dtype)
        self.shared_expert_gate = nn.Linear(D, 1, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, D) -> (T, D)
        gate = torch.sigmoid(linear(x, self.shared_expert_gate.weight, None))  # (T, 1)
        partial = self.experts(x, reduce=False) + gate * self.shared_expert(x, reduce=False)
        return self.experts.tp.all_reduce(partial)

    def forward_gpu(self, x: torch.Tensor) -> torch.Tensor:  # (T, D) -> (T, D)
        """forward on CUDA: the experts' grouped GEMM, the shared expert's GPU path."""
        gate = torch.sigmoid(linear(x, self.shared_expert_gate.weight, None))  # (T, 1)
        partial = self.experts.forward_gpu(x, reduce=False) + gate * self.shared_expert.forward_gpu(x, reduce=False)
        return self.experts.tp.all_reduce(partial)


class DecoderLayer(nn.Module):
    """x += mixer(norm(x)); x += mlp(norm(x)), both norms zero-centred.

    The mixer is `linear_attn` (GatedDeltaNet) or `self_attn` (PagedAttention with the output
    gate, q/k norms and partial rotary); the other is absent. `mlp` is a SparseMoeBlock where
    config.has_routed_experts(layer_index) (transformers' choice: not in mlp_only_layers and
    (layer_index + 1) divisible by decoder_sparse_step), otherwise the dense SplitGatedMLP:
    dense_intermediate_size channels in a model with experts, shared_intermediate_size in a
    dense one.
    """

    def __init__(
        self, config: HybridModelConfig, kind: str, layer_index: int, layout: RankShardLayout,
        tp: TensorParallel, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, zero_centered=True)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.self_attn: PagedAttention | None = None
        self.linear_attn: GatedDeltaNet | None = None
        if kind == ATTENTION:
            self.self_attn = PagedAttention(config, layout, tp, dtype)
        else:
            self.linear_attn = GatedDeltaNet(config, layout, tp, dtype)
        self.mlp: SplitGatedMLP | SparseMoeBlock
        if config.has_routed_experts(layer_index):
            self.mlp = SparseMoeBlock(config, layout, tp, dtype)
        elif config.num_local_experts:  # one of dense_mlp_layers
            self.mlp = SplitGatedMLP(
                config.hidden_size, config.dense_intermediate_size, layout.dense_mlp_channels, tp, dtype
            )
        else:
            self.mlp = SplitGatedMLP(
                config.hidden_size, config.shared_intermediate_size, layout.mlp_channels, tp, dtype
            )

    def forward(
        self,
        hidden: torch.Tensor,  # (T, D)
        batch: ForwardBatch,
        caches: ModelCaches,
        rope: tuple[torch.Tensor, torch.Tensor],
        gpu_plan: GpuBatchPlan | None = None,
    ) -> torch.Tensor:
        """Returns the new hidden (T, D); writes this layer's KV or state slots in `caches`.
        No plan: the PyTorch path. gpu_plan: forward_gpu's kernels for a layer run on its own
        (the MTP head's, engine/models/mtp_head.py), its pending MLP output added here; the
        model's own layers chain forward_gpu instead, each add fused into the next norm."""
        if gpu_plan is not None:
            hidden, pending = self.forward_gpu(hidden, None, batch, caches, rope, gpu_plan)
            return hidden + pending
        mixer_in = self.input_layernorm(hidden)
        hidden = hidden + self.mix(mixer_in, batch, caches, rope, None)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_gpu(
        self,
        hidden: torch.Tensor,  # (T, D), the residual stream before the previous layer's MLP add
        pending: torch.Tensor | None,  # (T, D) the previous layer's MLP output; None for layer 0
        batch: ForwardBatch,
        caches: ModelCaches,
        rope: tuple[torch.Tensor, torch.Tensor],
        gpu_plan: GpuBatchPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer on CUDA: each residual add runs inside the zero-centred norm that
        follows it (engine/kernels/gpu/fused_norm.py add_rms_norm, one launch each), so the
        previous layer's MLP output comes in as `pending` and this layer's goes out the same
        way. Returns (hidden, pending): the stream is hidden + pending. Same caches contract as
        forward; the mixer and the MLP run the kernels gpu_plan chose."""
        from engine.kernels.gpu.fused_norm import add_rms_norm

        norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
        hidden, mixer_in = add_rms_norm(hidden, pending, 1.0, norm_in.weight, norm_in.eps, zero_centered=True)
        mixed = self.mix(mixer_in, batch, caches, rope, gpu_plan)
        hidden, mlp_in = add_rms_norm(hidden, mixed, 1.0, norm_post.weight, norm_post.eps, zero_centered=True)
        return hidden, self.mlp.forward_gpu(mlp_in)

    def mix(
        self,
        mixer_in: torch.Tensor,  # (T, D), input_layernorm's output
        batch: ForwardBatch,
        caches: ModelCaches,
        rope: tuple[torch.Tensor, torch.Tensor],
        gpu_plan: GpuBatchPlan | None,
    ) -> torch.Tensor:
        """The mixer's output (T, D), not yet added to the stream: attention over this layer's
        KV cache or the gated delta-net over its state slots (with gpu_plan.in_pass, its
        captures written), either written in `caches`."""
        i = self.layer_index
        if self.self_attn is not None:
            return self.self_attn(mixer_in, batch, caches.key_cache[i], caches.value_cache[i], rope, gpu_plan,
                                  caches.kv_scale.get(i))
        in_pass = None if gpu_plan is None else gpu_plan.in_pass
        captures = None if in_pass is None else (in_pass.conv_out[i], in_pass.ssm_out[i])
        return self.linear_attn(mixer_in, batch, caches.conv_state[i], caches.ssm_state[i], gpu_plan, captures)


def mtp_head(
    config: HybridModelConfig, layout: RankShardLayout, tp: TensorParallel, dtype: torch.dtype,
) -> MultiTokenPredictionHead:
    """The checkpoint's mtp.* tensors: Qwen3-Next's MTP head (engine/models/mtp_head.py), its
    norms zero-centred and its num_mtp_layers full-attention decoder layers numbered from
    num_hidden_layers (the main layers' shapes and sharding)."""
    layers = [DecoderLayer(config, ATTENTION, config.num_hidden_layers + j, layout, tp, dtype)
              for j in range(config.num_mtp_layers)]
    return MultiTokenPredictionHead(config.hidden_size, config.rms_norm_eps, dtype, True, layers)


class Qwen3NextModel(RankCaches, nn.Module):
    """Embedding, decoder layers, final zero-centred norm; lm_head for logits; `mtp` holds
    the multi-token-prediction weights (None without them).

    With tie_word_embeddings the LM head is embed_tokens.weight and there is no lm_head module.
    tp: the rank this model is built for; None means TensorParallel.single() (unsharded).
    The methods' contracts are GraniteMoeHybridModel's (engine/models/registry.py HybridModel).
    """

    def __init__(
        self, config: HybridModelConfig, dtype: torch.dtype = torch.float32,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp if tp is not None else TensorParallel.single()
        self.layout = rank_shard_layout(config, self.tp)
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, self.layout, self.tp, dtype
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, kind, i, self.layout, self.tp, dtype)
            for i, kind in enumerate(config.layer_types)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, zero_centered=True)
        self.lm_head: VocabParallelLMHead | None = None
        if not config.tie_word_embeddings:
            self.lm_head = VocabParallelLMHead(config.vocab_size, config.hidden_size, self.layout, dtype)
        self.mtp: MultiTokenPredictionHead | None = None
        if config.num_mtp_layers:
            self.mtp = mtp_head(config, self.layout, self.tp, dtype)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rotary_dim)

    def forward(
        self, batch: ForwardBatch, caches: ModelCaches, gpu_plan: GpuBatchPlan | None = None
    ) -> torch.Tensor:
        """Hidden states (T, D) after the final norm; mutates `caches` (KV of every token,
        every chunk's state slot: state in -> state out, zeros for reset_state).

        gpu_plan: required on CUDA (ValueError without), where the mixers run their kernels
        over it and every residual add runs inside the zero-centred norm after it; with in-pass
        captures (gpu_plan.in_pass) each gated delta-net layer writes its states at the capture
        positions into the plan's buffers."""
        if gpu_plan is None and self.embed_tokens.weight.is_cuda:
            raise ValueError("a forward pass on CUDA takes the step's GpuBatchPlan (engine/routes/forward_routes.py)")
        hidden = self.embed_tokens(batch.input_ids)  # (T, D)
        rope = self.rotary(batch.positions)  # (cos, sin), each (T, rotary_dim)
        if gpu_plan is not None:
            return self._forward_layers_gpu(hidden, batch, caches, rope, gpu_plan)
        for layer in self.layers:
            hidden = layer(hidden, batch, caches, rope)
        return self.norm(hidden)

    def _forward_layers_gpu(self, hidden, batch, caches, rope, gpu_plan) -> torch.Tensor:
        """The decoder layers and the final norm on CUDA, residual adds fused into the
        zero-centred norms (DecoderLayer.forward_gpu); the last MLP's add runs inside the final
        norm."""
        from engine.kernels.gpu.fused_norm import add_rms_norm

        pending = None
        for layer in self.layers:
            hidden, pending = layer.forward_gpu(hidden, pending, batch, caches, rope, gpu_plan)
        return add_rms_norm(hidden, pending, 1.0, self.norm.weight, self.norm.eps, zero_centered=True)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, D) -> (n, vocab) fp32: lm_head(hidden) in the model dtype, then fp32; every rank
        returns the full vocabulary."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_parallel_logits(hidden, weight, self.config.vocab_size, self.layout, self.tp).float()

    def folds_gated_norm(self) -> bool:
        """No Mamba2 mixer: nothing to fold."""
        return False

    def stack_projections(self) -> None:
        """Stack each attention layer's q, k and v weights (PagedAttention.stack_projections)."""
        layers = [*self.layers, *(self.mtp.layers if self.mtp is not None else ())]
        for layer in layers:
            if layer.self_attn is not None:
                layer.self_attn.stack_projections()

    def parameter_shards(self) -> dict[str, TensorShard]:
        """Parameter name -> the shard of its checkpoint tensor this rank holds."""
        return parameter_shards(self)
