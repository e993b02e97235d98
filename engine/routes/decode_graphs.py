"""CUDA graphs of the model's decode forward pass, captured for a set of batch sizes and replayed
with padding.

A decode step (every chunk one token) of n sequences replays the graph of the smallest captured
size b >= n. The step's inputs (token ids, positions, KV write slots, state slots, reset flags,
key counts, token sources, block tables) are packed on the host into one of two pinned int64
buffers, used in turn, and copied into the graphs' static input buffer just before the replay.
With async scheduling the worker stages step k+1 while step k runs on the device; the buffer
step k was copied from may not be rewritten before that copy is done, hence two. (A copy
inside the graph would save 0.03 ms of host time a step, but then the host could only know
the buffer is free when the whole graph is done, which would serialise the steps again.)
A row's token is read
on the device, from the token pool: its own field, or the token the previous step sampled for
the request when the scheduler had only PENDING_TOKEN for it. Rows n..b-1 are padding: they read and
write only the scratch state slot and the scratch KV block, which the worker allocates beyond
what the scheduler may hand out, so a padded replay changes exactly the caches an eager step
of the same n chunks changes. The runner is the worker's first forward route
(engine/routes/forward_routes.py).

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
from collections.abc import Callable, Iterable
from typing import Sequence, TypeVar

import numpy as np
import torch

from engine.interfaces.forward_batch import ForwardBatch, ModelCaches
from engine.interfaces.request import PENDING_TOKEN
from engine.interfaces.step_io import CaptureOp, ScheduledChunk
from engine.kernels.gpu.batch_plan import decode_only_plan
from engine.routes.forward_routes import GraphScratch, RouteOutput, SampledTokens


Output = TypeVar("Output")


def capture_by_size(
    sizes: Iterable[int], warm_up: Callable[[int], object], captured: Callable[[int], Output],
) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, Output]]:
    """One CUDA graph per size, in the order given (largest first, so the smaller ones fit in
    the memory the first one took), all in one memory pool: warm_up(size) runs eagerly first
    (Triton JIT and autotuning, cuBLAS handles; it stages its own inputs), the device is
    synchronised, then captured(size) is recorded. Returns the graphs and what captured(size)
    returned (its outputs, in the pool), by size; inference mode throughout. The decode,
    prefill, verification and MTP draft graph runners capture through it (the last two by
    capture_staged)."""
    pool = torch.cuda.graph_pool_handle()
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, Output] = {}
    with torch.inference_mode():
        for size in sizes:
            warm_up(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[size] = captured(size)
            graphs[size] = graph
    torch.cuda.synchronize()
    return graphs, outputs


def capture_staged(
    sizes: Iterable[int], stagings: dict, inputs: dict[int, torch.Tensor], forward_static: Callable[[int], Output],
) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, Output]]:
    """capture_by_size, largest first, for a runner whose static inputs of each size are the
    device tensor inputs[size], copied from a numpy staging's buffer (stagings[size], with
    stage(starts) and buffer): each size's warm-up stages padding only (stage(())), copies it
    and runs forward_static(size), which writes only what padding may write. The
    verification and the MTP draft graph runners capture through it."""

    def warm_up(size: int) -> None:
        stagings[size].stage(())
        inputs[size].copy_(torch.from_numpy(stagings[size].buffer))
        forward_static(size)

    return capture_by_size(sorted(sizes, reverse=True), warm_up, forward_static)


def decode_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch, and max_batch itself."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch} | set(range(16, max_batch + 1, 16))
    return tuple(sorted(sizes | {max_batch}))


class DecodeInputStaging:
    """The host half of a decode graph's inputs: n one-token chunks, padded to a captured size,
    packed into a flat int64 buffer laid out as the graph's static input tensor: the (7, Bmax)
    fields (token id, position, KV write slot, state slot, reset flag, keys to attend, token
    source), then the (Bmax, M) block table. Padding rows: token 0 at position 0 of the scratch
    slot (reset) and the scratch block. Pure numpy, so it runs (and is tested) without a GPU.

    Token source: the graph reads row i's token at index SOURCE[i] of its token pool, the
    previous step's S sampled tokens followed by this buffer (DecodeGraphRunner). A known
    token is read from the buffer itself (S + i, the ID field's row i); a pending one
    (PENDING_TOKEN) from the previous step's sampled row given for it in `pending_rows`.

    Block tables: row i of the table holds the blocks of chunk i that hold keys 0..position; a
    row that already holds exactly those blocks (the same request decoding again, most steps)
    is not rewritten, since converting a block table to numpy is most of the packing time.
    Entries past a row's blocks are stale and never read (the keys to attend bound every read).
    """

    IDS, POSITIONS, KV_SLOTS, STATE_SLOTS, RESET, SEQ_LENS, SOURCE = range(7)
    NUM_FIELDS = 7

    def __init__(
        self, buffer: np.ndarray, max_batch: int, max_blocks: int, block_size: int,
        scratch_slot: int, scratch_block: int, num_sampled: int = 0,
    ) -> None:
        """num_sampled: S, the sampled-token rows ahead of this buffer in the graph's pool."""
        assert buffer.shape == (self.width(max_batch, max_blocks),) and buffer.dtype == np.int64
        self.buffer = buffer
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        self.num_sampled = num_sampled
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
        """The buffer as the (7, Bmax) fields and the (Bmax, M) block table (views made once)."""
        return self._views

    def stage(self, chunks: list[ScheduledChunk], size: int, pending_rows: dict[str, int] | None = None) -> None:
        """Rows 0..n-1 from the chunks (row i = chunk i), rows n..size-1 padding. A chunk whose
        block table does not cover its position, or whose pending token has no row in
        `pending_rows` (request id -> the previous step's sampled row): ValueError. The fields
        are gathered in Python and written with one numpy assignment: at batch 1 a numpy call
        per field took most of the 0.06 ms this used to cost before every decode graph's replay."""
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
            token = chunk.token_ids[0]
            source = self.num_sampled + i
            if token == PENDING_TOKEN:
                token, source = 0, _pending_row(chunk.request_id, pending_rows)
            rows.append((token, position, kv_slot, chunk.state_slot, chunk.reset_state, position + 1, source))
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
        fields[self.SOURCE, start:end] = np.arange(start, end) + self.num_sampled
        table[start:end, 0] = self.scratch_block
        self._staged_tables[start:end] = [None] * (end - start)


def _pending_row(request_id: str, pending_rows: dict[str, int] | None) -> int:
    """The previous step's sampled row that holds request_id's pending token."""
    row = (pending_rows or {}).get(request_id)
    if row is None:
        raise ValueError(f"{request_id}: a pending token, but the previous step sampled none for it")
    return row


class DecodeGraphRunner:
    """Captured decode passes of `model` over `caches`, one CUDA graph per batch size: a
    forward route (engine/routes/forward_routes.py).

    scratch: where padding rows go and the block-table width (GraphScratch).
    num_sampled: S >= the largest batch size, the rows of `sampled_tokens`.
    The graphs' plan folds the Mamba gated norm at batch 1 when the model allows it
    (fold_gated_norm, asked of the model once, here).

    sampled_tokens (S,) int64 is where the worker keeps each step's sampled tokens (row i =
    the step's i-th sampling chunk); a graph writes its argmax there (rows 0..b-1), and reads a
    pending token from it (DecodeInputStaging). It lies just ahead of the static input buffer
    in one token pool, so the graph reads every row's token with one gather.
    """

    def __init__(
        self, model, caches: ModelCaches, batch_sizes: tuple[int, ...], scratch: GraphScratch,
        num_sampled: int | None = None,
    ) -> None:
        self.model, self.caches, self.block_size = model, caches, caches.block_size
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks = scratch.max_blocks_per_seq
        self.fold_gated_norm = model.folds_gated_norm()
        device = model.embed_tokens.weight.device
        width = DecodeInputStaging.width(self.max_batch, self.max_blocks)
        num_sampled = self.max_batch if num_sampled is None else num_sampled
        assert num_sampled >= self.max_batch
        # Two pinned host staging buffers, used in turn (a step is staged while the one before
        # may still be copying from the other), each with the event of its last copy; and the
        # graphs' static input buffer, same layout, in the token pool behind the sampled tokens.
        self._hosts = [torch.zeros(width, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._stagings = [
            DecodeInputStaging(host.numpy(), self.max_batch, self.max_blocks, self.block_size,
                               scratch.scratch_slot, scratch.scratch_block, num_sampled=num_sampled)
            for host in self._hosts
        ]
        self._copied = [torch.cuda.Event() for _ in self._hosts]
        self._next_host = 0
        self._token_pool = torch.zeros(num_sampled + width, dtype=torch.int64, device=device)
        self.sampled_tokens = self._token_pool[:num_sampled]
        self._inputs = self._token_pool[num_sampled:]
        self._arange = torch.arange(self.max_batch + 1, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # size -> ((b, D) hidden, (b, V) fp32 logits, (b,) int64 argmax), in the graph pool
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.replays = 0  # decode steps served by a graph (for tests and benchmarks)
        self.capture_seconds = 0.0  # wall time of capture(), warm-up runs included

    def accepts(self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp] = ()) -> bool:
        """A graph serves the step: 1..Bmax chunks of one token each, block tables that fit
        (a step of one-token chunks has no in-pass capture)."""
        return (
            0 < len(chunks) <= self.max_batch
            and all(len(c.token_ids) == 1 and len(c.block_table) <= self.max_blocks for c in chunks)
        )

    def run(
        self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp], sampled: SampledTokens
    ) -> RouteOutput:
        """forward() as a route: row i of every output is chunk i. `sampled.pool` is this
        runner's sampled_tokens (the worker keeps its sampled tokens there)."""
        hidden, logits, argmax = self.forward(chunks, sampled.rows)
        return RouteOutput(hidden, range(len(chunks)), logits, argmax)

    def capture(self) -> None:
        """Capture every batch size, largest first, into one memory pool: the forward pass over
        the static inputs, the LM head and the argmax. Each size is run eagerly once first
        (Triton JIT, cuBLAS handles) with padding only, which writes only the scratch slot and
        block."""
        started = time.perf_counter()
        self._stagings[0].fill_padding(0, self.max_batch)
        self._inputs.copy_(self._hosts[0])
        torch.cuda.synchronize()
        self._graphs, self._outputs = capture_by_size(reversed(self.batch_sizes), self._forward, self._forward)
        self.capture_seconds = time.perf_counter() - started

    def _views(self, size: int) -> tuple[torch.Tensor, ...]:
        """The static input buffer as (ids, positions, kv_slots, state_slots, reset, seq_lens,
        source) of `size` rows and the (size, M) block table (DecodeInputStaging's layout)."""
        num_fields = DecodeInputStaging.NUM_FIELDS
        fields = self._inputs[: num_fields * self.max_batch].view(num_fields, self.max_batch)
        table = self._inputs[num_fields * self.max_batch :].view(self.max_batch, self.max_blocks)
        return (*(fields[f, :size] for f in range(num_fields)), table[:size])

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The model's forward over the static inputs of `size` rows, with a decode plan built
        on those buffers instead of copied from the host, then the LM head and the argmax.
        Returns hidden (size, D), logits (size, V) fp32 and their argmax (size,) int64."""
        _, positions, kv_slots, state_slots, reset, seq_lens, source, table = self._views(size)
        model = self.model
        ids = self._token_pool.index_select(0, source)  # known tokens and pending ones
        batch = ForwardBatch(
            input_ids=ids, positions=positions, slot_mapping=kv_slots, chunks=(),
            cu_seqlens=tuple(range(size + 1)),
        )
        plan = decode_only_plan(
            state_slots, reset, seq_lens, table, self._arange, fold_gated_norm=self.fold_gated_norm
        )
        hidden = model(batch, self.caches, gpu_plan=plan)
        logits = model.compute_logits(hidden)
        argmax = torch.argmax(logits, dim=-1, out=self.sampled_tokens[:size])
        return hidden, logits, argmax

    def forward(
        self, chunks: list[ScheduledChunk], pending_rows: dict[str, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode step of the chunks (accepts() must hold): the same cache writes as the
        eager pass. A chunk's PENDING_TOKEN is read from sampled_tokens[pending_rows[its
        request id]]. Returns hidden (n, D), logits (n, V) fp32 and their argmax (n,) int64
        (row i = chunk i; the argmax is sampled_tokens[:n]), views of the graph's outputs:
        valid until the next forward, which overwrites them (the worker reads a step's hidden
        rows, for captures, before its next forward)."""
        size = next(s for s in self.batch_sizes if s >= len(chunks))
        turn = self._next_host
        self._next_host = 1 - turn
        self._copied[turn].synchronize()  # this buffer's copy two steps ago: long done
        staging = self._stagings[turn]
        staging.stage(chunks, size, pending_rows)
        used = staging.used_length(size)
        self._inputs[:used].copy_(self._hosts[turn][:used], non_blocking=True)
        self._copied[turn].record()
        self._graphs[size].replay()
        self.replays += 1
        outputs = self._outputs[size]
        n = len(chunks)
        return outputs if n == size else tuple(out[:n] for out in outputs)


__all__ = ["DecodeGraphRunner", "DecodeInputStaging", "decode_batch_sizes"]
