"""Self-attention over paged KV blocks, for a flat batch of chunks from different requests."""

from __future__ import annotations

import torch
from torch import nn

from engine.interfaces.forward_batch import ForwardBatch
from engine.interfaces.decode_rows import DecodeRows
from engine.kernels.attention_reference import (
    dequantize_kv, select_rows, paged_attention, paged_decode_attention, write_kv,
)
from engine.kernels.cpu_attention import paged_attention_sdpa
from engine.kernels.gpu.batch_plan import GpuBatchPlan
from engine.layers.norm import RMSNorm
from engine.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, linear, routes_to_skinny
from engine.layers.rotary import apply_rotary
from engine.model_config import HybridModelConfig
from engine.parallel.shard_layout import RankShardLayout, width
from engine.parallel.tensor_parallel import TensorParallel, scaled


class PagedAttention(nn.Module):
    """q/k/v projections, optional RoPE, causal GQA attention over the KV cache, o projection.

    The softmax scale is config.attention_multiplier (GraniteMoeHybrid's replacement for
    1/sqrt(head_dim)).

    Tensor parallel: this rank holds query heads layout.attention_heads and KV heads
    layout.kv_heads (a split of the KV heads, or the one KV head its query heads read when
    there are fewer KV heads than ranks); q/k/v are column-parallel, o_proj row-parallel.
    num_heads and num_kv_heads are this rank's counts; its KV cache holds only its KV heads.

    Options from the config (Qwen3-Next; off for GraniteMoeHybrid): attention_output_gate,
    q_proj's rows per head are [query (Dh) | gate (Dh)] and the output is multiplied by
    sigmoid(gate) before o_proj; qk_norm, q and k are RMS-normed over each head (q_norm,
    k_norm, zero-centred with zero_centered_norm) before RoPE; with rope tables narrower than
    head_dim (partial_rotary_factor), RoPE turns only the first channels of each head
    (engine/layers/rotary.py apply_rotary).

    Where the single-row GEMM kernel runs (batch-1 decode on CUDA) the q, k and v projections
    are one GEMM over a stacked weight, which stack_projections() builds once the weights are
    loaded; forward refuses to run before it.
    """

    def __init__(
        self, config: HybridModelConfig, layout: RankShardLayout, tp: TensorParallel,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.num_heads = width(layout.attention_heads)
        self.num_kv_heads = width(layout.kv_heads)
        self.head_dim = config.head_dim
        self.scale = config.attention_multiplier
        hidden, bias, head_dim = config.hidden_size, config.attention_bias, config.head_dim
        self.output_gate = config.attention_output_gate
        q_per_head = 2 * head_dim if self.output_gate else head_dim  # [query | gate] per head
        q_rows = (scaled(layout.attention_heads, head_dim),)
        kv_rows = (scaled(layout.kv_heads, head_dim),)
        full_q = config.num_attention_heads * head_dim
        full_kv = config.num_key_value_heads * head_dim
        self.q_proj = ColumnParallelLinear(
            hidden, config.num_attention_heads * q_per_head,
            (scaled(layout.attention_heads, q_per_head),), bias, dtype,
        )
        self.k_proj = ColumnParallelLinear(hidden, full_kv, kv_rows, bias, dtype)
        self.v_proj = ColumnParallelLinear(hidden, full_kv, kv_rows, bias, dtype)
        self.o_proj = RowParallelLinear(full_q, hidden, q_rows, bias, dtype, tp)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            norm = lambda: RMSNorm(head_dim, config.rms_norm_eps, dtype, config.zero_centered_norm)  # noqa: E731
            self.q_norm, self.k_norm = norm(), norm()
        # (Q + 2 KV, D) weight and (Q + 2 KV,) bias or None, q/k/v's rows in that order
        self._stacked_qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def stack_projections(self) -> None:
        """Move the q, k and v weights (and biases) into one (Q + 2 KV, D) tensor, which
        project_qkv multiplies in one GEMM where the single-row GEMM kernel runs (one launch a
        layer instead of three); q_proj, k_proj and v_proj keep views of their rows, so
        parameter names, shapes and counts stay the checkpoint's and writing a parameter
        writes the stacked weight.
        engine/execution/loader.py calls this once the weights are on their device. A module conversion
        afterwards (.to(), .half()) stacks again (_apply); a parameter replaced by assignment
        is not seen until project_qkv, which then raises RuntimeError."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight.detach() for p in projections])
        with_bias = self.q_proj.bias is not None
        bias = torch.cat([p.bias.detach() for p in projections]) if with_bias else None
        start = 0
        for projection in projections:
            end = start + projection.weight.shape[0]
            projection.weight = nn.Parameter(weight[start:end], requires_grad=False)
            if with_bias:
                projection.bias = nn.Parameter(bias[start:end], requires_grad=False)
            start = end
        self._stacked_qkv = (weight, bias)

    def _apply(self, fn, recurse=True):
        """nn.Module's conversions (.to(), .half(), ...) make new parameters, no longer views
        of the stacked weight: stack them again."""
        module = super()._apply(fn, recurse)
        if self._stacked_qkv is not None:
            self.stack_projections()
        return module

    def _check_stacked(self, weight: torch.Tensor) -> None:
        """RuntimeError unless q_proj, k_proj and v_proj's weights are still the stacked
        weight's rows (a parameter replaced by assignment after stacking is not)."""
        offset = 0
        for projection in (self.q_proj, self.k_proj, self.v_proj):
            if projection.weight.data_ptr() != weight.data_ptr() + offset:
                raise RuntimeError("a q/k/v parameter was replaced after stack_projections(); call it again")
            offset += projection.weight.numel() * weight.element_size()

    def project_qkv(
        self, hidden: torch.Tensor, stacked: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query (T, H, Dh) (T, H, 2 Dh) = [query | gate] with the output gate), key and value
        (T, Hkv, Dh) of hidden (T, D).

        stacked (the step's plan chose it: GpuBatchPlan.stacked_qkv, one row on CUDA) and a
        row the single-row GEMM kernel takes with the stacked weight (routes_to_skinny checks
        the operands, which depend on the weight's dtype and layout): one GEMM over the
        stacked weight, and the three column views of its (1, Q + 2 KV) output. On the H200
        the batch-1 decode graph took 1.118-1.121 ms against 1.125-1.136 ms with three
        single-row GEMMs (benchmarks/gpu_roofline.py). Everything else: three GEMMs,
        contiguous outputs. Stacked, cuBLAS's fp32 results for a 64-row prefill differed
        between a CUDA graph and the eager pass enough to move a Mamba state 170x further
        apart than with three GEMMs (3.9e-4 against 2.3e-6 relative;
        tests/gpu/test_prefill_graphs.py), and on the CPU a launch saves nothing while a BLAS
        kernel chosen for another shape moves the rounding."""
        if self._stacked_qkv is None:
            raise RuntimeError("PagedAttention used before stack_projections()")
        num_tokens = hidden.shape[0]
        if stacked and routes_to_skinny(hidden, *self._stacked_qkv):
            self._check_stacked(self._stacked_qkv[0])
            q_width, kv_width = self.q_proj.weight.shape[0], self.num_kv_heads * self.head_dim
            query, key, value = linear(hidden, *self._stacked_qkv).split((q_width, kv_width, kv_width), dim=1)
        else:
            query, key, value = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        return (query.view(num_tokens, self.num_heads, -1),
                key.view(num_tokens, self.num_kv_heads, self.head_dim),
                value.view(num_tokens, self.num_kv_heads, self.head_dim))

    def forward(
        self,
        hidden: torch.Tensor,  # (T, D)
        batch: ForwardBatch,
        key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, Dh), written at batch.slot_mapping
        value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, Dh), written at batch.slot_mapping
        rope: tuple[torch.Tensor, torch.Tensor] | None,  # (cos, sin), each (T, rotary_dim <= Dh); None = NoPE
        gpu_plan: GpuBatchPlan | None = None,
        kv_scale: torch.Tensor | None = None,  # (2, Hkv) fp32 for FP8 caches (ModelCaches.kv_scale)
    ) -> torch.Tensor:
        """Writes every token's K/V to its slot, then attends each chunk over its own sequence
        (with deferred writes, batch.decode.deferred, records the K/V instead and attends to
        them in place of the cache's).

        gpu_plan: given on CUDA; q, k and v are then projected as it chose (stacked_qkv), all
        decode chunks go through one Triton launch, the prefill chunks with cached keys through
        another, and each prefill chunk that starts its sequence through SDPA (attend_gpu).

        kv_scale: the caches hold FP8 (engine/kernels/attention_reference.py): K/V are
        quantized when written and every read dequantizes what the cache holds, the SDPA of a
        chunk that starts its sequence included, so a token's attention reads the same values
        whichever way its keys were computed or restored. Without a plan each chunk then goes
        through the reference paged_attention (the batched decode pass and deferred writes are
        for unquantized caches; the engine runs FP8 on CUDA only)."""
        num_tokens = hidden.shape[0]
        query, key, value = self.project_qkv(hidden, stacked=gpu_plan is not None and gpu_plan.stacked_qkv)
        gate = None
        if self.output_gate:
            query, gate = query.chunk(2, dim=-1)  # (T, H, Dh) each
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        if rope is not None:
            query, key = apply_rotary(query, *rope), apply_rotary(key, *rope)
        if gpu_plan is not None:
            from engine.kernels.gpu.kv_write import write_kv as write_kv_gpu

            write_kv_gpu(key_cache, value_cache, batch.slot_mapping, key, value, kv_scale)
            if kv_scale is not None and gpu_plan.fresh_chunks:  # what the cache holds, for their SDPA
                key, value = cached_kv(key_cache, value_cache, batch.slot_mapping, kv_scale, query.dtype)
            output = self.attend_gpu(query, key, value, key_cache, value_cache, gpu_plan, kv_scale)
            return self.o_proj(self.gated(output, gate).view(num_tokens, self.num_heads * self.head_dim))
        decode = None
        if kv_scale is None and batch.decode is not None and batch.decode.first_key_zero:
            decode = batch.decode
        if decode is not None and decode.deferred is not None:  # written after the pass
            decode.deferred.kv.append((key_cache, value_cache, key, value))
            output = self.attend_decode(query, key_cache, value_cache, decode, current=(key, value))
            return self.o_proj(self.gated(output, gate).reshape(num_tokens, self.num_heads * self.head_dim))
        write_kv(key_cache, value_cache, batch.slot_mapping, key, value, kv_scale)
        if decode is not None and decode.identity:  # every chunk one token: one batched pass
            output = self.attend_decode(query, key_cache, value_cache, decode)
        else:
            output = torch.empty_like(query)  # (T, H, Dh)
            if decode is not None:  # the one-token chunks in one batched pass, the others one by one
                decode.put(output, self.attend_decode(decode.take(query), key_cache, value_cache, decode))
            batched = set(decode.chunk_indices) if decode is not None else set()
            for index, (chunk, start, end) in enumerate(zip(batch.chunks, batch.cu_seqlens[:-1], batch.cu_seqlens[1:])):
                if index in batched:
                    continue
                block_table = torch.tensor(chunk.block_table, dtype=torch.int64, device=hidden.device)
                if kv_scale is None:  # torch's fused attention, the reference's contract
                    output[start:end] = paged_attention_sdpa(
                        query[start:end], key_cache, value_cache, block_table, chunk.start_position,
                        self.scale, first_key=chunk.first_key,
                    )
                else:
                    output[start:end] = paged_attention(
                        query[start:end], key_cache, value_cache, block_table, chunk.start_position,
                        self.scale, first_key=chunk.first_key, kv_scale=kv_scale,
                    )
        return self.o_proj(self.gated(output, gate).reshape(num_tokens, self.num_heads * self.head_dim))

    def attend_decode(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, decode: DecodeRows,
        current: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The decode rows' attention output (n, H, Dh) from their queries (n, H, Dh), in one
        batched pass over their keys (DecodeRows.keys, laid out once per batch for every
        attention layer). current: the rows' own (key, value) (n, Hkv, Dh) when the caches do
        not hold them yet (deferred writes)."""
        keys = decode.keys(key_cache.shape[1], self.num_kv_heads)
        new = None if current is None else (*current, keys.last)
        return paged_decode_attention(query, key_cache, value_cache, keys.rows, keys.padding, self.scale, new)

    @staticmethod
    def gated(output: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """output * sigmoid(gate) (each (T, H, Dh)) with the output gate; output without."""
        return output if gate is None else output * torch.sigmoid(gate)

    def attend_gpu(
        self,
        query: torch.Tensor,  # (T, H, Dh)
        key: torch.Tensor,  # (T, Hkv, Dh), this step's keys (as FP8 caches hold them, dequantized)
        value: torch.Tensor,  # (T, Hkv, Dh)
        key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, Dh), this step's K/V written
        value_cache: torch.Tensor,
        plan: GpuBatchPlan,
        kv_scale: torch.Tensor | None = None,  # (2, Hkv) fp32 for FP8 caches
    ) -> torch.Tensor:
        """Attention output (T, H, Dh) for every chunk of the batch, on CUDA: keys from
        plan.first_key on. ValueError when the plan has a chunk that starts its sequence and a
        first_key above 0: SDPA over the chunk's own K/V would read keys before it."""
        if plan.first_key > 0 and plan.fresh_chunks:
            raise ValueError(f"a chunk starting its sequence cannot be served with first_key {plan.first_key}")
        from engine.kernels.gpu.paged_attention import (
            causal_attention_from_start, paged_attention_decode, paged_attention_prefill,
        )

        # Rows no kernel writes (a graph's padding) must hold finite values: zeros there.
        output = torch.empty_like(query) if plan.prefill_valid is None else torch.zeros_like(query)
        paged_attention_decode(
            query, key_cache, value_cache, output, plan.decode_rows, plan.decode_seq_lens,
            plan.decode_block_table, self.scale, first_key=plan.first_key, kv_scale=kv_scale,
        )
        paged_attention_prefill(
            query, key_cache, value_cache, output, plan.paged_first_rows, plan.paged_lengths,
            plan.paged_positions, plan.paged_tables, plan.paged_max_length, self.scale,
            first_key=plan.first_key, kv_scale=kv_scale,
        )
        for chunk in plan.fresh_chunks:
            output[chunk.start : chunk.end] = causal_attention_from_start(
                query[chunk.start : chunk.end], key[chunk.start : chunk.end],
                value[chunk.start : chunk.end], self.scale,
            )
        return output


def cached_kv(
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, Dh) FP8
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) the slots this step wrote
    kv_scale: torch.Tensor,  # (2, Hkv) fp32
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V (T, Hkv, Dh) of this step's tokens as FP8 caches hold them, dequantized to
    `dtype`: what the paged kernels read for these tokens later. Reads only."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat = (num_blocks * block_size, num_kv_heads, head_dim)
    key = dequantize_kv(select_rows(key_cache.view(flat), slot_mapping), kv_scale[0], dtype)
    value = dequantize_kv(select_rows(value_cache.view(flat), slot_mapping), kv_scale[1], dtype)
    return key, value
