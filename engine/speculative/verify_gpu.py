"""Verification chunks on CUDA: the verification route of one CUDA device and the recurrent
mixers' part of it, Mamba2's and the gated delta-net's (docs/design.md section 10).

A verification chunk is the request's last token and its k drafts, n = k + 1 tokens. The
scheduler has settled nothing yet, so the chunk must leave the request's own state slot as
it was and put the state after each position i in scratch slot i of the request
(VerificationScratch.slots); the commit of the kept position copies one of them back later
(verify.py). The CPU path (verify.py mix_verification) runs this token by token per chunk;
here every verification chunk of the step runs at once:

- Attention, MLPs, norms: as a short prefill chunk that continues from the cached KV (the
  eager pass's GpuBatchPlan: a verification chunk is a paged-prefill chunk there). The K/V
  of rejected positions lie past the kept tokens and the next chunk overwrites them.
- Mamba2 (mix_verification_gpu): the step's other chunks run the mixer's ordinary GPU path
  over their own plan (VerificationPlan.rest), and the verification chunks run position by
  position: for i = 0..n-1 one launch of the fused one-token decode kernel
  (engine/kernels/gpu/mamba_decode.py conv_ssd_decode, the kernel plain decoding runs at up
  to FUSED_DECODE_MAX_ROWS rows, so the states are plain decoding's) over position i of every
  chunk, in place on scratch slot i, which first receives the state before position i: the
  SSM state copied from the request's slot (i = 0) or from scratch slot i - 1 just before the
  launch, the conv window (the last K-1 pre-conv inputs before position i) for every i before
  the first launch. The conv windows are data movement only: all of them come from one
  concatenation [old window | the chunk's inputs] (position_conv_windows), and after the n
  launches each scratch slot gets its window after position i. The request's slot is only
  read (index_select).
- Gated delta-net (mix_delta_rule_verification_gpu): the same split, and for each position i
  plain decoding's own two kernels over position i of every chunk as one-token chunks on
  scratch slot i: the varlen causal conv (engine/kernels/gpu/conv.py, which also moves the
  slot's window on) and fla-core's one-token recurrent kernel (engine/kernels/gpu/
  gated_delta_rule.py gated_delta_rule_decode). Scratch slot i first receives the conv
  window and the recurrent state before position i, both copied from the request's slot
  (i = 0) or from scratch slot i - 1; the request's slot is only read.

The decode kernel updates the SSM state of the slot it reads, so each position costs one
state copy (index_select + index_copy_, PyTorch) before its launch; a kernel reading one slot
and writing another would save that copy (not done: the kernel is shared with plain
decoding). The PyTorch copies between launches also keep the programmatic-dependent-launch
contract (engine/kernels/gpu/pdl.py): the decode kernel loads its slot's state before its
PDL wait, and a kernel launched without PDL ahead of it has finished before it starts.

Row order: the route puts the step's other chunks first and the verification chunks after
them (verification_order), so the other chunks' rows are [0, num_rest_rows) and their plan is
an ordinary one; RouteOutput.last_rows maps back to the worker's chunk order. Chunks of
different lengths (fewer drafts) are sorted longest first, so the chunks still running at
position i are a prefix (VerificationIndex.active).

Every index is built on the host (verification_index, pure numpy, tested on the CPU) and
copied with the plan; the forward does not wait for the device. A step of verification
chunks only replays a CUDA graph instead (verify_graphs.py, the same mixer path over static
buffers); this route takes the others. In-pass captures are off when speculation is on (the
Worker turns CacheCapacity.in_pass_capture off): a step with one is refused here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.forward_batch import ForwardBatch, ModelCaches
from engine.forward_routes import EagerPass, RouteOutput, SampledTokens
from engine.host_index import int64_array, to_device
from engine.kernels.gpu.batch_plan import GpuBatchPlan, build_gpu_batch_plan
from engine.speculative.verify import VerificationScratch
from engine.step_io import CaptureOp, ScheduledChunk

def verification_order(chunks: Sequence[ScheduledChunk]) -> tuple[list[int], int]:
    """(order, num_rest): the step's chunk indices with the chunks that are not verification
    chunks first (num_rest of them), then the verification chunks, each group in the given
    order."""
    rest = [i for i, chunk in enumerate(chunks) if not chunk.num_draft_tokens]
    verifying = [i for i, chunk in enumerate(chunks) if chunk.num_draft_tokens]
    return rest + verifying, len(rest)


def last_rows_in_order(order: Sequence[int], cu_seqlens: Sequence[int]) -> list[int]:
    """The row of each chunk's last token, in the step's chunk order, for a batch laid out in
    `order` (batch chunk j is step chunk order[j]) with chunk bounds cu_seqlens."""
    position = {chunk_index: j for j, chunk_index in enumerate(order)}
    return [cu_seqlens[position[i] + 1] - 1 for i in range(len(order))]


@dataclass(frozen=True)
class VerificationIndex:
    """Where the verification chunks' positions are, on the host. V chunks sorted by length,
    longest first (stable); n = the longest length.

    rows (n, V): the flat row of position i of chunk v (a chunk shorter than n repeats its
    last row there: read, never written back); scratch_slots (n, V): the scratch slot of
    position i (all n of the chunk's own: one past its length is written but never committed);
    source_slots (V,): the chunks' own state slots; active (n,): how many chunks (a prefix)
    have a position i."""

    rows: np.ndarray
    scratch_slots: np.ndarray
    source_slots: np.ndarray
    active: tuple[int, ...]


def verification_index(
    first_rows: Sequence[int], lengths: Sequence[int], state_slots: Sequence[int],
    scratch: VerificationScratch,
) -> VerificationIndex:
    """The VerificationIndex of V verification chunks: chunk v's rows first_rows[v] ..
    + lengths[v] - 1, its state slot state_slots[v], its scratch slots scratch.slots(...)."""
    order = sorted(range(len(lengths)), key=lambda v: -lengths[v])
    n = max(lengths)
    lengths_sorted = int64_array([lengths[v] for v in order])
    firsts = int64_array([first_rows[v] for v in order])
    positions = np.arange(n, dtype=np.int64)[:, None]  # (n, 1)
    rows = firsts[None, :] + np.minimum(positions, lengths_sorted[None, :] - 1)
    scratch_slots = np.array([scratch.slots(state_slots[v], n) for v in order], dtype=np.int64).T
    active = tuple(int((lengths_sorted > i).sum()) for i in range(n))
    return VerificationIndex(rows, np.ascontiguousarray(scratch_slots),
                             int64_array([state_slots[v] for v in order]), active)


@dataclass(frozen=True)
class VerificationPlan:
    """The recurrent mixers' view of a step with verification chunks (GpuBatchPlan.verification),
    device tensors of a VerificationIndex.

    rest: the plan of the step's other chunks, rows [0, num_rest_rows) (None when there are
    none); rows (n, V) and scratch_slots (n, V); source_slots (V,); for each position i,
    position_rows[i], position_slots[i] (scratch slot i) and position_sources[i] (the slot
    holding the state before position i: the request's for i = 0, scratch slot i - 1 after),
    each (active[i],) and 16-byte aligned (to_device); no_reset (V,) zeros; chunk_bounds
    (V + 1,) 0, 1, .., V: its first a + 1 are the cu_seqlens, its first a the token_chunk,
    of a one-token chunks (the varlen conv's arguments for one position)."""

    rest: GpuBatchPlan | None
    num_rest_rows: int
    rows: torch.Tensor
    scratch_slots: torch.Tensor
    source_slots: torch.Tensor
    position_rows: tuple[torch.Tensor, ...]
    position_slots: tuple[torch.Tensor, ...]
    position_sources: tuple[torch.Tensor, ...]
    no_reset: torch.Tensor
    chunk_bounds: torch.Tensor


def build_verification_plan(index: VerificationIndex, rest: GpuBatchPlan | None, num_rest_rows: int,
                            device: torch.device) -> VerificationPlan:
    """VerificationPlan of `index`, its tensors in one host-to-device copy."""
    n, num_chunks = index.rows.shape
    per_position = []
    for i, active in enumerate(index.active):
        source = index.source_slots if i == 0 else index.scratch_slots[i - 1]
        per_position += [index.rows[i, :active], index.scratch_slots[i, :active], source[:active]]
    rows, scratch, sources, no_reset, bounds, *positions = to_device(
        [index.rows.ravel(), index.scratch_slots.ravel(), index.source_slots,
         np.zeros(num_chunks, dtype=np.int64), np.arange(num_chunks + 1, dtype=np.int64), *per_position], device)
    return VerificationPlan(
        rest=rest, num_rest_rows=num_rest_rows, rows=rows.view(n, num_chunks),
        scratch_slots=scratch.view(n, num_chunks), source_slots=sources,
        position_rows=tuple(positions[0::3]), position_slots=tuple(positions[1::3]),
        position_sources=tuple(positions[2::3]), no_reset=no_reset, chunk_bounds=bounds,
    )


def position_conv_windows(
    old: torch.Tensor,  # (V, C, K-1): the conv windows before the chunks' first positions
    inputs: torch.Tensor,  # (V, C, n): the chunks' pre-conv inputs, position by position
) -> torch.Tensor:
    """(n + 1, V, C, K-1): [j] the conv window after the chunks' first j positions, the last
    K-1 columns of [old | inputs[..., :j]] (what causal_conv1d_step leaves after each token);
    exact (data movement only)."""
    taps = old.shape[2]
    return torch.cat([old, inputs], dim=2).unfold(2, taps, 1).permute(2, 0, 1, 3)


def mix_verification_gpu(
    mixer,  # engine.layers.mamba2.Mamba2Mixer
    xBC: torch.Tensor,  # (T, conv_dim) pre-conv, unit channel stride
    dt_raw: torch.Tensor,  # (T, H)
    conv_state: torch.Tensor,  # (num_slots, conv_dim, K-1): rest slots and scratch slots written
    ssm_state: torch.Tensor,  # (num_slots, H, P, N) fp32: rest slots and scratch slots written
    plan: VerificationPlan,
    decode_step: Callable[..., None] | None = None,  # conv_ssd_decode's signature; None: it
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2Mixer.mix_batch_gpu for a step with verification chunks (module docstring): rows
    [0, num_rest_rows) through the mixer's ordinary path over plan.rest, each verification
    chunk's positions through decode_step one position at a time, the state after position i
    left in its scratch slot i, the chunk's own slot only read. Returns (y (T, H, P) fp32
    without the D skip, x (T, I) the conv output's x columns), as mix_batch_gpu."""
    if decode_step is None:
        from engine.kernels.gpu.mamba_decode import conv_ssd_decode as decode_step
    T = xBC.shape[0]
    H, P = mixer.num_heads, mixer.head_dim
    y = xBC.new_empty(T, H, P, dtype=torch.float32)
    x = xBC.new_empty(T, H, P)
    rest_rows = plan.num_rest_rows
    if plan.rest is not None:
        y_rest, x_rest = mixer.mix_batch_gpu(xBC[:rest_rows], dt_raw[:rest_rows], conv_state, ssm_state, plan.rest)
        y[:rest_rows] = y_rest
        x.view(T, H * P)[:rest_rows] = x_rest
    n, num_chunks = plan.rows.shape
    channels, taps = conv_state.shape[1:]
    old = conv_state.index_select(0, plan.source_slots)  # (V, C, K-1), the request slots: read only
    inputs = xBC.index_select(0, plan.rows.reshape(-1)).view(n, num_chunks, channels).permute(1, 2, 0)
    windows = position_conv_windows(old, inputs)  # (n + 1, V, C, K-1)
    weight = mixer.conv1d.weight[:, 0, :]  # (conv_dim, K)
    scratch_slots = plan.scratch_slots.reshape(-1)  # position-major, as windows[j].reshape
    # scratch slot i: the window before position i, which the decode kernel reads (never writes)
    conv_state.index_copy_(0, scratch_slots, windows[:-1].reshape(-1, channels, taps))
    for i, (rows, slots, sources) in enumerate(zip(plan.position_rows, plan.position_slots, plan.position_sources)):
        ssm_state.index_copy_(0, slots, ssm_state.index_select(0, sources))  # the state before position i
        decode_step(
            xBC, dt_raw, conv_state, weight, mixer.conv1d.bias, mixer.dt_bias, mixer.A_log,
            mixer.time_step_limit, ssm_state, x, y, rows, slots, plan.no_reset[: rows.shape[0]],
        )
    # scratch slot i: the window after position i
    conv_state.index_copy_(0, scratch_slots, windows[1:].reshape(-1, channels, taps))
    return y, x.view(T, H * P)


def mix_delta_rule_verification_gpu(
    mixer,  # engine.layers.gated_delta_net.GatedDeltaNet
    qkv: torch.Tensor,  # (T, C) pre-conv, unit channel stride
    b: torch.Tensor,  # (T, Hv)
    a: torch.Tensor,  # (T, Hv)
    conv_state: torch.Tensor,  # (num_slots, C, K-1): rest slots and scratch slots written
    recurrent_state: torch.Tensor,  # (num_slots, Hv, dk, dv) fp32: rest slots and scratch slots written
    plan: VerificationPlan,
    conv_step: Callable[..., torch.Tensor] | None = None,  # causal_conv1d_varlen's signature; None: it
    rule_step: Callable[..., torch.Tensor] | None = None,  # gated_delta_rule_decode's; None: it
    mix_rest: Callable[..., torch.Tensor] | None = None,  # mixer.mix_chunks_gpu's; None: it
) -> torch.Tensor:
    """GatedDeltaNet.mix_chunks_gpu for a step with verification chunks (module docstring):
    rows [0, num_rest_rows) through mix_rest over plan.rest; then for each position i, scratch
    slot i gets the conv window and the recurrent state before position i (index_copy_ from
    position_sources[i]: the request's slot, only read, or scratch slot i - 1), and plain
    decoding's two kernels run over position i of every chunk still that long, as one-token
    chunks on scratch slot i, never reset: conv_step (which leaves the window after position i
    in the slot) and rule_step (the state after position i). Returns y (T, Hv, dv) in qkv's
    dtype, as mix_chunks_gpu; a scratch slot past a chunk's length is not touched."""
    if conv_step is None:
        from engine.kernels.gpu.conv import causal_conv1d_varlen as conv_step
    if rule_step is None:
        from engine.kernels.gpu.gated_delta_rule import gated_delta_rule_decode as rule_step
    if mix_rest is None:
        mix_rest = mixer.mix_chunks_gpu
    T = qkv.shape[0]
    y = qkv.new_zeros(T, mixer.num_value_heads, mixer.value_head_dim)
    rest_rows = plan.num_rest_rows
    if plan.rest is not None:
        y[:rest_rows] = mix_rest(qkv[:rest_rows], b[:rest_rows], a[:rest_rows], conv_state, recurrent_state, plan.rest)
    weight = mixer.conv1d.weight[:, 0, :]  # (C, K)
    for rows, slots, sources in zip(plan.position_rows, plan.position_slots, plan.position_sources):
        active = rows.shape[0]
        bounds, no_reset = plan.chunk_bounds[: active + 1], plan.no_reset[:active]
        # scratch slot i: the states before position i
        conv_state.index_copy_(0, slots, conv_state.index_select(0, sources))
        recurrent_state.index_copy_(0, slots, recurrent_state.index_select(0, sources))
        conv_out = conv_step(qkv.index_select(0, rows), conv_state, weight, None, bounds, slots, no_reset,
                             bounds[:-1], apply_silu=True)  # (active, C)
        q, k, v, g, beta = mixer.kernel_inputs(conv_out, b.index_select(0, rows), a.index_select(0, rows))
        y.index_copy_(0, rows, rule_step(q, k, v, g, beta, mixer.scale, recurrent_state, slots, no_reset))
    return y


class GpuVerifyPass(EagerPass):
    """A step with verification chunks (num_draft_tokens > 0) on one CUDA device: the eager
    pass over the chunks reordered (verification_order), its plan extended with the recurrent
    mixers' VerificationPlan (module docstring). Takes any such step without in-pass captures
    (ValueError with one: speculation turns them off)."""

    def __init__(self, model, caches: ModelCaches, device: torch.device, scratch: VerificationScratch) -> None:
        super().__init__(model, caches, device)
        self.scratch = scratch

    def accepts(self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp] = ()) -> bool:
        return any(chunk.num_draft_tokens for chunk in chunks)

    def run(
        self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp], sampled: SampledTokens
    ) -> RouteOutput:
        if in_pass:
            raise ValueError("an in-pass capture in a step with verification chunks")
        order, num_rest = verification_order(chunks)
        ordered = [chunks[i] for i in order]
        batch, plan = self.inputs(ordered, sampled)
        plan = replace(plan, verification=self.verification_plan(batch, num_rest))
        hidden = self.model(batch, self.caches, gpu_plan=plan)  # (T, D)
        return RouteOutput(hidden, last_rows_in_order(order, batch.cu_seqlens))

    def verification_plan(self, batch: ForwardBatch, num_rest: int) -> VerificationPlan:
        """The VerificationPlan of `batch`, whose first num_rest chunks are the others."""
        rest_rows = batch.cu_seqlens[num_rest]
        rest = None
        if num_rest:
            rest_batch = ForwardBatch(
                batch.input_ids[:rest_rows], batch.positions[:rest_rows], batch.slot_mapping[:rest_rows],
                batch.chunks[:num_rest], batch.cu_seqlens[: num_rest + 1],
            )
            rest = build_gpu_batch_plan(rest_batch, self.caches.block_size, self.device,
                                        fold_gated_norm=self.fold_gated_norm)
        verifying = batch.chunks[num_rest:]
        index = verification_index(
            batch.cu_seqlens[num_rest:-1], [c.num_tokens for c in verifying],
            [c.state_slot for c in verifying], self.scratch,
        )
        return build_verification_plan(index, rest, rest_rows, self.device)
