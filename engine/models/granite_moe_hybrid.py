"""GraniteMoeHybrid: Mamba2 and attention blocks, each followed by a gated MLP ("shared_mlp")
and, when num_local_experts > 0, routed experts added to it ("block_sparse_moe",
engine/layers/routed_experts.py: top-k of the router logits, softmax over those k).

Numerically the same model as transformers' GraniteMoeHybridForCausalLM, dense or with
experts, run over a ForwardBatch of chunks from many requests, with KV in paged
blocks and recurrent state in per-request slots (engine/interfaces/forward_batch.py).

Parameter names equal the checkpoint's with the leading "model." removed (lm_head.weight
stays as it is); engine/execution/loader.py relies on that.

Tensor parallel: the model is built for one rank of a TensorParallel context; every layer
holds that rank's shard (engine/parallel/shard_layout.py says which heads, groups and channels) and
calls the context's collectives. Hidden states (T, D) are whole on every rank between layers.
With TensorParallel.single() it is the unsharded model and calls no collective. The experts
split each expert's channels like the shared MLP's; both partial sums are added before the
layer's one all-reduce.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from engine.interfaces.forward_batch import ForwardBatch, ModelCaches
from engine.kernels.gpu.batch_plan import GpuBatchPlan
from engine.layers.attention import PagedAttention
from engine.layers.mamba2 import Mamba2Mixer
from engine.layers.mlp import dense_mlp
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.layers.routed_experts import RoutedExperts, Routing, RoutingRule
from engine.layers.vocab_parallel import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    vocab_parallel_logits,
)
from engine.model_config import (
    ATTENTION,
    HybridModelConfig,
    parse_layer_types,
    parse_rope_theta,
    required,
)
from engine.models.config_fields import attention_fields, mamba_fields, token_fields
from engine.models.model_caches import RankCaches
from engine.models.mtp_head import MultiTokenPredictionHead, randomize
from engine.parallel import cache_capacity
from engine.parallel.shard_layout import RankShardLayout, rank_shard_layout
from engine.parallel.tensor_parallel import TensorParallel, TensorShard, parameter_shards


MODEL_TYPE = "granitemoehybrid"


def parse_config(raw: dict[str, Any]) -> HybridModelConfig:
    """Normalise a granitemoehybrid config.json dict; raises ValueError naming the field it
    cannot accept."""
    num_experts, top_k, intermediate_size = _parse_experts(raw)
    attention = attention_fields(raw)
    num_layers = attention["num_hidden_layers"]
    mamba = mamba_fields(raw, attention["hidden_size"])
    return HybridModelConfig(
        model_type=MODEL_TYPE,
        vocab_size=required(raw, "vocab_size"),
        **attention,
        layer_types=parse_layer_types(raw.get("layer_types"), num_layers),
        intermediate_size=intermediate_size,
        shared_intermediate_size=required(raw, "shared_intermediate_size"),
        **mamba,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=parse_rope_theta(raw),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        attention_multiplier=float(raw.get("attention_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
        **token_fields(raw),
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
    )


# transformers' GraniteMoeHybridConfig defaults, which apply when config.json lacks the field:
# an absent num_local_experts means 8 experts (MoE), not a dense model.
_DEFAULT_NUM_EXPERTS = 8
_DEFAULT_EXPERTS_PER_TOKEN = 2
_DEFAULT_EXPERT_CHANNELS = 11008


def _parse_experts(raw: dict[str, Any]) -> tuple[int, int, int]:
    """(num_local_experts, num_experts_per_tok, intermediate_size); a dense model (0 experts)
    gets 0 experts per token and keeps intermediate_size as written (unused)."""
    num_experts = raw.get("num_local_experts", _DEFAULT_NUM_EXPERTS)
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 0:
        raise ValueError(f"num_local_experts must be an integer >= 0, got {num_experts!r}")
    if num_experts == 0:
        return 0, 0, raw.get("intermediate_size") or 0
    top_k = raw.get("num_experts_per_tok", _DEFAULT_EXPERTS_PER_TOKEN)
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"num_experts_per_tok must be an integer in [1, num_local_experts={num_experts}], "
            f"got {top_k!r}"
        )
    intermediate_size = raw.get("intermediate_size", _DEFAULT_EXPERT_CHANNELS)
    if not isinstance(intermediate_size, int) or intermediate_size <= 0:
        raise ValueError(f"intermediate_size must be a positive integer, got {intermediate_size!r}")
    return num_experts, top_k, intermediate_size


class DecoderLayer(nn.Module):
    """x += r * mixer(norm(x)); x += r * mlp(norm(x)), r = residual_multiplier.

    The mixer is `mamba` (Mamba2Mixer) or `self_attn` (PagedAttention); the other is absent.
    mlp is `shared_mlp` (GatedMLP), plus `block_sparse_moe` (RoutedExperts) when the model has
    experts (None otherwise): their partial sums are added, then all-reduced once.
    """

    def __init__(
        self, config: HybridModelConfig, layer_index: int, layout: RankShardLayout,
        tp: TensorParallel, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.residual_multiplier = config.residual_multiplier
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn: PagedAttention | None = None
        self.mamba: Mamba2Mixer | None = None
        if config.layer_types[layer_index] == ATTENTION:
            self.self_attn = PagedAttention(config, layout, tp, dtype)
        else:
            self.mamba = Mamba2Mixer(config, layout, tp, dtype)
        self.shared_mlp = dense_mlp(config, layout.mlp_channels, tp, dtype)  # config.mlp_layout
        self.tp = tp
        self.block_sparse_moe: RoutedExperts | None = None
        if config.num_local_experts > 0:
            routing = Routing(RoutingRule.TOP_K_THEN_SOFTMAX, config.num_experts_per_tok)
            self.block_sparse_moe = RoutedExperts(
                config.hidden_size, config.intermediate_size, config.num_local_experts, routing,
                layout.expert_channels, tp, dtype,
            )

    def mlp(self, x: torch.Tensor) -> torch.Tensor:  # (T, D) -> (T, D)
        """shared_mlp(x), plus the routed experts' output when there are experts (PyTorch path)."""
        if self.block_sparse_moe is None:
            return self.shared_mlp(x)
        partial = self.block_sparse_moe(x, reduce=False) + self.shared_mlp(x, reduce=False)
        return self.tp.all_reduce(partial)

    def mlp_gpu(self, x: torch.Tensor) -> torch.Tensor:  # (T, D) -> (T, D)
        """mlp on CUDA: GatedMLP.forward_gpu and RoutedExperts.forward_gpu (grouped GEMM)."""
        if self.block_sparse_moe is None:
            return self.shared_mlp.forward_gpu(x)
        partial = (
            self.block_sparse_moe.forward_gpu(x, reduce=False)
            + self.shared_mlp.forward_gpu(x, reduce=False)
        )
        return self.tp.all_reduce(partial)

    def forward(
        self,
        hidden: torch.Tensor,  # (T, D)
        batch: ForwardBatch,
        caches: ModelCaches,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        gpu_plan: GpuBatchPlan | None = None,
    ) -> torch.Tensor:
        """Returns the new hidden (T, D); writes this layer's KV or state slots in `caches`.
        No plan: the PyTorch path. gpu_plan: forward_gpu's kernels for a layer run on its own
        (the MTP head's, engine/models/mtp_head.py), its pending MLP output added here; the
        model's own layers chain forward_gpu instead, each add fused into the next norm."""
        if gpu_plan is not None:
            hidden, pending = self.forward_gpu(hidden, None, batch, caches, rope, gpu_plan)
            return hidden + pending * self.residual_multiplier
        i = self.layer_index
        mixer_in = self.input_layernorm(hidden)
        if self.self_attn is not None:
            mixed = self.self_attn(mixer_in, batch, caches.key_cache[i], caches.value_cache[i], rope,
                                   kv_scale=caches.kv_scale.get(i))
        else:
            mixed = self.mamba(mixer_in, batch, caches.conv_state[i], caches.ssm_state[i])
        hidden = hidden + mixed * self.residual_multiplier
        mlp_out = self.mlp(self.post_attention_layernorm(hidden))
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
        """The same layer on CUDA with fused kernels: each residual add runs inside the RMSNorm
        that follows it (engine/kernels/gpu/fused_norm.py), so the previous layer's MLP output
        comes in as `pending` and this layer's goes out the same way. Returns (hidden, pending):
        the stream is hidden + pending * residual_multiplier. Same caches contract as forward;
        the mixers run the kernels gpu_plan chose."""
        from engine.kernels.gpu.fused_norm import add_rms_norm

        i, r = self.layer_index, self.residual_multiplier
        norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
        hidden, mixer_in = add_rms_norm(hidden, pending, r, norm_in.weight, norm_in.eps)
        if self.self_attn is not None:
            mixed = self.self_attn(
                mixer_in, batch, caches.key_cache[i], caches.value_cache[i], rope, gpu_plan,
                caches.kv_scale.get(i),
            )
        else:
            in_pass = gpu_plan.in_pass
            captures = None if in_pass is None else (in_pass.conv_out[i], in_pass.ssm_out[i])
            mixed = self.mamba(
                mixer_in, batch, caches.conv_state[i], caches.ssm_state[i], gpu_plan, captures
            )
        hidden, mlp_in = add_rms_norm(hidden, mixed, r, norm_post.weight, norm_post.eps)
        return hidden, self.mlp_gpu(mlp_in)


class GraniteMoeHybridModel(RankCaches, nn.Module):
    """Embedding (times embedding_multiplier), decoder layers, final norm; lm_head for logits.

    With tie_word_embeddings the LM head is embed_tokens.weight and there is no lm_head module.
    tp: the rank this model is built for; None means TensorParallel.single() (unsharded).
    decoder_layer: the layer class, built as (config, layer_index, layout, tp, dtype) and run
    through forward / forward_gpu as DecoderLayer's; a family whose layers differ (Falcon-H1)
    subclasses the model and names its own.
    """

    decoder_layer: type[nn.Module] = DecoderLayer

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
            self.decoder_layer(config, i, self.layout, self.tp, dtype)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head: VocabParallelLMHead | None = None
        if not config.tie_word_embeddings:
            self.lm_head = VocabParallelLMHead(
                config.vocab_size, config.hidden_size, self.layout, dtype
            )
        self.rotary = (
            RotaryEmbedding(config.head_dim, config.rope_theta, config.rotary_dim)
            if config.rope_theta is not None else None
        )
        # This family's checkpoints carry no MTP head; a seeded random one can be attached for
        # benchmarks and tests (random_mtp_head, EngineConfig.random_mtp_head_seed).
        self.mtp: MultiTokenPredictionHead | None = None

    def random_mtp_head(self, seed: int) -> MultiTokenPredictionHead:
        """A seeded random MTP head for this model (engine/models/mtp_head.py randomize): one
        attention DecoderLayer numbered num_hidden_layers, on the model's device and dtype, its
        projections stacked. Benchmarks and tests only: it drafts at random. ValueError for a
        subclass whose decoder layers are not this family's."""
        if self.decoder_layer is not DecoderLayer:
            raise ValueError(f"random_mtp_head_seed: no random MTP head for {type(self).__name__}")
        config, index = self.config, self.config.num_hidden_layers
        with_head = replace(config, num_hidden_layers=index + 1, layer_types=(*config.layer_types, ATTENTION))
        with torch.device(self.embed_tokens.weight.device):
            layer = DecoderLayer(with_head, index, self.layout, self.tp, self.dtype)
            head = MultiTokenPredictionHead(config.hidden_size, config.rms_norm_eps, self.dtype, False, [layer])
        randomize(head, seed)
        layer.self_attn.stack_projections()
        return head.eval().requires_grad_(False)

    def forward(
        self, batch: ForwardBatch, caches: ModelCaches, gpu_plan: GpuBatchPlan | None = None
    ) -> torch.Tensor:
        """Returns hidden states (T, D) after the final norm.

        Mutates `caches`: K/V of every token at batch.slot_mapping (attention layers) and the
        conv/SSM state slot of every chunk (Mamba layers: state in -> state out; a chunk with
        reset_state starts from zeros).

        gpu_plan: the step's chunk metadata on the device and its kernel choices, built by the
        step's forward route (engine/routes/forward_routes.py, or a CUDA graph runner over its static
        buffers): every layer then runs its Triton kernels as the plan says, and the batch's
        chunks are not read. None: the layers run their pure-PyTorch path, which CUDA weights
        do not take (ValueError).
        """
        if gpu_plan is None and self.embed_tokens.weight.is_cuda:
            raise ValueError("a forward pass on CUDA takes the step's GpuBatchPlan (engine/routes/forward_routes.py)")
        hidden = self.embed_tokens(batch.input_ids) * self.config.embedding_multiplier  # (T, D)
        rope = self.rotary(batch.positions) if self.rotary is not None else None
        if gpu_plan is not None:
            return self._forward_layers_gpu(hidden, batch, caches, rope, gpu_plan)
        for layer in self.layers:
            hidden = layer(hidden, batch, caches, rope)
        return self.norm(hidden)

    def _forward_layers_gpu(self, hidden, batch, caches, rope, gpu_plan) -> torch.Tensor:
        """The decoder layers and the final norm on CUDA, residual adds fused into the norms
        (DecoderLayer.forward_gpu); the last MLP's add runs inside the final norm."""
        from engine.kernels.gpu.fused_norm import add_rms_norm

        pending = None
        for layer in self.layers:
            hidden, pending = layer.forward_gpu(hidden, pending, batch, caches, rope, gpu_plan)
        r = self.layers[-1].residual_multiplier if len(self.layers) else 1.0
        return add_rms_norm(hidden, pending, r, self.norm.weight, self.norm.eps)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, D) -> (n, vocab) fp32: lm_head(hidden) / logits_scaling, in the model dtype first.

        Every rank returns the full vocabulary (gathered from the ranks' rows)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = vocab_parallel_logits(hidden, weight, self.config.vocab_size, self.layout, self.tp)
        return (logits / self.config.logits_scaling).float()

    def folds_gated_norm(self) -> bool:
        """Whether every Mamba mixer can fold its gated norm into its neighbours at a one-row
        decode step (Mamba2Mixer.folds_gated_norm): what the plan builders' fold_gated_norm
        takes. Fixed once the weights are loaded (and stacked)."""
        return all(layer.mamba.folds_gated_norm() for layer in self.layers if layer.mamba is not None)

    def stack_projections(self) -> None:
        """Stack each attention layer's q, k and v weights for its one GEMM
        (PagedAttention.stack_projections); engine/execution/loader.py calls it after loading."""
        for layer in self.layers:
            if layer.self_attn is not None:
                layer.self_attn.stack_projections()

    def parameter_shards(self) -> dict[str, TensorShard]:
        """Parameter name -> the shard of its checkpoint tensor this rank holds; parameters
        not listed (the RMSNorm weights, row-parallel biases) are held whole."""
        return parameter_shards(self)

    def mamba_state_shape(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """This rank's ((conv_dim, K-1), (H, P, N)) of one state slot of one Mamba layer."""
        return cache_capacity.mamba_state_shape(self.config, self.layout)
