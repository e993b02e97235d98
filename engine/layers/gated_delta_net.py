"""Qwen3-Next's gated delta-net mixer: projections, causal conv and the gated delta rule with
per-request state slots (the same two slot tensors as a Mamba2 layer's, with its own shapes:
engine/parallel/cache_capacity.py gated_delta_net_state_shape)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.interfaces.forward_batch import ForwardBatch
from engine.kernels.conv_reference import causal_conv1d, causal_conv1d_step_
from engine.kernels.gated_delta_rule_reference import (
    chunk_gated_delta_rule, gated_delta_rule_step_, l2_normalize,
)
from engine.kernels.gpu.batch_plan import GpuBatchPlan
from engine.kernels.norm_reference import rms_norm_then_gate
from engine.layers.mamba2 import DepthwiseConv1dWeights
from engine.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.recurrent_chunks import mix_chunks
from engine.model_config import HybridModelConfig
from engine.parallel.shard_layout import RankShardLayout, width
from engine.parallel.tensor_parallel import ShardedModule, TensorParallel, TensorShard, scaled

# The chunk length of the reference's chunked scan (fla-core's kernels use 64 too).
SCAN_CHUNK = 64


class HeadGatedRMSNorm(nn.Module):
    """weight * norm(y) * silu(gate) over each value head's channels; the weight (d_v,) is
    shared by every head, so every rank holds it whole (norm_reference.rms_norm_then_gate)."""

    def __init__(self, head_dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim, dtype=dtype))
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y, gate (T, H, d_v) -> (T, H * d_v) in out_dtype."""
        return rms_norm_then_gate(y, gate, self.weight, self.eps, out_dtype).flatten(1)

    def forward_gpu(self, y: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """forward on CUDA tensors in one launch (engine/kernels/gpu/fused_norm.py
        rms_norm_then_gate): y (T, H, d_v) in the weight's dtype, gate (T, H, d_v), each with
        a unit channel stride -> (T, H * d_v) in out_dtype."""
        from engine.kernels.gpu.fused_norm import rms_norm_then_gate as rms_norm_then_gate_gpu

        return rms_norm_then_gate_gpu(y, gate, self.weight, self.eps, out_dtype).flatten(1)


class GatedDeltaNet(ShardedModule):
    """in_proj_qkvz -> q, k, v, z; in_proj_ba -> b, a; [q | k | v] -> causal conv + silu;
    q, k L2-normalised and expanded to the value heads; decay g = -exp(A_log) * softplus(a +
    dt_bias), beta = sigmoid(b); the gated delta rule (engine/kernels/gated_delta_rule_reference.py)
    over the per-head d_k x d_v state, scale d_k^-0.5; y -> weight * norm(y) * silu(z) per head
    -> out_proj.

    Checkpoint layout (transformers' Qwen3NextGatedDeltaNet): in_proj_qkvz's rows are grouped
    by key head, each group [q (d_k) | k (d_k) | v (r d_v) | z (r d_v)] with r = value heads per
    key head; in_proj_ba's likewise [b (r) | a (r)]; the conv's channels are [q (all key heads)
    | k | v (all value heads)], without bias.

    Shapes: T tokens, Hk key heads, Hv value heads, dk, dv head dims, C = 2 Hk dk + Hv dv conv
    channels; all of them this rank's. A_log and dt_bias are kept in fp32.

    Tensor parallel: this rank holds key heads layout.linear_key_heads and their value heads
    layout.linear_value_heads: their row groups of the column-parallel projections, their conv
    channels, A_log and dt_bias, and their columns of the row-parallel out_proj; the norm's
    weight whole. Its state slots hold only its heads.
    """

    def __init__(
        self, config: HybridModelConfig, layout: RankShardLayout, tp: TensorParallel,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        key_heads, value_heads = layout.linear_key_heads, layout.linear_value_heads
        self.num_key_heads, self.num_value_heads = width(key_heads), width(value_heads)
        self.key_head_dim = dk = config.linear_key_head_dim
        self.value_head_dim = dv = config.linear_value_head_dim
        self.heads_per_key = r = config.linear_num_value_heads // config.linear_num_key_heads
        self.key_dim = self.num_key_heads * dk
        self.value_dim = self.num_value_heads * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.scale = dk ** -0.5
        full_key_dim, full_value_dim = config.linear_key_dim, config.linear_value_dim
        hidden = config.hidden_size
        group = 2 * dk + 2 * r * dv  # one key head's rows of in_proj_qkvz
        self.in_proj_qkvz = ColumnParallelLinear(
            hidden, config.linear_num_key_heads * group, (scaled(key_heads, group),), False, dtype
        )
        self.in_proj_ba = ColumnParallelLinear(
            hidden, config.linear_num_key_heads * 2 * r, (scaled(key_heads, 2 * r),), False, dtype
        )
        conv_channels = (
            scaled(key_heads, dk), scaled(key_heads, dk, full_key_dim),
            scaled(value_heads, dv, 2 * full_key_dim),
        )
        self.conv1d = DepthwiseConv1dWeights(
            2 * full_key_dim + full_value_dim, conv_channels, config.linear_conv_kernel_dim,
            bias=False, dtype=dtype,
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_value_heads, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_value_heads, dtype=torch.float32))
        for name in ("dt_bias", "A_log"):
            self.checkpoint_shards[name] = TensorShard((config.linear_num_value_heads,), 0, (value_heads,))
        self.norm = HeadGatedRMSNorm(dv, config.rms_norm_eps, dtype)
        self.out_proj = RowParallelLinear(
            full_value_dim, hidden, (scaled(value_heads, dv),), False, dtype, tp
        )

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden (T, D) -> qkv (T, C) pre-conv in the conv's channel order, z (T, Hv, dv),
        b and a (T, Hv)."""
        T, Hk, r = hidden.shape[0], self.num_key_heads, self.heads_per_key
        dk, dv = self.key_head_dim, self.value_head_dim
        qkvz = self.in_proj_qkvz(hidden).view(T, Hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)  # per key head
        ba = self.in_proj_ba(hidden).view(T, Hk, 2 * r)
        b, a = ba.split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return (qkv, z.reshape(T, self.num_value_heads, dv), b.reshape(T, self.num_value_heads),
                a.reshape(T, self.num_value_heads))

    def rule_inputs(
        self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,  # (n, C) post-conv, (n, Hv) x2
    ) -> tuple[torch.Tensor, ...]:
        """The gated delta rule's inputs: q, k (n, Hv, dk) L2-normalised fp32 and expanded to
        the value heads, v (n, Hv, dv), g (n, Hv) fp32 log decay, beta (n, Hv) fp32."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        expand = lambda t: l2_normalize(t.reshape(n, self.num_key_heads, self.key_head_dim)).repeat_interleave(  # noqa: E731
            self.heads_per_key, dim=1)
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        return expand(q), expand(k), v.reshape(n, self.num_value_heads, self.value_head_dim), g, b.float().sigmoid()

    def forward(
        self,
        hidden: torch.Tensor,  # (T, D)
        batch: ForwardBatch,
        conv_state: torch.Tensor,  # (num_slots, C, K-1), chunk slots updated in place
        recurrent_state: torch.Tensor,  # (num_slots, Hv, dk, dv) fp32, chunk slots updated in place
        gpu_plan: GpuBatchPlan | None = None,
        captures: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """(T, D) -> (T, D). Each chunk continues from its state slot (or from zeros if
        reset_state) and leaves the state after its last token in the same slot.

        gpu_plan: given on CUDA; the conv and the rule then run over every chunk at once
        (mix_chunks_gpu), the output norm in one kernel (HeadGatedRMSNorm.forward_gpu);
        None: per chunk in PyTorch, the one-token chunks batched into one step,
        a verification chunk (position_state_slots) one token at a time into its scratch slots
        (engine/speculative/verify.py mix_verification).

        captures: with gpu_plan.in_pass, this layer's (conv (Sc, C, K-1), recurrent (Sc, Hv, dk,
        dv) fp32) buffers of the in-pass captures, written (mix_chunks_gpu)."""
        qkv, z, b, a = self.project(hidden)
        if gpu_plan is not None:
            y = self.mix_chunks_gpu(qkv, b, a, conv_state, recurrent_state, gpu_plan, captures)
            return self.out_proj(self.norm.forward_gpu(y.to(hidden.dtype), z, hidden.dtype))
        y = mix_chunks(self, (qkv, b, a), conv_state, recurrent_state, batch,
                       (self.num_value_heads, self.value_head_dim))
        # the rule's output in the model dtype before the norm, as transformers rounds it
        return self.out_proj(self.norm(y.to(hidden.dtype), z, hidden.dtype))

    def mix_sequence(
        self,
        qkv: torch.Tensor,  # (n, C), pre-conv
        b: torch.Tensor,  # (n, Hv)
        a: torch.Tensor,  # (n, Hv)
        conv_state: torch.Tensor,  # (C, K-1), not modified
        recurrent_state: torch.Tensor,  # (Hv, dk, dv) fp32, not modified
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One request's tokens: (y (n, Hv, dv) fp32, new conv state, new recurrent state)."""
        weight = self.conv1d.weight[:, 0, :]  # (C, K)
        qkv, new_conv_state = causal_conv1d(qkv, conv_state, weight, None, apply_silu=True)
        q, k, v, g, beta = self.rule_inputs(qkv, b, a)
        y, new_state = chunk_gated_delta_rule(q, k, v, g, beta, recurrent_state, self.scale, SCAN_CHUNK)
        return y, new_conv_state, new_state

    def mix_decode(
        self,
        qkv: torch.Tensor,  # (S, C), one pre-conv token per sequence
        b: torch.Tensor,  # (S, Hv)
        a: torch.Tensor,  # (S, Hv)
        conv_state: torch.Tensor,  # (S, C, K-1), not modified
        recurrent_state: torch.Tensor,  # (S, Hv, dk, dv) fp32, not modified
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token of each of S requests: (y (S, Hv, dv) fp32, new conv states (S, C, K-1),
        new recurrent states (S, Hv, dk, dv))."""
        new_conv, new_state = conv_state.to(qkv.dtype, copy=True), recurrent_state.to(torch.float32, copy=True)
        return self.mix_decode_(qkv, b, a, new_conv, new_state), new_conv, new_state

    def mix_decode_(
        self,
        qkv: torch.Tensor,  # (S, C), one pre-conv token per sequence
        b: torch.Tensor,  # (S, Hv)
        a: torch.Tensor,  # (S, Hv)
        conv_state: torch.Tensor,  # (S, C, K-1), advanced in place
        recurrent_state: torch.Tensor,  # (S, Hv, dk, dv) fp32, advanced in place
    ) -> torch.Tensor:
        """mix_decode advancing the states in place (views of the slots or gathered copies):
        returns y (S, Hv, dv) fp32."""
        weight = self.conv1d.weight[:, 0, :]  # (C, K)
        qkv = causal_conv1d_step_(qkv, conv_state, weight, None, apply_silu=True)
        q, k, v, g, beta = self.rule_inputs(qkv, b, a)
        return gated_delta_rule_step_(q, k, v, g, beta, recurrent_state, self.scale)

    def kernel_inputs(
        self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,  # (n, C) post-conv, (n, Hv) x2
    ) -> tuple[torch.Tensor, ...]:
        """The CUDA kernels' inputs (engine/kernels/gpu/gated_delta_rule.py): q, k (n, Hk, dk)
        raw views (the kernels normalise them and expand them to the value heads), v (n, Hv,
        dv), g (n, Hv) fp32 log decay, beta (n, Hv) fp32."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(n, self.num_key_heads, self.key_head_dim)
        k = k.reshape(n, self.num_key_heads, self.key_head_dim)
        v = v.reshape(n, self.num_value_heads, self.value_head_dim)
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())  # (n, Hv)
        return q, k, v, g, b.float().sigmoid()

    def mix_chunks_gpu(
        self,
        qkv: torch.Tensor,  # (T, C), pre-conv
        b: torch.Tensor,  # (T, Hv)
        a: torch.Tensor,  # (T, Hv)
        conv_state: torch.Tensor,  # (num_slots, C, K-1), chunk slots updated in place
        recurrent_state: torch.Tensor,  # (num_slots, Hv, dk, dv) fp32, chunk slots updated in place
        plan: GpuBatchPlan,
        captures: tuple[torch.Tensor, torch.Tensor] | None = None,  # with plan.in_pass: written
    ) -> torch.Tensor:
        """Every chunk at once on CUDA: the engine's varlen causal conv (engine/kernels/gpu/
        conv.py, two launches), then fla-core's recurrent kernel for the one-token chunks and
        its chunked kernel for the rest (engine/kernels/gpu/gated_delta_rule.py), each between
        a gather and a scatter of the chunks' state slots. Returns y (T, Hv, dv) in the model
        dtype.

        With plan.in_pass (never a graph's padded plan), captures = (conv (Sc, C, K-1),
        recurrent (Sc, Hv, dk, dv) fp32) receive the states at the in-pass captures: the conv
        state read before the conv kernel moves the slots on (in_pass_capture.
        capture_conv_states), the recurrent state from the chunked kernel run in two calls
        (engine/kernels/gpu/delta_rule_capture.py).

        With plan.verification (speculative verification chunks; never with plan.in_pass):
        engine/speculative/verify_gpu.py mix_delta_rule_verification_gpu, the other chunks
        through this method over plan.verification.rest, the verification chunks position by
        position with plain decoding's kernels, their own slots only read and the states after
        their positions left in their scratch slots."""
        if plan.verification is not None:
            from engine.layers.verification import mix_delta_rule_verification_gpu

            return mix_delta_rule_verification_gpu(self, qkv, b, a, conv_state, recurrent_state, plan.verification)
        from engine.kernels.gpu.conv import causal_conv1d_varlen
        from engine.kernels.gpu.gated_delta_rule import (
            gated_delta_rule_decode, gated_delta_rule_prefill, gated_delta_rule_prefill_with_captures,
        )
        from engine.kernels.gpu.in_pass_capture import capture_conv_states

        in_pass = plan.in_pass
        if in_pass is not None:  # before the conv kernel overwrites the old conv states
            capture_conv_states(qkv, conv_state, in_pass.splits, captures[0])
        qkv = causal_conv1d_varlen(
            qkv, conv_state, self.conv1d.weight[:, 0, :], None, plan.cu_seqlens, plan.chunk_slot,
            plan.chunk_reset, plan.token_chunk, apply_silu=True,
        )
        q, k, v, g, beta = self.kernel_inputs(qkv, b, a)
        # rows no kernel writes (a graph's padding) must hold finite values: zeros there
        y = torch.zeros_like(v)
        if plan.num_decode:
            rows = plan.decode_rows
            y[rows] = gated_delta_rule_decode(
                q[rows], k[rows], v[rows], g[rows], beta[rows], self.scale, recurrent_state,
                plan.decode_slots, plan.decode_reset,
            )
        if plan.num_prefill and in_pass is not None:
            gated_delta_rule_prefill_with_captures(
                q, k, v, g, beta, self.scale, recurrent_state, plan.prefill_slots, plan.prefill_reset,
                in_pass.split, captures[1], y,
            )
        elif plan.num_prefill:
            rows = plan.prefill_rows  # None: every row is a prefill row, in order
            pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))  # noqa: E731
            chunks = plan.prefill_scan_chunks
            y_prefill = gated_delta_rule_prefill(
                pick(q), pick(k), pick(v), pick(g), pick(beta), self.scale, recurrent_state,
                plan.prefill_slots, plan.prefill_reset, plan.prefill_cu_seqlens, plan.prefill_valid,
                None if chunks is None else chunks.indices,
            )
            if rows is None:
                y = y_prefill
            else:
                y.index_copy_(0, rows, y_prefill)
        return y
