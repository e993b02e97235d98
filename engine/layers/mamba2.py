"""The Mamba2 mixer: projections, causal conv and SSD scan with per-request state slots."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.interfaces.forward_batch import ForwardBatch
from engine.kernels.conv_reference import causal_conv1d, causal_conv1d_step_
from engine.kernels.gpu.batch_plan import GpuBatchPlan
from engine.kernels.ssd_reference import ssd_chunk_scan, ssd_step_

# The chunk of mix_sequence's scan (the CPU path). The chunking changes nothing but rounding
# (the scan is exact per chunk and recurrent across them); its intra-chunk terms cost T * L,
# so 64 ran a 2,000-token scan 3.3x faster on the CPU than the models' 256 (within 6e-7 of it).
SEQUENCE_SCAN_CHUNK = 64
from engine.layers.norm import GroupParallelGatedRMSNorm, with_head_skip
from engine.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.recurrent_chunks import mix_chunks
from engine.model_config import (
    MAMBA_GATE_ONLY,
    MAMBA_NORM_FIRST,
    MAMBA_NORM_GATE_FIRST,
    HybridModelConfig,
)
from engine.parallel.shard_layout import RankShardLayout, width
from engine.parallel.tensor_parallel import IndexRange, ShardedModule, TensorParallel, TensorShard, scaled


class DepthwiseConv1dWeights(ShardedModule):
    """The weights of the depthwise causal conv, in the checkpoint's nn.Conv1d layout.

    Tensor parallel: this rank holds conv channels `channel_ranges` of the full_channels."""

    def __init__(
        self, full_channels: int, channel_ranges: tuple[IndexRange, ...], kernel_size: int,
        bias: bool, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        channels = sum(end - start for start, end in channel_ranges)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(channels, dtype=dtype)) if bias else None
        self.checkpoint_shards["weight"] = TensorShard(
            (full_channels, 1, kernel_size), 0, channel_ranges
        )
        if bias:
            self.checkpoint_shards["bias"] = TensorShard((full_channels,), 0, channel_ranges)


class Mamba2Mixer(ShardedModule):
    """in_proj -> [z | xBC | dt]; xBC -> causal conv + silu -> [x | B | C]; SSD scan over x with
    dt = clamp(softplus(dt + dt_bias), time_step_limit), A = -exp(A_log) and skip D;
    y -> gated RMSNorm with z -> out_proj. On CUDA the D skip (y + D * x per head) is added by
    the gated norm (inside its kernel; in PyTorch when a norm group is split across ranks), not
    by the scan. A one-row decode step folds the gated norm into the decode kernel and
    out_proj's GEMM instead (mix_row_folded_gpu).

    Options from the config (Falcon-H1; defaults give Mamba2's mixer): in_proj's output scaled
    per section [z | x | B | C | dt] (mamba_projection_multipliers: five scalars, so each rank
    scales its own rows of each section, sharded with them); the norm's form
    (mamba_gated_norm: gate first, norm first, or the gate alone without a norm module; the
    last two run their elementwise part in PyTorch on CUDA too and never fold); out_proj's
    bias apart from in_proj's (mamba_out_proj_bias).

    Shapes: T tokens, H heads, P head dim, G groups, N state size, I = H * P; all of them
    this rank's (see below), so its state slots hold only its heads and channels.
    A_log, D and dt_bias are kept in fp32 whatever the model dtype.

    Tensor parallel: this rank holds heads layout.mamba_heads (their z, x and dt rows of the
    column-parallel in_proj, their x conv channels, A_log, D, dt_bias and norm channels, and
    their columns of the row-parallel out_proj) and B/C groups layout.mamba_groups (split, or
    the one group its heads read).
    """

    def __init__(
        self, config: HybridModelConfig, layout: RankShardLayout, tp: TensorParallel,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        P, N = config.mamba_d_head, config.mamba_d_state
        full_I, full_G = config.mamba_intermediate_size, config.mamba_n_groups
        heads, groups = layout.mamba_heads, layout.mamba_groups
        self.num_heads = width(heads)
        self.head_dim = P
        self.num_groups = width(groups)
        self.state_size = N
        self.chunk_size = config.mamba_chunk_size
        self.time_step_limit = config.time_step_limit
        self.intermediate_size = self.num_heads * P
        self.conv_dim = self.intermediate_size + 2 * self.num_groups * N
        hidden, bias = config.hidden_size, config.mamba_proj_bias
        full_GN = full_G * N
        # full in_proj rows: [z (I) | x (I) | B (G N) | C (G N) | dt (H)]
        in_rows = (
            scaled(heads, P),
            scaled(heads, P, full_I),
            scaled(groups, N, 2 * full_I),
            scaled(groups, N, 2 * full_I + full_GN),
            scaled(heads, 1, 2 * full_I + 2 * full_GN),
        )
        full_projection = 2 * full_I + 2 * full_GN + config.mamba_n_heads
        self.in_proj = ColumnParallelLinear(hidden, full_projection, in_rows, bias, dtype)
        # full conv channels: [x (I) | B (G N) | C (G N)]
        conv_channels = (
            scaled(heads, P), scaled(groups, N, full_I), scaled(groups, N, full_I + full_GN)
        )
        self.conv1d = DepthwiseConv1dWeights(
            config.mamba_conv_dim, conv_channels, config.mamba_d_conv, config.mamba_conv_bias, dtype
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        for name in ("dt_bias", "A_log", "D"):
            self.checkpoint_shards[name] = TensorShard((config.mamba_n_heads,), 0, (heads,))
        if config.mamba_gated_norm not in (MAMBA_NORM_GATE_FIRST, MAMBA_NORM_FIRST, MAMBA_GATE_ONLY):
            raise ValueError(f"mamba_gated_norm {config.mamba_gated_norm!r} is not a known form")
        self.norm: GroupParallelGatedRMSNorm | None = None
        if config.mamba_gated_norm != MAMBA_GATE_ONLY:
            self.norm = GroupParallelGatedRMSNorm(
                full_I,
                group_size=full_I // full_G,
                channels=scaled(heads, P),
                eps=config.rms_norm_eps,
                tp=tp,
                dtype=dtype,
                norm_first=config.mamba_gated_norm == MAMBA_NORM_FIRST,
            )
        # [z | x | B | C | dt] widths of this rank's in_proj output, and their multipliers
        self.projection_sections = (
            self.intermediate_size, self.intermediate_size, self.num_groups * N,
            self.num_groups * N, self.num_heads,
        )
        self.projection_multipliers = tuple(float(m) for m in config.mamba_projection_multipliers)
        out_bias = bias if config.mamba_out_proj_bias is None else config.mamba_out_proj_bias
        self.out_proj = RowParallelLinear(full_I, hidden, (scaled(heads, P),), out_bias, dtype, tp)

    def scale_projection(self, projected: torch.Tensor) -> torch.Tensor:
        """in_proj's output (T, 2I + 2GN + H) with each section scaled by its multiplier, in
        place (no-op when all are 1): scalars only, so CUDA graphs capture it."""
        start = 0
        for width_, multiplier in zip(self.projection_sections, self.projection_multipliers):
            if multiplier != 1.0:
                projected[:, start : start + width_].mul_(multiplier)
            start += width_
        return projected

    def gate_and_norm(self, y: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The configured norm of y (T, I) (the D skip included) with the gate z (T, I), in
        PyTorch: the gated norm's forward, or y * silu(z) in fp32 without a norm. (T, I) out_dtype."""
        if self.norm is not None:
            return self.norm(y, gate, out_dtype=out_dtype)
        return (y.float() * F.silu(gate.float())).to(out_dtype)

    def forward(
        self,
        hidden: torch.Tensor,  # (T, D)
        batch: ForwardBatch,
        conv_state: torch.Tensor,  # (num_slots, conv_dim, K-1), chunk slots updated in place
        ssm_state: torch.Tensor,  # (num_slots, H, P, N) fp32, chunk slots updated in place
        gpu_plan: GpuBatchPlan | None = None,
        captures: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Each chunk continues from its state slot (or from zeros if reset_state) and leaves
        the state after its last token in the same slot.

        gpu_plan: given on CUDA; selects the Triton path over the per-chunk PyTorch path, and
        there the gated norm folded into its neighbours (gpu_plan.folded_gated_norm:
        mix_row_folded_gpu) or not (mix_batch_gpu). captures: with gpu_plan.in_pass, this
        layer's (conv (Sc, C, K-1), ssm (Sc, H, P, N)) outputs for the states at the in-pass
        capture positions."""
        num_tokens = hidden.shape[0]
        projected = self.scale_projection(self.in_proj(hidden))
        gate, xBC, dt_raw = projected.split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1
        )
        if gpu_plan is not None:
            if gpu_plan.folded_gated_norm:
                return self.mix_row_folded_gpu(gate, xBC, dt_raw, conv_state, ssm_state, gpu_plan)
            y, x = self.mix_batch_gpu(xBC, dt_raw, conv_state, ssm_state, gpu_plan, captures)
            y = y.view(num_tokens, self.intermediate_size)
            if self.norm is None or self.norm.norm_first:
                normed = self.gate_and_norm(with_head_skip(y, x, self.D), gate, hidden.dtype)
            else:
                normed = self.norm.forward_gpu(y, gate, hidden.dtype, skip=(x, self.D))
            return self.out_proj(normed)
        y = mix_chunks(self, (xBC, dt_raw), conv_state, ssm_state, batch, (self.num_heads, self.head_dim))
        normed = self.gate_and_norm(y.view(num_tokens, self.intermediate_size), gate, hidden.dtype)
        return self.out_proj(normed)

    def mix_sequence(
        self,
        xBC: torch.Tensor,  # (n, conv_dim), pre-conv
        dt_raw: torch.Tensor,  # (n, H)
        conv_state: torch.Tensor,  # (conv_dim, K-1), not modified
        ssm_state: torch.Tensor,  # (H, P, N) fp32, not modified
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One request's tokens: returns (y (n, H, P) fp32, new conv_state, new ssm_state)."""
        weight = self.conv1d.weight[:, 0, :]  # (conv_dim, K)
        xBC, new_conv_state = causal_conv1d(xBC, conv_state, weight, self.conv1d.bias, apply_silu=True)
        x, B, C, dt, A = self._scan_inputs(xBC, dt_raw)
        y, new_ssm_state = ssd_chunk_scan(x, dt, A, B, C, self.D, ssm_state,
                                          min(self.chunk_size, SEQUENCE_SCAN_CHUNK))
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
        new_conv, new_ssm = conv_state.to(xBC.dtype, copy=True), ssm_state.to(torch.float32, copy=True)
        return self.mix_decode_(xBC, dt_raw, new_conv, new_ssm), new_conv, new_ssm

    def mix_decode_(
        self,
        xBC: torch.Tensor,  # (S, conv_dim), one pre-conv token per sequence
        dt_raw: torch.Tensor,  # (S, H)
        conv_state: torch.Tensor,  # (S, conv_dim, K-1), advanced in place
        ssm_state: torch.Tensor,  # (S, H, P, N) fp32 contiguous, advanced in place
    ) -> torch.Tensor:
        """mix_decode advancing the states in place (views of the slots or gathered copies):
        returns y (S, H, P) fp32."""
        weight = self.conv1d.weight[:, 0, :]  # (conv_dim, K)
        xBC = causal_conv1d_step_(xBC, conv_state, weight, self.conv1d.bias, apply_silu=True)
        x, B, C, dt, A = self._scan_inputs(xBC, dt_raw)
        return ssd_step_(x, dt, A, B, C, self.D, ssm_state)

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
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())  # (n, H), >= 0
        low, high = self.time_step_limit
        if low > 0 or high != math.inf:  # (0, inf) leaves softplus's output as it is
            dt = dt.clamp(min=low, max=high)
        A = -torch.exp(self.A_log.float())  # (H,)
        return x, B, C, dt, A

    def mix_batch_gpu(
        self, xBC: torch.Tensor, dt_raw: torch.Tensor, conv_state: torch.Tensor,
        ssm_state: torch.Tensor, plan: GpuBatchPlan,
        captures: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every chunk at once on CUDA (arguments as mix_chunks_gpu's): a step whose plan chose
        the fused decode kernel (plan.fused_mamba_decode: a small decode-only step, what the
        decode CUDA graphs run) takes mix_decode_only_gpu, two launches; any other step
        mix_chunks_gpu. Both mutate the chunks' state slots in place. Returns (y (T, H, P) fp32 without the D skip, x
        (T, I) the scan's input: the conv output's x columns), so the caller adds D * x (the
        gated norm does, as it reads y). A plan with speculative verification chunks
        (plan.verification) takes mix_verification_gpu (engine/layers/verification.py): the
        other chunks as here, the verification chunks' own slots only read, the states after
        their positions left in scratch slots."""
        if plan.verification is not None:
            from engine.layers.verification import mix_verification_gpu

            return mix_verification_gpu(self, xBC, dt_raw, conv_state, ssm_state, plan.verification)
        if plan.fused_mamba_decode:
            return self.mix_decode_only_gpu(xBC, dt_raw, conv_state, ssm_state, plan)
        return self.mix_chunks_gpu(xBC, dt_raw, conv_state, ssm_state, plan, captures)

    def mix_decode_only_gpu(
        self, xBC: torch.Tensor, dt_raw: torch.Tensor, conv_state: torch.Tensor,
        ssm_state: torch.Tensor,  # as mix_chunks_gpu's
        plan: GpuBatchPlan,  # every chunk one token (plan.num_prefill == 0), row i = chunk i
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """mix_chunks_gpu for a plan of 1-token chunks only, in two launches instead of three:
        the fused conv + SSD step (engine/kernels/gpu/mamba_decode.py), then the conv window
        shift (advance_conv_states, over the plan's 1-token chunks). Same returns, x (T, I)
        contiguous; equal to mix_chunks_gpu up to fused-multiply-add rounding."""
        T = xBC.shape[0]
        x = xBC.new_empty(T, self.num_heads, self.head_dim)
        y = xBC.new_empty(T, self.num_heads, self.head_dim, dtype=torch.float32)
        self._decode_step_gpu(xBC, dt_raw, conv_state, ssm_state, plan, x, y)
        return y, x.view(T, self.intermediate_size)

    def _decode_step_gpu(
        self, xBC: torch.Tensor, dt_raw: torch.Tensor, conv_state: torch.Tensor,
        ssm_state: torch.Tensor, plan: GpuBatchPlan,  # as mix_decode_only_gpu's
        x: torch.Tensor | None,  # (T, H, P) written, or None with gated_norm
        y: torch.Tensor | None,  # (T, H, P) fp32 written, or None with gated_norm
        gated_norm=None,  # mamba_decode.GatedNormOutputs, written instead of x and y
    ) -> None:
        """The two launches of a decode-only step: the fused conv + SSD kernel
        (engine/kernels/gpu/mamba_decode.py), then the conv window shift."""
        from engine.kernels.gpu.conv import advance_conv_states
        from engine.kernels.gpu.mamba_decode import conv_ssd_decode

        conv_ssd_decode(
            xBC, dt_raw, conv_state, self.conv1d.weight[:, 0, :], self.conv1d.bias, self.dt_bias,
            self.A_log, self.time_step_limit, ssm_state, x, y, plan.decode_rows, plan.decode_slots,
            plan.decode_reset, gated_norm=gated_norm,
        )
        # after the fused kernel, whose programs read the old conv states (see mamba_decode.py)
        advance_conv_states(xBC, conv_state, plan.cu_seqlens, plan.chunk_slot, plan.chunk_reset)

    def folds_gated_norm(self) -> bool:
        """Whether a one-row decode step may fold the gated norm into its neighbours
        (mix_row_folded_gpu): one norm group over this rank's channels, a dtype with fp32's
        range (bf16, fp32: the row is rounded before the norm's scale, which fp16 could
        overflow), and an out_proj whose single-row GEMM takes a (1, I) row and folds the norm
        in (supports_row_rms: world size 1, CUDA, its weight's layout). Fixed once the weights
        are loaded: the forward routes ask once (HybridModel.folds_gated_norm, engine/models/registry.py) and
        the step's plan carries the choice (GpuBatchPlan.folded_gated_norm)."""
        weight = self.out_proj.weight
        if self.norm is None or self.norm.norm_first:
            return False
        if self.norm.group_size != self.intermediate_size or weight.dtype == torch.float16:
            return False
        return self.out_proj.supports_row_rms(weight.new_empty(1, self.intermediate_size))

    def mix_row_folded_gpu(
        self,
        gate: torch.Tensor,  # (1, I)
        xBC: torch.Tensor,  # (1, conv_dim), pre-conv
        dt_raw: torch.Tensor,  # (1, H)
        conv_state: torch.Tensor,  # (num_slots, conv_dim, K-1), the row's slot updated in place
        ssm_state: torch.Tensor,  # (num_slots, H, P, N) fp32, the row's slot updated in place
        plan: GpuBatchPlan,  # one 1-token chunk, plan.folded_gated_norm
    ) -> torch.Tensor:
        """The mixer's output (1, D) of a one-row decode step with the gated norm folded into
        the kernels around it: the fused conv + SSD kernel also computes the norm's
        elementwise part and its sums of squares (mamba_decode.GatedNormOutputs), the conv
        window shift follows, and out_proj's single-row GEMM scales its output by the norm's
        rsqrt (skinny_gemm.RowRms). Three launches instead of four (the norm's own kernel is a
        single program on the step's critical path); the same function as mix_decode_only_gpu
        then the gated norm and out_proj, up to where the rounding to the model dtype falls."""
        from engine.kernels.gpu.mamba_decode import GatedNormOutputs, num_sum_squares
        from engine.kernels.gpu.skinny_gemm import RowRms

        normed = gate.new_empty(1, self.intermediate_size)
        sum_squares = normed.new_empty(1, num_sum_squares(self.num_heads, self.head_dim), dtype=torch.float32)
        gated_norm = GatedNormOutputs(gate, self.D, self.norm.weight, normed, sum_squares)
        self._decode_step_gpu(xBC, dt_raw, conv_state, ssm_state, plan, None, None, gated_norm)
        return self.out_proj.forward_row_rms(normed, RowRms(sum_squares[0], self.norm.eps))

    def mix_chunks_gpu(
        self,
        xBC: torch.Tensor,  # (T, conv_dim), pre-conv
        dt_raw: torch.Tensor,  # (T, H)
        conv_state: torch.Tensor,  # (num_slots, conv_dim, K-1), chunk slots updated in place
        ssm_state: torch.Tensor,  # (num_slots, H, P, N) fp32, chunk slots updated in place
        plan: GpuBatchPlan,
        captures: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Any batch: one conv launch pair for all chunks, one decode launch for all 1-token
        chunks (dt discretised inside it), one chunked scan for the rest (its inputs prepared
        in one launch; fla's fixed-length path for one sequence, varlen for several; the
        in-pass captures read at its chunk edges). Returns as mix_batch_gpu, x a strided view
        of the conv output."""
        from engine.kernels.gpu.conv import causal_conv1d_varlen
        from engine.kernels.gpu.in_pass_capture import capture_conv_states
        from engine.kernels.gpu.ssd import ssd_decode_update, ssd_prefill_scan
        from engine.kernels.gpu.state_slots import gather_states, scatter_states

        T = xBC.shape[0]
        weight = self.conv1d.weight[:, 0, :]  # (conv_dim, K)
        if plan.in_pass is not None:  # before the conv kernel overwrites the old conv states
            capture_conv_states(xBC, conv_state, plan.in_pass.splits, captures[0])
        xBC = causal_conv1d_varlen(
            xBC, conv_state, weight, self.conv1d.bias, plan.cu_seqlens, plan.chunk_slot,
            plan.chunk_reset, plan.token_chunk, apply_silu=True,
        )
        group_width = self.num_groups * self.state_size
        x, B, C = xBC.split([self.intermediate_size, group_width, group_width], dim=-1)
        B = B.view(T, self.num_groups, self.state_size)
        C = C.view(T, self.num_groups, self.state_size)
        y = xBC.new_empty(T, self.num_heads, self.head_dim, dtype=torch.float32)
        if plan.num_decode:
            ssd_decode_update(
                x.view(T, self.num_heads, self.head_dim), dt_raw, self.dt_bias, self.A_log,
                self.time_step_limit, B, C, ssm_state, y, plan.decode_rows, plan.decode_slots,
                plan.decode_reset,
            )
        if plan.num_prefill:
            rows = plan.prefill_rows
            slots = plan.prefill_slots
            # (Sp, H, P, N); a reset slot may hold anything (NaN too): read as zeros
            initial = gather_states(ssm_state, slots, plan.prefill_reset)
            # graph padding rows (prefill_valid) leave the state as it is; in-pass captures
            # take the states at their positions in the same one scan
            y_prefill, final = ssd_prefill_scan(
                xBC, dt_raw, self.dt_bias, self.A_log, self.time_step_limit,
                (self.num_heads, self.head_dim, self.num_groups, self.state_size), initial,
                plan.prefill_cu_seqlens, plan.prefill_scan_chunks, rows, plan.prefill_valid,
                plan.in_pass, None if captures is None else captures[1],
            )
            scatter_states(final.contiguous(), ssm_state, slots)
            if rows is None:
                y = y_prefill
            else:
                y.index_copy_(0, rows, y_prefill)
        return y, x
