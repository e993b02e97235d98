"""CUDA graphs of the model's decode forward pass, captured for a set of batch sizes and replayed
with padding.

A decode step (every chunk one token) of n sequences replays the graph of the smallest captured
size b >= n. The step's inputs (token ids, positions, KV write slots, state slots, reset flags,
key counts, block tables) are packed on the host into one pinned int64 buffer and copied to the
graph's static input buffer in one host-to-device copy; the replay then launches every kernel of
the pass at once. Rows n..b-1 are padding: they read and write only the scratch state slot and
the scratch KV block, which the worker allocates beyond what the scheduler may hand out, so a
padded replay changes exactly the caches an eager step of the same n chunks changes.

Everything the graphs touch is captured by address: the weights and the cache tensors must not
be replaced after capture (the caches are only ever written in place).

Shapes: Bmax the largest captured size, M block-table width, D hidden size.
"""

from __future__ import annotations

import time

import torch

from engine.forward_batch import ForwardBatch, ModelCaches
from engine.kernels.gpu.batch_plan import decode_only_plan
from engine.step_io import ScheduledChunk


def decode_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch, and max_batch itself."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch} | set(range(16, max_batch + 1, 16))
    return tuple(sorted(sizes | {max_batch}))


class DecodeGraphRunner:
    """Captured decode passes of `model` over `caches`, one CUDA graph per batch size.

    scratch_slot / scratch_block: a state slot and a KV block no request ever owns; padding
    rows point there (the caller keeps the scheduler from handing them out).
    max_blocks_per_seq: block-table width; a chunk with a longer table runs eagerly.
    """

    # Row order of the packed input buffer: (6, Bmax) int64 fields, then the (Bmax, M) block table.
    _IDS, _POSITIONS, _KV_SLOTS, _STATE_SLOTS, _RESET, _SEQ_LENS = range(6)
    _NUM_FIELDS = 6

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
        self.scratch_slot = scratch_slot
        self.scratch_block = scratch_block
        device = model.embed_tokens.weight.device
        width = self._NUM_FIELDS * self.max_batch + self.max_batch * self.max_blocks
        # Host staging buffer (pinned) and the graphs' static input buffer, same layout.
        self._host = torch.zeros(width, dtype=torch.int64, pin_memory=True)
        self._host_np = self._host.numpy()
        self._inputs = torch.zeros(width, dtype=torch.int64, device=device)
        self._arange = torch.arange(self.max_batch + 1, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event()  # the last staging copy has left the host buffer
        self._copied.record()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # size -> (b, D) hidden, in the graph pool
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
        """Capture every batch size, largest first, into one memory pool. Each size is run
        eagerly once first (Triton JIT, cuBLAS handles) with padding only, which writes only the
        scratch slot and block."""
        started = time.perf_counter()
        self._fill_padding(0, self.max_batch)
        self._inputs.copy_(self._host)
        torch.cuda.synchronize()
        self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.batch_sizes):
                self._forward(size)  # warm-up outside the graph
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    self._outputs[size] = self._forward(size)
                self._graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started

    def _views(self, size: int) -> tuple[torch.Tensor, ...]:
        """The static input buffer as (ids, positions, kv_slots, state_slots, reset, seq_lens)
        of `size` rows and the (size, M) block table."""
        fields = self._inputs[: self._NUM_FIELDS * self.max_batch].view(self._NUM_FIELDS, self.max_batch)
        table = self._inputs[self._NUM_FIELDS * self.max_batch :].view(self.max_batch, self.max_blocks)
        return (*(fields[f, :size] for f in range(self._NUM_FIELDS)), table[:size])

    def _forward(self, size: int) -> torch.Tensor:
        """The model's forward over the static inputs of `size` rows, with a decode plan built
        on those buffers instead of copied from the host. Returns (size, D)."""
        ids, positions, kv_slots, state_slots, reset, seq_lens, table = self._views(size)
        model = self.model
        batch = ForwardBatch(
            input_ids=ids, positions=positions, slot_mapping=kv_slots, chunks=(),
            cu_seqlens=tuple(range(size + 1)),
        )
        plan = decode_only_plan(state_slots, reset, seq_lens, table, self._arange)
        return model(batch, self.caches, gpu_plan=plan)


    def forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """One decode step of the chunks (accepts() must hold): the same cache writes as the
        eager pass, returns hidden (n, D), a fresh tensor (row i = chunk i)."""
        n = len(chunks)
        size = next(s for s in self.batch_sizes if s >= n)
        self._copied.synchronize()  # usually long done: the last step read its sampled tokens
        stride = self.max_batch
        host = self._host_np
        fields = host[: self._NUM_FIELDS * stride].reshape(self._NUM_FIELDS, stride)
        table = host[self._NUM_FIELDS * stride :].reshape(stride, self.max_blocks)
        bs = self.block_size
        for i, c in enumerate(chunks):
            position = c.start_position
            fields[self._IDS, i] = c.token_ids[0]
            fields[self._POSITIONS, i] = position
            fields[self._KV_SLOTS, i] = c.block_table[position // bs] * bs + position % bs
            fields[self._STATE_SLOTS, i] = c.state_slot
            fields[self._RESET, i] = c.reset_state
            fields[self._SEQ_LENS, i] = position + 1
            used = position // bs + 1  # blocks holding keys 0..position; later entries are never read
            table[i, :used] = c.block_table[:used]
        self._fill_padding(n, size)
        self._inputs.copy_(self._host, non_blocking=True)
        self._copied.record()
        self._graphs[size].replay()
        self.replays += 1
        return self._outputs[size][:n].clone()

    def _fill_padding(self, start: int, end: int) -> None:
        """Rows [start, end) of the host buffer: token 0 at position 0 of the scratch slot
        (reset) and the scratch block."""
        stride = self.max_batch
        fields = self._host_np[: self._NUM_FIELDS * stride].reshape(self._NUM_FIELDS, stride)
        table = self._host_np[self._NUM_FIELDS * stride :].reshape(stride, self.max_blocks)
        fields[self._IDS, start:end] = 0
        fields[self._POSITIONS, start:end] = 0
        fields[self._KV_SLOTS, start:end] = self.scratch_block * self.block_size
        fields[self._STATE_SLOTS, start:end] = self.scratch_slot
        fields[self._RESET, start:end] = 1
        fields[self._SEQ_LENS, start:end] = 1
        table[start:end, 0] = self.scratch_block


__all__ = ["DecodeGraphRunner", "decode_batch_sizes"]
