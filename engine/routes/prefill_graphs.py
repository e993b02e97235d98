"""CUDA graphs of short prefill steps, captured for a set of padded sizes and replayed.

A step whose only computed chunk is one prefill chunk of n tokens, 2 <= n <= the largest size,
whose block table fits and which takes no in-pass capture (the user message after a restored
instruction checkpoint, a short prompt, the tail of a chunked prefill), replays the graph of the
smallest captured size Tpad >= n. The worker allocates the runner on one CUDA device (tensor
parallel size 1), with sizes up to max_num_batched_tokens. Eagerly such a step
is bound by the host: hundreds of kernel launches, each costing more host time than its GPU
time. The replay launches them all at once.

The Tpad - n padding rows change nothing a request owns: their tokens (id 0) write K/V into the
scratch block, the conv sees them as a second chunk that resets and leaves its state in the
scratch slot, the scan sees one sequence of Tpad rows with dt = 0 on the padding (decay 1, no
input, so the state after the last row is the state after token n, and the real rows' outputs
do not depend on later rows), and attention serves the n real queries only. The scratch slot
and block are the ones the decode graphs pad with (engine/routes/decode_graphs.py), which the scheduler
never hands out.

Each graph begins with the copy of the pinned host input buffer into its static input buffer
(as the decode graphs do), so the step's host work before the GPU starts is filling that buffer
and one graph launch. Everything the graphs touch is captured by address, as for the decode
graphs.
Shapes: Tmax the largest size, M block-table width, D hidden size.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

from engine.interfaces.forward_batch import ForwardBatch, ModelCaches
from engine.interfaces.request import PENDING_TOKEN
from engine.interfaces.step_io import CaptureOp, ScheduledChunk
from engine.kernels.gpu.batch_plan import single_prefill_plan
from engine.routes.decode_graphs import capture_by_size
from engine.routes.forward_routes import GraphScratch, RouteOutput, SampledTokens


# Every 64 rows up to 512, then every 128 (at most 1.25x apart): a chunk over 256 tokens pads
# by at most a quarter of its length (a user message after a restored instruction checkpoint
# is usually 50-500 tokens; a short chat prompt under 1,024). With the earlier 1.5x steps (..., 256, 384, 512) the H200
# sweep at 8,000 instruction tokens (benchmarks/results/bench/gpu-instruction-sweep) took
# TTFT p50 about 5.5 ms for user parts of up to 256 tokens and 6.9 ms for 257-384: its median
# request sat just past 256, padded to 384.
PREFILL_GRAPH_SIZES = (64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


def prefill_graph_sizes(max_tokens: int) -> tuple[int, ...]:
    """PREFILL_GRAPH_SIZES not above max_tokens (none if it is below 64)."""
    return tuple(s for s in PREFILL_GRAPH_SIZES if s <= max_tokens)


class PrefillGraphRunner:
    """Captured forward passes of `model` over `caches` for one prefill chunk padded to each of
    `sizes` rows: a forward route (engine/routes/forward_routes.py).

    scratch: where padding rows go and the block-table width (GraphScratch).
    """

    # Packed input buffer: (4, Tmax) per-row fields, then the scalars, then the (M,) block table.
    _IDS, _POSITIONS, _KV_SLOTS, _TOKEN_CHUNK = range(4)
    _NUM_ROW_FIELDS = 4
    # Scalars: cu_seqlens (3), chunk slots (2), chunk resets (2), start position, length.
    _CU, _SLOTS, _RESETS, _START, _LENGTH = 0, 3, 5, 7, 8
    _NUM_SCALARS = 9

    def __init__(self, model, caches: ModelCaches, sizes: tuple[int, ...], scratch: GraphScratch) -> None:
        self.model, self.caches, self.block_size = model, caches, caches.block_size
        self.sizes = tuple(sorted(sizes))
        self.max_rows = self.sizes[-1]
        self.max_blocks = scratch.max_blocks_per_seq
        self.scratch_slot, self.scratch_block = scratch.scratch_slot, scratch.scratch_block
        device = model.embed_tokens.weight.device
        self._scalars_at = self._NUM_ROW_FIELDS * self.max_rows
        self._table_at = self._scalars_at + self._NUM_SCALARS
        width = self._table_at + self.max_blocks
        self._host = torch.zeros(width, dtype=torch.int64, pin_memory=True)
        self._host_np = self._host.numpy()
        self._padding_kv_slots = self.scratch_block * self.block_size + np.arange(self.max_rows) % self.block_size
        self._inputs = torch.zeros(width, dtype=torch.int64, device=device)
        self._arange = torch.arange(2, dtype=torch.int64, device=device)
        self._scan_bounds = {s: torch.tensor([0, s], dtype=torch.int64, device=device) for s in self.sizes}
        self._replayed = torch.cuda.Event()  # the last replay (its input copy too) has finished
        self._replayed.record()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # size -> its hidden rows (size, D)
        self.replays = 0  # prefill steps served by a graph (for tests and benchmarks)
        self.capture_seconds = 0.0

    def accepts(self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp] = ()) -> bool:
        """A graph serves the step: no in-pass capture, exactly one chunk, of 2..Tmax tokens,
        whose block table fits and which holds no pending token (engine/interfaces/request.py: a
        preempted request re-admitted while its last token was in flight; it runs eagerly)."""
        return (
            not in_pass
            and len(chunks) == 1
            and 2 <= len(chunks[0].token_ids) <= self.max_rows
            and len(chunks[0].block_table) <= self.max_blocks
            and chunks[0].token_ids[-1] != PENDING_TOKEN
        )

    def run(
        self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp], sampled: SampledTokens
    ) -> RouteOutput:
        """The one chunk's prefill as a route (it holds no pending token): every real row's
        hidden, which the MTP drafter reads (engine/speculative/mtp.py), not the last alone."""
        n = len(chunks[0].token_ids)
        return RouteOutput(self._replay(chunks[0])[:n], (n - 1,))

    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool, each run eagerly once first
        (Triton JIT and autotuning) on padding only, which writes only the scratch slot and block."""
        started = time.perf_counter()

        def warm_up(size: int) -> None:
            self._fill(None, size)
            self._inputs.copy_(self._host)
            self._forward(size)

        def captured(size: int) -> torch.Tensor:
            # from pinned memory: a copy node that reads the host buffer at each replay
            self._inputs.copy_(self._host, non_blocking=True)
            return self._forward(size)

        self._graphs, self._outputs = capture_by_size(reversed(self.sizes), warm_up, captured)
        self.capture_seconds = time.perf_counter() - started

    def _forward(self, size: int) -> torch.Tensor:
        """The model's forward over the static inputs padded to `size` rows; returns its hidden
        rows, (size, D)."""
        rows = self._inputs[: self._scalars_at].view(self._NUM_ROW_FIELDS, self.max_rows)[:, :size]
        scalars = self._inputs[self._scalars_at : self._table_at]
        table = self._inputs[self._table_at :].view(1, self.max_blocks)
        ids, positions, kv_slots, token_chunk = rows
        batch = ForwardBatch(
            input_ids=ids, positions=positions, slot_mapping=kv_slots, chunks=(), cu_seqlens=(0, size),
        )
        plan = single_prefill_plan(
            cu_seqlens=scalars[self._CU : self._CU + 3],
            chunk_slot=scalars[self._SLOTS : self._SLOTS + 2],
            chunk_reset=scalars[self._RESETS : self._RESETS + 2],
            token_chunk=token_chunk,
            start_position=scalars[self._START : self._START + 1],
            length=scalars[self._LENGTH : self._LENGTH + 1],
            block_table=table,
            scan_bounds=self._scan_bounds[size],
            arange=self._arange,
        )
        return self.model(batch, self.caches, gpu_plan=plan)

    def forward(self, chunk: ScheduledChunk) -> torch.Tensor:
        """The prefill of the one chunk (accepts() must hold): the same cache writes as the
        eager pass; returns the hidden row of its last token, (D,): a view of the graph's
        output, valid until the next forward (as the decode graphs' outputs are)."""
        return self._replay(chunk)[len(chunk.token_ids) - 1]

    def _replay(self, chunk: ScheduledChunk) -> torch.Tensor:
        """Replay the graph of the smallest size that holds `chunk`; returns its output, the
        hidden rows (size, D), of which the first len(chunk.token_ids) are the chunk's."""
        size = next(s for s in self.sizes if s >= len(chunk.token_ids))
        self._replayed.synchronize()  # the host buffer is free: usually long done
        self._fill(chunk, size)
        self._graphs[size].replay()
        self._replayed.record()
        self.replays += 1
        return self._outputs[size]

    def _fill(self, chunk: ScheduledChunk | None, size: int) -> None:
        """The host buffer for `chunk` padded to `size` rows (None: padding only, at the
        scratch slot and block)."""
        rows = self._host_np[: self._scalars_at].reshape(self._NUM_ROW_FIELDS, self.max_rows)
        scalars = self._host_np[self._scalars_at : self._table_at]
        table = self._host_np[self._table_at :]
        bs = self.block_size
        n = 0 if chunk is None else len(chunk.token_ids)
        start = 0 if chunk is None else chunk.start_position
        if chunk is not None:
            positions = np.arange(start, start + n)
            used = -(-(start + n) // bs)  # blocks holding keys 0 .. start + n - 1
            blocks = np.asarray(chunk.block_table[:used], dtype=np.int64)
            rows[self._IDS, :n] = chunk.token_ids
            rows[self._POSITIONS, :n] = positions
            rows[self._KV_SLOTS, :n] = blocks[positions // bs] * bs + positions % bs
            table[:used] = blocks
        else:
            table[0] = self.scratch_block
        rows[self._IDS, n:size] = 0
        rows[self._POSITIONS, n:size] = 0
        rows[self._KV_SLOTS, n:size] = self._padding_kv_slots[n:size]
        rows[self._TOKEN_CHUNK, :n] = 0
        rows[self._TOKEN_CHUNK, n:size] = 1
        scalars[self._CU : self._CU + 3] = (0, n, size)
        scalars[self._SLOTS : self._SLOTS + 2] = (
            self.scratch_slot if chunk is None else chunk.state_slot, self.scratch_slot,
        )
        scalars[self._RESETS : self._RESETS + 2] = (1 if chunk is None else int(chunk.reset_state), 1)
        scalars[self._START] = start
        scalars[self._LENGTH] = n


__all__ = ["PrefillGraphRunner", "prefill_graph_sizes"]
