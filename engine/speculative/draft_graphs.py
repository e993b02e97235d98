"""CUDA graphs of the MTP drafter's draft depths (engine/speculative/mtp.py, step 2 of its
module docstring): one replay runs all k depths for up to b draft starts, where the eager
path builds a ForwardBatch and copies a GpuBatchPlan to the device at every depth.

One graph per batch size b (the verification graphs' sizes, verify_graphs.verify_graph_sizes).
Its static inputs:
- tokens (b,) int64 and hidden (b, D): each start's token t_e and the hidden row before it,
  h_{e-1}, copied on the device from the step's tensors just before the replay;
- an int64 buffer staged on the host (DraftInputStaging, pure numpy) and copied from pageable
  memory (the driver has read it when the copy returns, as for the verification graphs): the
  draft rows' positions, KV write slots and keys to attend at each depth, and block tables.
At depth d the graph runs the head over one row per start at position e + d (decode_only_plan
over the static buffers, first_key 1: keys from position 1 on), then the LM head and the
argmax, which is depth d + 1's token; h' is its hidden row. The drafts (b, k) stay in the
graph pool; draft() returns a copy of the real rows, since the next replay rewrites the pool
before the step that asked is collected.

The block tables are the drafter's scratch tables (MtpDrafter.scratch_table, which also copies
the partial block before e, eagerly, before the replay), so the draft rows write only the
request's scratch blocks; a row's table is staged up to the block of its last draft position.
A padding row (rows n..b-1) sits at position 1 + d in the graph scratch block (every entry of
its table), so it reads and writes only that block. A step drafts eagerly instead when it has
more starts than the largest size (16, the verification graphs' sizes) or a start whose last
draft position lies past the graphs' table width (accepts).

The tokens and hidden buffers are allocated at the largest size; rows n.. keep an earlier
step's values (valid token ids, finite rows), which only padding rows read. The host buffer is
copied from pageable memory, as the verification graphs' is: the copy is small (3 k b + b M
int64), and it may wait for the stream where the driver stages it. Memory: each size keeps its
k depths' (b, V) fp32 logits in the graph pool, outside the cache budgets (k = 4, V = 49,152,
sizes 1..16: 24 MB).

Shapes: b rows, k depths, M block-table width, D hidden size, V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from engine.interfaces.forward_batch import ForwardBatch, ModelCaches
from engine.kernels.gpu.batch_plan import decode_only_plan
from engine.models.mtp_head import MultiTokenPredictionHead, run_head
from engine.routes.decode_graphs import capture_staged
from engine.routes.forward_routes import GraphScratch


class DraftInputStaging:
    """The host half of one draft graph's inputs (b rows, k depths), a flat int64 buffer laid
    out as the graph's static input tensor: positions (k, b), KV write slots (k, b), keys to
    attend (k, b), block tables (b, M)."""

    def __init__(self, size: int, depths: int, max_blocks: int, block_size: int, graph_scratch: GraphScratch) -> None:
        assert depths < max_blocks * block_size, "padding rows sit at positions 1..k of the table width"
        self.size, self.depths, self.max_blocks, self.block_size = size, depths, max_blocks, block_size
        self.scratch_block = graph_scratch.scratch_block
        self.buffer = np.zeros(self.width(size, depths, max_blocks), dtype=np.int64)

    @staticmethod
    def width(size: int, depths: int, max_blocks: int) -> int:
        return 3 * depths * size + size * max_blocks

    def views(self, buffer):
        """(positions, kv_slots, seq_lens) (k, b) each and the block table (b, M): views of
        `buffer` (this layout; numpy or torch)."""
        k, b, m = self.depths, self.size, self.max_blocks
        fields = buffer[: 3 * k * b].reshape(3, k, b)
        return fields[0], fields[1], fields[2], buffer[3 * k * b :].reshape(b, m)

    def blocks_needed(self, position: int) -> int:
        """Blocks of a table that hold keys up to the last draft position of a start at
        `position` (the ones stage writes)."""
        return (position + self.depths - 1) // self.block_size + 1

    def fits(self, position: int, table: Sequence[int]) -> bool:
        """Whether a start at `position` with block table `table` fits: the blocks up to its
        last draft position exist and are within the graphs' table width."""
        needed = self.blocks_needed(position)
        return needed <= len(table) and needed <= self.max_blocks

    def stage(self, starts: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Row v from starts[v] = (its first draft position e >= 1, its block table), each
        fits(); the rest padding."""
        positions, kv, seq_lens, table = self.views(self.buffer)
        bs = self.block_size
        padding = 1 + np.arange(self.depths)[:, None]  # (k, 1)
        positions[:] = padding
        kv[:] = self.scratch_block * bs + padding % bs
        seq_lens[:] = padding + 1
        table[:] = self.scratch_block
        for v, (position, blocks) in enumerate(starts):
            assert position >= 1 and self.fits(position, blocks)
            rows = position + np.arange(self.depths)
            blocks = np.asarray(blocks[: self.blocks_needed(position)], dtype=np.int64)
            positions[:, v] = rows
            kv[:, v] = blocks[rows // bs] * bs + rows % bs
            seq_lens[:, v] = rows + 1
            table[v, : len(blocks)] = blocks


class DraftGraphRunner:
    """Captured draft depths of `head` over `caches`, one CUDA graph per batch size (module
    docstring). graph_scratch: the block no request owns (padding rows' K/V), the slot no
    request owns (every row's state slot in the plan, never read: the head has no recurrent
    layer), and the block-table width."""

    def __init__(
        self, model, head: MultiTokenPredictionHead, caches: ModelCaches, graph_scratch: GraphScratch,
        num_drafts: int, batch_sizes: Sequence[int],
    ) -> None:
        self.model, self.head, self.caches, self.num_drafts = model, head, caches, num_drafts
        self.batch_sizes = tuple(sorted(batch_sizes))
        largest = self.batch_sizes[-1]
        weight = model.embed_tokens.weight
        self._stagings = {b: DraftInputStaging(b, num_drafts, graph_scratch.max_blocks_per_seq, caches.block_size,
                                               graph_scratch)
                          for b in self.batch_sizes}
        self._inputs = {b: torch.zeros(s.buffer.shape[0], dtype=torch.int64, device=weight.device)
                        for b, s in self._stagings.items()}
        self._tokens = torch.zeros(largest, dtype=torch.int64, device=weight.device)
        self._hidden = torch.zeros(largest, weight.shape[1], dtype=weight.dtype, device=weight.device)
        self._slots = torch.full((largest,), graph_scratch.scratch_slot, dtype=torch.int64, device=weight.device)
        self._no_reset = torch.zeros(largest, dtype=torch.int64, device=weight.device)
        self._arange = torch.arange(largest + 1, dtype=torch.int64, device=weight.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # size -> (b, k) int64 drafts, in the graph pool
        self.replays = 0
        self.capture_seconds = 0.0

    def accepts(self, positions: Sequence[int], tables: Sequence[Sequence[int]]) -> bool:
        """Whether one replay serves these starts (at most the largest size, each fits)."""
        staging = self._stagings[self.batch_sizes[-1]]
        return (0 < len(positions) <= self.batch_sizes[-1]
                and all(staging.fits(p, t) for p, t in zip(positions, tables)))

    def draft(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: Sequence[int], tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """The k drafts of each start (n, k) int64 on the device, a copy (accepts() must hold):
        tokens (n,) and hidden (n, D) on the device, the first draft positions e and the
        scratch block tables on the host."""
        size = self.stage(tokens, hidden, positions, tables)
        self._graphs[size].replay()
        self.replays += 1
        return self._outputs[size][: len(positions)].clone()

    def stage(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: Sequence[int], tables: Sequence[Sequence[int]],
    ) -> int:
        """Fill the static inputs of the smallest size that holds the starts; returns it."""
        size = next(b for b in self.batch_sizes if b >= len(positions))
        staging = self._stagings[size]
        staging.stage(list(zip(positions, tables)))
        self._inputs[size].copy_(torch.from_numpy(staging.buffer), non_blocking=True)
        self._tokens[: len(positions)].copy_(tokens)
        self._hidden[: len(positions)].copy_(hidden)
        return size

    def capture(self) -> None:
        """Capture every size, largest first, into one pool; each runs once eagerly first
        (Triton JIT) over padding only, which writes only the graph scratch block."""
        started = time.perf_counter()
        self._graphs, self._outputs = capture_staged(self.batch_sizes, self._stagings, self._inputs, self.forward_static)
        self.capture_seconds = time.perf_counter() - started

    def forward_static(self, size: int) -> torch.Tensor:
        """The k depths over graph `size`'s static inputs (what the graph captures): drafts
        (size, k) int64. Writes the head layer's K/V at the staged slots."""
        positions, kv_slots, seq_lens, table = self._stagings[size].views(self._inputs[size])
        tokens, hidden = self._tokens[:size], self._hidden[:size]
        drafts = []
        for depth in range(self.num_drafts):
            batch = ForwardBatch(input_ids=tokens, positions=positions[depth], slot_mapping=kv_slots[depth],
                                 chunks=(), cu_seqlens=tuple(range(size + 1)))
            plan = replace(decode_only_plan(self._slots[:size], self._no_reset[:size], seq_lens[depth], table,
                                            self._arange), first_key=1)
            hidden = run_head(self.model, self.head, self.caches, batch, hidden, plan)
            tokens = torch.argmax(self.model.compute_logits(hidden), dim=-1)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)
