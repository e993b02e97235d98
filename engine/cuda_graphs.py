"""CUDA graphs of the model's decode forward pass, captured for a set of batch sizes and replayed
with padding.

A decode step (every chunk one token) of n sequences replays the graph of the smallest captured
size b >= n. The step's inputs (token ids, positions, KV write slots, state slots, reset flags,
key counts, block tables) are packed on the host into one pinned int64 buffer; each graph
begins with the host-to-device copy of the part of that buffer it reads into its static input
buffer, so a step's host work before the GPU starts is the packing and one graph launch (the
copy enqueued on its own took 0.05 ms of host time a step on the H200's host,
benchmarks/results/decode_submission_20261203.json). Rows n..b-1 are padding: they read and
write only the scratch state slot and the scratch KV block, which the worker allocates beyond
what the scheduler may hand out, so a padded replay changes exactly the caches an eager step
of the same n chunks changes.

The graph ends with the LM head (model.compute_logits) and the argmax of each row, so a greedy
step's only work after the replay is reading the tokens back: the LM head's launch, scaling,
dtype conversion and the argmax leave the host's path (the sampler still draws the rows that
are not greedy from the logits). Each captured size keeps its (b, V) fp32 logits in the graph
pool, outside the cache budgets: V * 4 bytes times the sum of the sizes (with a 49,152-token
vocabulary, 116 MB for the sizes up to 128, the most captured).

Everything the graphs touch is captured by address: the weights and the cache tensors must not
be replaced after capture (the caches are only ever written in place).

Shapes: Bmax the largest captured size, M block-table width, D hidden size, V vocabulary.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from engine.forward_batch import ForwardBatch, ModelCaches
from engine.kernels.gpu.batch_plan import decode_only_plan
from engine.step_io import ScheduledChunk


def decode_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch, and max_batch itself."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch} | set(range(16, max_batch + 1, 16))
    return tuple(sorted(sizes | {max_batch}))


class DecodeInputStaging:
    """The host half of a decode graph's inputs: n one-token chunks, padded to a captured size,
    packed into a flat int64 buffer laid out as the graph's static input tensor: the (6, Bmax)
    fields (token id, position, KV write slot, state slot, reset flag, keys to attend), then the
    (Bmax, M) block table. Padding rows: token 0 at position 0 of the scratch slot (reset) and
    the scratch block. Pure numpy, so it runs (and is tested) without a GPU.

    Block tables: row i of the table holds the blocks of chunk i that hold keys 0..position; a
    row that already holds exactly those blocks (the same request decoding again, most steps)
    is not rewritten, since converting a block table to numpy is most of the packing time.
    Entries past a row's blocks are stale and never read (the keys to attend bound every read).
    """

    IDS, POSITIONS, KV_SLOTS, STATE_SLOTS, RESET, SEQ_LENS = range(6)
    NUM_FIELDS = 6

    def __init__(
        self, buffer: np.ndarray, max_batch: int, max_blocks: int, block_size: int,
        scratch_slot: int, scratch_block: int,
    ) -> None:
        assert buffer.shape == (self.width(max_batch, max_blocks),) and buffer.dtype == np.int64
        self.buffer = buffer
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        self._staged_tables: list[tuple[int, ...] | None] = [None] * max_batch  # None: padding
        fields_end = self.NUM_FIELDS * max_batch
        self._views = (
            buffer[:fields_end].reshape(self.NUM_FIELDS, max_batch),
            buffer[fields_end:].reshape(max_batch, max_blocks),
        )

    @classmethod
    def width(cls, max_batch: int, max_blocks: int) -> int:
        """Length of the flat buffer."""
        return cls.NUM_FIELDS * max_batch + max_batch * max_blocks

    def used_length(self, size: int) -> int:
        """Length of the buffer's prefix that a graph of `size` rows reads: every field row
        and the first `size` block-table rows. Copying only it keeps a small batch's copy
        small when the table is wide (M = 1,024 blocks: 1 MiB for all of Bmax = 128 rows)."""
        return self.NUM_FIELDS * self.max_batch + size * self.max_blocks

    def views(self) -> tuple[np.ndarray, np.ndarray]:
        """The buffer as the (6, Bmax) fields and the (Bmax, M) block table (views made once)."""
        return self._views

    def stage(self, chunks: list[ScheduledChunk], size: int) -> None:
        """Rows 0..n-1 from the chunks (row i = chunk i), rows n..size-1 padding. A chunk whose
        block table does not cover its position: ValueError (as the eager path). The fields are
        gathered in Python and written with one numpy assignment: at batch 1 a numpy call per
        field took most of the 0.06 ms this used to cost before every decode graph's replay."""
        n = len(chunks)
        fields, table = self.views()
        bs = self.block_size
        rows = []
        for i, chunk in enumerate(chunks):
            position = chunk.start_position
            blocks = chunk.block_table[: position // bs + 1]  # the blocks holding keys 0..position
            if len(blocks) <= position // bs:
                raise ValueError(f"{chunk.request_id}: block table of {len(blocks)} blocks does not "
                                 f"cover position {position}")
            if self._staged_tables[i] != blocks:
                table[i, : len(blocks)] = blocks
                self._staged_tables[i] = blocks
            kv_slot = blocks[-1] * bs + position % bs
            rows.append((chunk.token_ids[0], position, kv_slot, chunk.state_slot, chunk.reset_state, position + 1))
        fields[:, :n] = np.array(rows, dtype=np.int64).reshape(n, self.NUM_FIELDS).T
        if size > n:
            self.fill_padding(n, size)

    def fill_padding(self, start: int, end: int) -> None:
        """Rows [start, end) become padding rows."""
        fields, table = self.views()
        fields[self.IDS, start:end] = 0
        fields[self.POSITIONS, start:end] = 0
        fields[self.KV_SLOTS, start:end] = self.scratch_block * self.block_size
        fields[self.STATE_SLOTS, start:end] = self.scratch_slot
        fields[self.RESET, start:end] = 1
        fields[self.SEQ_LENS, start:end] = 1
        table[start:end, 0] = self.scratch_block
        self._staged_tables[start:end] = [None] * (end - start)


class DecodeGraphRunner:
    """Captured decode passes of `model` over `caches`, one CUDA graph per batch size.

    scratch_slot / scratch_block: a state slot and a KV block no request ever owns; padding
    rows point there (the caller keeps the scheduler from handing them out).
    max_blocks_per_seq: block-table width; a chunk with a longer table runs eagerly.
    """

    def __init__(
        self, model, caches: ModelCaches, batch_sizes: tuple[int, ...], max_blocks_per_seq: int,
        scratch_slot: int, scratch_block: int,
    ) -> None:
        self.model = model
        self.caches = caches
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks = max_blocks_per_seq
        self.block_size = caches.block_size
        device = model.embed_tokens.weight.device
        width = DecodeInputStaging.width(self.max_batch, self.max_blocks)
        # Host staging buffer (pinned) and the graphs' static input buffer, same layout.
        self._host = torch.zeros(width, dtype=torch.int64, pin_memory=True)
        self._staging = DecodeInputStaging(
            self._host.numpy(), self.max_batch, self.max_blocks, self.block_size, scratch_slot, scratch_block
        )
        self._inputs = torch.zeros(width, dtype=torch.int64, device=device)
        self._arange = torch.arange(self.max_batch + 1, dtype=torch.int64, device=device)
        self._replayed = torch.cuda.Event()  # the last replay (its input copy too) has finished
        self._replayed.record()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # size -> ((b, D) hidden, (b, V) fp32 logits, (b,) int64 argmax), in the graph pool
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._pool = None
        self.replays = 0  # decode steps served by a graph (for tests and benchmarks)
        self.capture_seconds = 0.0  # wall time of capture(), warm-up runs included

    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        """A graph serves the step: 1..Bmax chunks of one token each, block tables that fit."""
        return (
            0 < len(chunks) <= self.max_batch
            and all(len(c.token_ids) == 1 and len(c.block_table) <= self.max_blocks for c in chunks)
        )


    def capture(self) -> None:
        """Capture every batch size, largest first, into one memory pool: the input copy, then
        the forward pass, the LM head and the argmax. Each size is run eagerly once first
        (Triton JIT, cuBLAS handles) with padding only, which writes only the scratch slot and
        block."""
        started = time.perf_counter()
        self._staging.fill_padding(0, self.max_batch)
        self._inputs.copy_(self._host)
        torch.cuda.synchronize()
        self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.batch_sizes):
                self._forward(size)  # warm-up outside the graph
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    used = self._staging.used_length(size)
                    # from pinned memory: a copy node that reads the host buffer at each replay
                    self._inputs[:used].copy_(self._host[:used], non_blocking=True)
                    self._outputs[size] = self._forward(size)
                self._graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started

    def _views(self, size: int) -> tuple[torch.Tensor, ...]:
        """The static input buffer as (ids, positions, kv_slots, state_slots, reset, seq_lens)
        of `size` rows and the (size, M) block table (DecodeInputStaging's layout)."""
        num_fields = DecodeInputStaging.NUM_FIELDS
        fields = self._inputs[: num_fields * self.max_batch].view(num_fields, self.max_batch)
        table = self._inputs[num_fields * self.max_batch :].view(self.max_batch, self.max_blocks)
        return (*(fields[f, :size] for f in range(num_fields)), table[:size])

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The model's forward over the static inputs of `size` rows, with a decode plan built
        on those buffers instead of copied from the host, then the LM head and the argmax.
        Returns hidden (size, D), logits (size, V) fp32 and their argmax (size,) int64."""
        ids, positions, kv_slots, state_slots, reset, seq_lens, table = self._views(size)
        model = self.model
        batch = ForwardBatch(
            input_ids=ids, positions=positions, slot_mapping=kv_slots, chunks=(),
            cu_seqlens=tuple(range(size + 1)),
        )
        plan = decode_only_plan(state_slots, reset, seq_lens, table, self._arange)
        hidden = model(batch, self.caches, gpu_plan=plan)
        logits = model.compute_logits(hidden)
        return hidden, logits, torch.argmax(logits, dim=-1)

    def forward(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode step of the chunks (accepts() must hold): the same cache writes as the
        eager pass. Returns hidden (n, D), logits (n, V) fp32 and their argmax (n,) int64 (row
        i = chunk i), views of the graph's outputs: valid until the next forward, which
        overwrites them (the worker reads a step's hidden rows, for captures, before its next
        forward)."""
        size = next(s for s in self.batch_sizes if s >= len(chunks))
        self._replayed.synchronize()  # the host buffer is free: usually long done
        self._staging.stage(chunks, size)
        self._graphs[size].replay()
        self._replayed.record()
        self.replays += 1
        outputs = self._outputs[size]
        n = len(chunks)
        return outputs if n == size else tuple(out[:n] for out in outputs)


__all__ = ["DecodeGraphRunner", "DecodeInputStaging", "decode_batch_sizes"]
