"""CUDA graphs of verification steps (issue 25, point 4): a step whose every chunk is a
verification chunk replays a captured forward pass instead of launching the eager route's
kernels one by one (engine/speculative/verify_gpu.py: attention's, the MLPs', the norms'
and one verification kernel per recurrent layer).

One graph per batch size b (VERIFY_GRAPH_BATCH_SIZES up to the step's sequences), each over
b chunks of n = k + 1 rows: chunk v owns rows v n .. v n + n - 1. A chunk with fewer drafts is
padded to n rows, and the step to b chunks; padding reads and writes only what no request
owns or what its own chunk owns and never commits:
- a padded row of a real chunk writes its K/V into the graph scratch block (its kv slot), and
  its recurrent states into its own scratch slots past its length (the chunk's n are allocated);
  no real row attends to it (attention is causal, and its key is not in the chunk's table);
- a padding chunk (v >= the step's chunks) has the graph scratch slot as its state slot and
  as every scratch slot, the scratch block as every block, position 0 on (several padding
  chunks then share that slot: what they leave there is junk no request reads).
The graphs' plan (batch_plan.verification_only_plan) is built once over static device
buffers; each step's inputs are packed on the host (VerifyInputStaging, pure numpy) and copied
into them from pageable memory, which the driver has read when the copy returns, so the host
buffer can be rewritten by the next step at once. The LM head runs after the replay
(verify_greedy), as for the eager route.

A step takes the graphs when every chunk verifies, no token is pending, there are at most
the largest size of them, and every chunk's block table and its n padded positions fit the
graphs' table width (else the eager route). Everything the graphs touch is captured by
address (weights, caches).

Shapes: b chunks, n = k + 1 rows each, M block-table width.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from engine.interfaces.forward_batch import ForwardBatch, ModelCaches
from engine.interfaces.request import PENDING_TOKEN
from engine.interfaces.step_io import CaptureOp, ScheduledChunk
from engine.kernels.gpu.batch_plan import verification_only_plan
from engine.kernels.gpu.batch_plan import VerificationPlan
from engine.routes.decode_graphs import capture_staged
from engine.routes.forward_routes import GraphScratch, RouteOutput, SampledTokens
from engine.speculative.verify import VerificationScratch

VERIFY_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16)


class VerifyInputStaging:
    """The host half of one verification graph's inputs (b chunks of n rows), packed into a
    flat int64 buffer laid out as the graph's static input tensor: ids (b n), positions
    (b n), kv write slots (b n), state slots (b), start positions (b), scratch slots (n, b),
    block tables (b, M). Pure numpy, so it runs (and is tested) without a GPU."""

    def __init__(self, size: int, positions: int, max_blocks: int, block_size: int,
                 scratch: VerificationScratch, graph_scratch: GraphScratch) -> None:
        self.size, self.positions, self.max_blocks, self.block_size = size, positions, max_blocks, block_size
        self.scratch, self.graph_scratch = scratch, graph_scratch
        self.buffer = np.zeros(self.width(size, positions, max_blocks), dtype=np.int64)

    @staticmethod
    def width(size: int, positions: int, max_blocks: int) -> int:
        return 3 * size * positions + 2 * size + positions * size + size * max_blocks

    def views(self, buffer):
        """(ids, positions, kv_slots) (b n,) each, state_slots, starts (b,), scratch_slots
        (n, b), block_table (b, M): views of `buffer` (this layout; numpy or torch)."""
        b, n, m = self.size, self.positions, self.max_blocks
        rows = b * n
        offsets = np.cumsum([0, rows, rows, rows, b, b, n * b, b * m]).tolist()
        ids, positions, kv, slots, starts, scratch, table = (buffer[offsets[i] : offsets[i + 1]] for i in range(7))
        return ids, positions, kv, slots, starts, scratch.reshape(n, b), table.reshape(b, m)

    def fits(self, chunk: ScheduledChunk) -> bool:
        """Whether the chunk's n padded positions and its block table fit this layout, and its
        table covers its tokens (else the eager route takes the step, and says so)."""
        end = chunk.start_position + len(chunk.token_ids)
        return (
            len(chunk.token_ids) <= self.positions
            and chunk.start_position + self.positions <= self.max_blocks * self.block_size
            and -(-end // self.block_size) <= len(chunk.block_table) <= self.max_blocks
        )

    def stage(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Chunks 0..len-1 from `chunks` (each fits(), no pending token), the rest padding."""
        ids, positions, kv, slots, starts, scratch, table = self.views(self.buffer)
        n, bs = self.positions, self.block_size
        scratch_block = self.graph_scratch.scratch_block
        table[:] = scratch_block
        ids[:] = 0
        kv[:] = scratch_block * bs + np.arange(self.size * n) % n % bs
        positions[:] = np.tile(np.arange(n), self.size)
        slots[:] = self.graph_scratch.scratch_slot
        starts[:] = 0
        scratch[:] = self.graph_scratch.scratch_slot
        for v, chunk in enumerate(chunks):
            length, start = len(chunk.token_ids), chunk.start_position
            assert PENDING_TOKEN not in chunk.token_ids and self.fits(chunk)
            rows = slice(v * n, v * n + length)
            ids[rows] = chunk.token_ids
            positions[v * n : (v + 1) * n] = start + np.arange(n)
            real = start + np.arange(length)
            blocks = np.asarray(chunk.block_table, dtype=np.int64)
            kv[rows] = blocks[real // bs] * bs + real % bs
            slots[v], starts[v] = chunk.state_slot, start
            scratch[:, v] = self.scratch.slots(chunk.state_slot, n)
            table[v, : len(blocks)] = blocks


class VerifyGraphRunner:
    """Captured verification passes of `model` over `caches`, one CUDA graph per batch size:
    a forward route (module docstring). scratch: the verification scratch slots;
    graph_scratch: the slot and block no request owns, and the block-table width."""

    def __init__(
        self, model, caches: ModelCaches, scratch: VerificationScratch, graph_scratch: GraphScratch,
        batch_sizes: Sequence[int] = VERIFY_GRAPH_BATCH_SIZES,
    ) -> None:
        self.model, self.caches = model, caches
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.positions = scratch.positions
        device = model.embed_tokens.weight.device
        self._stagings = {
            b: VerifyInputStaging(b, self.positions, graph_scratch.max_blocks_per_seq, caches.block_size,
                                  scratch, graph_scratch)
            for b in self.batch_sizes
        }
        self._inputs = {b: torch.zeros(s.buffer.shape[0], dtype=torch.int64, device=device)
                        for b, s in self._stagings.items()}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # size -> (b n, D) hidden, in the graph pool
        self.replays = 0
        self.capture_seconds = 0.0

    def accepts(self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp] = ()) -> bool:
        staging = self._stagings[self.batch_sizes[-1]]
        return (
            not in_pass and 0 < len(chunks) <= self.batch_sizes[-1]
            and all(chunk.num_draft_tokens and PENDING_TOKEN not in chunk.token_ids and staging.fits(chunk)
                    for chunk in chunks)
        )

    def run(
        self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp], sampled: SampledTokens
    ) -> RouteOutput:
        """Stage, copy, replay; chunk v's rows are v n .. v n + len - 1 of the graph's hidden
        output (valid until its next replay)."""
        size = next(b for b in self.batch_sizes if b >= len(chunks))
        staging = self._stagings[size]
        staging.stage(chunks)
        self._inputs[size].copy_(torch.from_numpy(staging.buffer), non_blocking=True)
        self._graphs[size].replay()
        self.replays += 1
        n = self.positions
        return RouteOutput(self._outputs[size], [v * n + len(c.token_ids) - 1 for v, c in enumerate(chunks)])

    def capture(self) -> None:
        """Capture every size, largest first, into one pool; each runs once eagerly first
        (Triton JIT) over padding only, which writes only the graph scratch slot and block."""
        started = time.perf_counter()
        self._graphs, self._outputs = capture_staged(self.batch_sizes, self._stagings, self._inputs, self.forward_static)
        self.capture_seconds = time.perf_counter() - started

    def forward_static(self, size: int) -> torch.Tensor:
        """The model's forward over graph `size`'s static inputs (what the graph captures):
        hidden (b n, D)."""
        staging, n = self._stagings[size], self.positions
        ids, positions, kv, slots, starts, scratch, table = staging.views(self._inputs[size])
        device = ids.device
        cu = torch.arange(size + 1, dtype=torch.int64, device=device) * n
        no_reset = torch.zeros(size, dtype=torch.int64, device=device)
        lengths = torch.full_like(slots, n)
        verification = VerificationPlan(rest=None, num_rest_rows=0, first_rows=cu[:-1], lengths=lengths,
                                        source_slots=slots, scratch_slots=scratch)
        plan = verification_only_plan(cu, slots, no_reset, lengths, starts, table, n, verification)
        batch = ForwardBatch(input_ids=ids, positions=positions, slot_mapping=kv, chunks=(),
                             cu_seqlens=tuple(range(0, size * n + 1, n)))
        return self.model(batch, self.caches, gpu_plan=plan)


def verify_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """VERIFY_GRAPH_BATCH_SIZES up to max_num_seqs, and max_num_seqs itself when it is below
    the largest."""
    largest = min(max_num_seqs, VERIFY_GRAPH_BATCH_SIZES[-1])
    return tuple(sorted({s for s in VERIFY_GRAPH_BATCH_SIZES if s <= largest} | {largest}))
