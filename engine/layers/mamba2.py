"""The Mamba2 mixer: projections, causal conv and SSD scan with per-request state slots."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.kernels.dispatch import GpuBatchPlan
from engine.kernels.conv_reference import causal_conv1d, causal_conv1d_step
from engine.kernels.ssd_reference import ssd_chunk_scan, ssd_step_batched
from engine.layers.norm import GatedRMSNorm
from engine.model_config import HybridModelConfig


class DepthwiseConv1dWeights(nn.Module):
    """The weights of the depthwise causal conv, in the checkpoint's nn.Conv1d layout."""

    def __init__(self, channels: int, kernel_size: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(channels, dtype=dtype)) if bias else None


class Mamba2Mixer(nn.Module):
    """in_proj -> [z | xBC | dt]; xBC -> causal conv + silu -> [x | B | C]; SSD scan over x with
    dt = clamp(softplus(dt + dt_bias), time_step_limit), A = -exp(A_log) and skip D;
    y -> gated RMSNorm with z -> out_proj.

    Shapes: T tokens, H heads, P head dim, G groups, N state size, I = H * P.
    A_log, D and dt_bias are kept in fp32 whatever the model dtype.
    """

    def __init__(self, config: HybridModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.mamba_n_heads
        self.head_dim = config.mamba_d_head
        self.num_groups = config.mamba_n_groups
        self.state_size = config.mamba_d_state
        self.chunk_size = config.mamba_chunk_size
        self.time_step_limit = config.time_step_limit
        self.intermediate_size = config.mamba_intermediate_size
        self.conv_dim = config.mamba_conv_dim
        hidden, bias = config.hidden_size, config.mamba_proj_bias
        projection_size = self.intermediate_size + self.conv_dim + self.num_heads
        self.in_proj = nn.Linear(hidden, projection_size, bias=bias, dtype=dtype)
        self.conv1d = DepthwiseConv1dWeights(
            self.conv_dim, config.mamba_d_conv, config.mamba_conv_bias, dtype
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.norm = GatedRMSNorm(
            self.intermediate_size,
            group_size=self.intermediate_size // self.num_groups,
            eps=config.rms_norm_eps,
            dtype=dtype,
        )
        self.out_proj = nn.Linear(self.intermediate_size, hidden, bias=bias, dtype=dtype)

    def forward(
        self,
        hidden: torch.Tensor,  # (T, D)
        batch: ForwardBatch,
        conv_state: torch.Tensor,  # (num_slots, conv_dim, K-1), chunk slots updated in place
        ssm_state: torch.Tensor,  # (num_slots, H, P, N) fp32, chunk slots updated in place
        gpu_plan: GpuBatchPlan | None = None,
    ) -> torch.Tensor:
        """Each chunk continues from its state slot (or from zeros if reset_state) and leaves
        the state after its last token in the same slot.

        gpu_plan: given on CUDA; selects the Triton path (mix_batch_gpu) over the per-chunk
        PyTorch path."""
        num_tokens = hidden.shape[0]
        projected = self.in_proj(hidden)
        gate, xBC, dt_raw = projected.split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1
        )
        if gpu_plan is not None:
            y = self.mix_batch_gpu(xBC, dt_raw, conv_state, ssm_state, gpu_plan)
            normed = self.norm(y.view(num_tokens, self.intermediate_size), gate, out_dtype=hidden.dtype)
            return self.out_proj(normed)
        y = hidden.new_empty(num_tokens, self.num_heads, self.head_dim, dtype=torch.float32)
        decode_rows, decode_slots, decode_resets = [], [], []
        for chunk, start, end in zip(batch.chunks, batch.cu_seqlens[:-1], batch.cu_seqlens[1:]):
            if end - start == 1:
                decode_rows.append(start)
                decode_slots.append(chunk.state_slot)
                decode_resets.append(chunk.reset_state)
                continue
            slot = chunk.state_slot
            conv_in = torch.zeros_like(conv_state[slot]) if chunk.reset_state else conv_state[slot]
            ssm_in = torch.zeros_like(ssm_state[slot]) if chunk.reset_state else ssm_state[slot]
            y_chunk, conv_out, ssm_out = self.mix_sequence(
                xBC[start:end], dt_raw[start:end], conv_in, ssm_in
            )
            y[start:end] = y_chunk
            conv_state[slot].copy_(conv_out)
            ssm_state[slot].copy_(ssm_out)
        if decode_rows:
            rows = torch.tensor(decode_rows, device=hidden.device)
            slots = torch.tensor(decode_slots, device=hidden.device)
            keep = ~torch.tensor(decode_resets, device=hidden.device)
            conv_in = conv_state.index_select(0, slots) * keep[:, None, None]
            ssm_in = ssm_state.index_select(0, slots) * keep[:, None, None, None]
            y_rows, conv_out, ssm_out = self.mix_decode(xBC[rows], dt_raw[rows], conv_in, ssm_in)
            y[rows] = y_rows
            conv_state.index_copy_(0, slots, conv_out)
            ssm_state.index_copy_(0, slots, ssm_out)
        normed = self.norm(y.view(num_tokens, self.intermediate_size), gate, out_dtype=hidden.dtype)
        return self.out_proj(normed)

    def mix_sequence(
        self,
        xBC: torch.Tensor,  # (n, conv_dim), pre-conv
        dt_raw: torch.Tensor,  # (n, H)
        conv_state: torch.Tensor,  # (conv_dim, K-1), not modified
        ssm_state: torch.Tensor,  # (H, P, N) fp32, not modified
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One request's tokens: returns (y (n, H, P) fp32, new conv_state, new ssm_state)."""
        n = xBC.shape[0]
        weight = self.conv1d.weight[:, 0, :]  # (conv_dim, K)
        xBC, new_conv_state = causal_conv1d(xBC, conv_state, weight, self.conv1d.bias, apply_silu=True)
        x, B, C, dt, A = self._scan_inputs(xBC, dt_raw)
        y, new_ssm_state = ssd_chunk_scan(x, dt, A, B, C, self.D, ssm_state, self.chunk_size)
        return y, new_conv_state, new_ssm_state

    def mix_decode(
        self,
        xBC: torch.Tensor,  # (S, conv_dim), one pre-conv token per sequence
        dt_raw: torch.Tensor,  # (S, H)
        conv_state: torch.Tensor,  # (S, conv_dim, K-1), not modified
        ssm_state: torch.Tensor,  # (S, H, P, N) fp32, not modified
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token of each of S requests at once: returns (y (S, H, P) fp32, new conv
        states (S, conv_dim, K-1), new SSM states (S, H, P, N))."""
        weight = self.conv1d.weight[:, 0, :]  # (conv_dim, K)
        xBC, new_conv_state = causal_conv1d_step(xBC, conv_state, weight, self.conv1d.bias, apply_silu=True)
        x, B, C, dt, A = self._scan_inputs(xBC, dt_raw)
        y, new_ssm_state = ssd_step_batched(x, dt, A, B, C, self.D, ssm_state)
        return y, new_conv_state, new_ssm_state

    def _scan_inputs(
        self, xBC: torch.Tensor, dt_raw: torch.Tensor  # (n, conv_dim) post-conv, (n, H)
    ) -> tuple[torch.Tensor, ...]:
        """Split the conv output and discretise dt: x (n, H, P), B and C (n, G, N),
        dt (n, H) fp32 clamped, A (H,) fp32."""
        n = xBC.shape[0]
        group_width = self.num_groups * self.state_size
        x, B, C = xBC.split([self.intermediate_size, group_width, group_width], dim=-1)
        x = x.reshape(n, self.num_heads, self.head_dim)
        B = B.reshape(n, self.num_groups, self.state_size)
        C = C.reshape(n, self.num_groups, self.state_size)
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())  # (n, H)
        dt = dt.clamp(min=self.time_step_limit[0], max=self.time_step_limit[1])
        A = -torch.exp(self.A_log.float())  # (H,)
        return x, B, C, dt, A

    def mix_batch_gpu(
        self,
        xBC: torch.Tensor,  # (T, conv_dim), pre-conv
        dt_raw: torch.Tensor,  # (T, H)
        conv_state: torch.Tensor,  # (num_slots, conv_dim, K-1), chunk slots updated in place
        ssm_state: torch.Tensor,  # (num_slots, H, P, N) fp32, chunk slots updated in place
        plan: GpuBatchPlan,
    ) -> torch.Tensor:
        """Every chunk at once on CUDA: one conv launch pair for all chunks, one decode launch
        for all 1-token chunks, one varlen chunked scan for the rest. Returns y (T, H, P) fp32."""
        from engine.kernels.gpu.conv import causal_conv1d_varlen
        from engine.kernels.gpu.ssd import ssd_chunk_scan_varlen, ssd_decode_update

        T = xBC.shape[0]
        weight = self.conv1d.weight[:, 0, :]  # (conv_dim, K)
        xBC = causal_conv1d_varlen(
            xBC, conv_state, weight, self.conv1d.bias, plan.cu_seqlens, plan.chunk_slot,
            plan.chunk_reset, plan.token_chunk, apply_silu=True,
        )
        group_width = self.num_groups * self.state_size
        x, B, C = xBC.split([self.intermediate_size, group_width, group_width], dim=-1)
        x = x.view(T, self.num_heads, self.head_dim)
        B = B.view(T, self.num_groups, self.state_size)
        C = C.view(T, self.num_groups, self.state_size)
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())  # (T, H)
        dt = dt.clamp(min=self.time_step_limit[0], max=self.time_step_limit[1])
        A = -torch.exp(self.A_log.float())  # (H,)
        y = xBC.new_empty(T, self.num_heads, self.head_dim, dtype=torch.float32)
        if plan.num_decode:
            ssd_decode_update(
                x, dt, A, B, C, self.D, ssm_state, y,
                plan.decode_rows, plan.decode_slots, plan.decode_reset,
            )
        if plan.num_prefill:
            rows = plan.prefill_rows
            pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
            slots = plan.prefill_slots
            keep = (plan.prefill_reset == 0).view(-1, 1, 1, 1)
            # (Sp, H, P, N); a reset slot may hold anything (NaN too): read as zeros
            initial = torch.where(keep, ssm_state.index_select(0, slots), 0.0)
            y_prefill, final = ssd_chunk_scan_varlen(
                pick(x), pick(dt), A, pick(B), pick(C), self.D, initial,
                plan.prefill_cu_seqlens, plan.prefill_cu_seqlens_host,
            )
            ssm_state.index_copy_(0, slots, final)
            if rows is None:
                y = y_prefill
            else:
                y.index_copy_(0, rows, y_prefill)
        return y
