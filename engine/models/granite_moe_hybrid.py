"""GraniteMoeHybrid (dense): Mamba2 and attention blocks, each followed by a gated MLP.

Numerically the same model as transformers' GraniteMoeHybridForCausalLM with
num_local_experts=0, run over a ForwardBatch of chunks from many requests, with KV in paged
blocks and recurrent state in per-request slots (engine/forward_batch.py).

Parameter names equal the checkpoint's with the leading "model." removed (lm_head.weight
stays as it is); engine/loader.py relies on that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_batch import ForwardBatch, ModelCaches
from engine.kernels.dispatch import GpuBatchPlan, plan_for_device
from engine.layers.attention import PagedAttention
from engine.layers.mamba2 import Mamba2Mixer
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import ATTENTION, HybridModelConfig


class DecoderLayer(nn.Module):
    """x += r * mixer(norm(x)); x += r * mlp(norm(x)), r = residual_multiplier.

    The mixer is `mamba` (Mamba2Mixer) or `self_attn` (PagedAttention); the other is absent.
    """

    def __init__(self, config: HybridModelConfig, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.residual_multiplier = config.residual_multiplier
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn: PagedAttention | None = None
        self.mamba: Mamba2Mixer | None = None
        if config.layer_types[layer_index] == ATTENTION:
            self.self_attn = PagedAttention(config, dtype)
        else:
            self.mamba = Mamba2Mixer(config, dtype)
        self.shared_mlp = GatedMLP(config.hidden_size, config.shared_intermediate_size, dtype)

    def forward(
        self,
        hidden: torch.Tensor,  # (T, D)
        batch: ForwardBatch,
        caches: ModelCaches,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        gpu_plan: GpuBatchPlan | None = None,
    ) -> torch.Tensor:
        """Returns the new hidden (T, D); writes this layer's KV or state slots in `caches`.

        gpu_plan (CUDA only) routes the mixer to its Triton kernels; None keeps the PyTorch path."""
        i = self.layer_index
        mixer_in = self.input_layernorm(hidden)
        if self.self_attn is not None:
            mixed = self.self_attn(
                mixer_in, batch, caches.key_cache[i], caches.value_cache[i], rope, gpu_plan
            )
        else:
            mixed = self.mamba(mixer_in, batch, caches.conv_state[i], caches.ssm_state[i], gpu_plan)
        hidden = hidden + mixed * self.residual_multiplier
        mlp_out = self.shared_mlp(self.post_attention_layernorm(hidden))
        return hidden + mlp_out * self.residual_multiplier


class GraniteMoeHybridModel(nn.Module):
    """Embedding (times embedding_multiplier), decoder layers, final norm; lm_head for logits.

    With tie_word_embeddings the LM head is embed_tokens.weight and there is no lm_head module.
    """

    def __init__(self, config: HybridModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.rotary = (
            RotaryEmbedding(config.head_dim, config.rope_theta) if config.rope_theta is not None else None
        )

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Returns hidden states (T, D) after the final norm.

        Mutates `caches`: K/V of every token at batch.slot_mapping (attention layers) and the
        conv/SSM state slot of every chunk (Mamba layers: state in -> state out; a chunk with
        reset_state starts from zeros).

        The kernel backend follows the weights' device: on CUDA the batch's chunk metadata is
        copied to the device once here and every layer runs its Triton kernels; elsewhere the
        layers run their pure-PyTorch path.
        """
        hidden = self.embed_tokens(batch.input_ids) * self.config.embedding_multiplier  # (T, D)
        rope = self.rotary(batch.positions) if self.rotary is not None else None
        gpu_plan = plan_for_device(batch, caches.block_size, hidden.device)
        for layer in self.layers:
            hidden = layer(hidden, batch, caches, rope, gpu_plan)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, D) -> (n, vocab) fp32: lm_head(hidden) / logits_scaling, in the model dtype first."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return (F.linear(hidden, weight) / self.config.logits_scaling).float()

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one KV block across all attention layers (K and V, model dtype)."""
        c = self.config
        per_layer = 2 * block_size * c.num_key_value_heads * c.head_dim * self.dtype.itemsize
        return len(c.attention_layers) * per_layer

    def state_bytes_per_slot(self) -> int:
        """Bytes of one recurrent state slot across all Mamba layers (conv in model dtype, SSM fp32)."""
        c = self.config
        conv = c.mamba_conv_dim * (c.mamba_d_conv - 1) * self.dtype.itemsize
        ssm = c.mamba_n_heads * c.mamba_d_head * c.mamba_d_state * torch.float32.itemsize
        return len(c.mamba_layers) * (conv + ssm)

    def allocate_caches(
        self, num_blocks: int, block_size: int, num_state_slots: int, device=None
    ) -> ModelCaches:
        """Zeroed KV blocks and state slots (layouts in engine/forward_batch.py)."""
        c = self.config
        if device is None:
            device = self.embed_tokens.weight.device
        kv_shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        conv_shape = (num_state_slots, c.mamba_conv_dim, c.mamba_d_conv - 1)
        ssm_shape = (num_state_slots, c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state)
        zeros = lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        return ModelCaches(
            block_size=block_size,
            key_cache={i: zeros(kv_shape, self.dtype) for i in c.attention_layers},
            value_cache={i: zeros(kv_shape, self.dtype) for i in c.attention_layers},
            conv_state={i: zeros(conv_shape, self.dtype) for i in c.mamba_layers},
            ssm_state={i: zeros(ssm_shape, torch.float32) for i in c.mamba_layers},
        )

