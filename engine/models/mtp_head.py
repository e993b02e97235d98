"""The multi-token-prediction (MTP) head that the MTP drafter runs (engine/speculative/mtp.py):
Qwen3-Next's `mtp.*` weights, or a seeded random head for a model whose checkpoint has none.

One application of the head to the pair (token t_q, the target's hidden row h_{q-1}):

    x  = fc([pre_fc_norm_embedding(embed(t_q)) | pre_fc_norm_hidden(h_{q-1})])   (D,), embedding first
    h' = norm(layer(x))          layer: one full-attention decoder layer of the family
    draft of t_{q+1} = argmax(lm_head(h'))

The embedding and the LM head are the target model's. h_{q-1} is the target's hidden row after
its final norm (what the engine's forward returns); h' is taken after the head's own `norm`,
both for the logits and as the hidden row of the next draft depth (as vLLM's qwen3_next_mtp:
the target model and the MTP model both return normed hidden states, and the MTP logits are
lm_head of the MTP output).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.interfaces.forward_batch import ForwardBatch, ModelCaches
from engine.kernels.gpu.batch_plan import GpuBatchPlan
from engine.layers.norm import RMSNorm
from engine.layers.parallel_linear import linear


class MultiTokenPredictionHead(nn.Module):
    """pre_fc_norm_embedding and pre_fc_norm_hidden (D,), fc (D, 2D) over [normed embedding |
    normed hidden], `layers` (full-attention decoder layers numbered past the model's own, so
    their KV has its own layer index in the model's caches) and the final `norm` (D,).
    Parameter names are Qwen3-Next's checkpoint names under `mtp.`."""

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, zero_centered: bool,
        layers: Sequence[nn.Module],
    ) -> None:
        super().__init__()
        norm = lambda: RMSNorm(hidden_size, eps, dtype, zero_centered=zero_centered)  # noqa: E731
        self.pre_fc_norm_embedding = norm()
        self.pre_fc_norm_hidden = norm()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False, dtype=dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = norm()

    @property
    def layer_index(self) -> int:
        """The caches' layer index of the (first) MTP layer's KV."""
        return self.layers[0].layer_index

    def forward(
        self,
        embedded: torch.Tensor,  # (T, D) embed(t_q)
        previous_hidden: torch.Tensor,  # (T, D) h_{q-1}, the target's final-normed row
        batch: ForwardBatch,  # the rows' positions, KV write slots and chunks (first_key 1)
        caches: ModelCaches,
        rope: tuple[torch.Tensor, torch.Tensor] | None,  # (cos, sin) (T, rotary_dim); None: NoPE
        gpu_plan: GpuBatchPlan | None = None,
    ) -> torch.Tensor:
        """h' (T, D) after the head's norm. Writes layers[0]'s K/V at batch.slot_mapping.
        gpu_plan: the batch's plan on CUDA (its first_key 1), which the layer's attention and
        MLP run their kernels over; None: the PyTorch path. The norms and fc are PyTorch ops
        either way."""
        fused = torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(previous_hidden)], dim=-1)
        hidden = linear(fused, self.fc.weight, None)  # (T, D)
        return self.norm(self.layers[0](hidden, batch, caches, rope, gpu_plan))


def run_head(
    model, head: MultiTokenPredictionHead, caches: ModelCaches, batch: ForwardBatch,
    previous_hidden: torch.Tensor, gpu_plan: GpuBatchPlan | None,
) -> torch.Tensor:
    """`head` over batch's rows with the hidden rows before them (T, D): each row's token
    embedded with the model's embedding, RoPE at each row's position - 1 (the position of its
    hidden row; engine/speculative/mtp.py). Returns h' (T, D); writes the head layer's K/V at
    batch.slot_mapping. gpu_plan: the batch's plan with first_key 1 on CUDA, None: the PyTorch
    path (batch.chunks with first_key 1)."""
    rope = model.rotary(batch.positions - 1) if model.rotary is not None else None
    return head(model.embed_tokens(batch.input_ids), previous_hidden, batch, caches, rope, gpu_plan)


def randomize(head: MultiTokenPredictionHead, seed: int) -> None:
    """Fill `head` from torch.Generator(seed), on CPU then copied to each parameter's device:
    every norm weight the identity scale (1, or 0 stored zero-centred), every other vector
    zero (biases), every matrix N(0, 1 / fan_in) with fan_in its last dimension, so each
    projection keeps its input's scale. For benchmarks and tests only: such a head drafts at
    random, and its acceptance rate is that of chance."""
    generator = torch.Generator().manual_seed(seed)
    norms = {id(m.weight): m.zero_centered for m in head.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for _, parameter in sorted(head.named_parameters()):
            if id(parameter) in norms:
                parameter.fill_(0.0 if norms[id(parameter)] else 1.0)
            elif parameter.dim() < 2:
                parameter.zero_()
            else:
                values = torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5
                parameter.copy_(values)
