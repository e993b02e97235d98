"""The MTP drafter, the worker's side: the multi-token-prediction head (engine/models/mtp_head.py)
run over every computed position, and k draft tokens proposed after each chunk that asks.

Positions. The head's row for position q takes the pair (t_q, h_{q-1}): the token at q and the
target's hidden row before it, and predicts t_{q+1}. Its K/V goes to position q of the head's
own layer in the model's paged KV cache (layer index num_hidden_layers, engine/parallel/cache_capacity.py
drafter_kv_layers): the positions a chunk computes are the positions whose head K/V it writes,
so checkpoints (full blocks, attention tail) and transfers carry the head's K/V with the rest,
a restore brings it back, and a rejected draft's K/V is overwritten as the main layers' is.
Position 0 has no pair: nothing is written there and the head's attention reads keys from
position 1 on (SequenceChunk.first_key). RoPE turns the row for position q by q - 1, the
position of its hidden row (vLLM's convention; only differences of positions matter).

Per step, on the PyTorch path and on CUDA alike (there through each batch's GpuBatchPlan, its
attention in the paged kernels with first_key 1; the drafts stay on the device until collect):

1. `extend`, after the model's forward: for every computed chunk [s, e), the head's rows for
   positions max(s, 1) .. e - 1, h_{s-1} being the request's last hidden row before the chunk
   (the previous step's, a commit's or a restored bundle's; `rows_before` keeps them before
   the forward) and the rest the chunk's own rows. Every request's chunks, so any checkpoint
   holds the head's K/V of all its positions.
2. `propose`, after sampling (`starts` says where): for each chunk with propose_drafts, from
   the position e after its last kept one (a verification chunk: the greedy rule's accepted
   drafts and the bonus token), the k draft rows (t_e, h_{e-1}) -> d1, (d1, h'_e) -> d2, ...,
   each depth one row per request. Draft rows write their K/V into the request's scratch
   blocks (allocated past the scheduler's, per state slot), which hold a copy of the partial
   block before e: the paged cache past the kept positions is never written by drafting.
   Where the worker replays CUDA graphs, all k depths are one replay of the draft graphs
   (engine/speculative/draft_graphs.py) instead of a batch and a plan per depth.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.engine_config import EngineConfig
from engine.interfaces.forward_batch import ForwardBatch, ModelCaches, build_forward_batch
from engine.interfaces.step_io import DraftProposal, ScheduledChunk
from engine.models.mtp_head import MultiTokenPredictionHead, run_head
from engine.routes.forward_routes import EagerPass, RouteOutput, SampledTokens
from engine.parallel.tensor_parallel import parameter_shards
from engine.speculative.checks import check_mtp_head
from engine.speculative.policy import TRAINED_HEAD_FILE
from engine.speculative.scheduling import greedy_accept

if TYPE_CHECKING:
    from engine.speculative.draft_graphs import DraftGraphRunner
    from engine.interfaces.output_rows import RowRef


def attach_head(model, config: EngineConfig) -> MultiTokenPredictionHead | None:
    """The head the MTP drafter runs, when config drafts with mtp (None otherwise): the model's
    own (Qwen3-Next's mtp.*), a random one from random_mtp_head_seed, or the trained head in
    the model dir (TRAINED_HEAD_FILE, benchmarks/train_mtp_head.py), attached to the model as
    model.mtp. ValueError naming the key where there is none to run
    (engine/speculative/checks.py check_mtp_head, also run at deploy time)."""
    if not (config.num_speculative_tokens and config.speculative_drafter == "mtp"):
        return None
    check_mtp_head(config, model.config)
    if config.random_mtp_head_seed is not None:
        model.mtp = model.random_mtp_head(config.random_mtp_head_seed)
    elif model.mtp is None:
        model.mtp = load_trained_head(model, Path(config.model_dir) / TRAINED_HEAD_FILE)
    return model.mtp


def load_trained_head(model, path: Path) -> MultiTokenPredictionHead:
    """The MTP head saved at `path` (safetensors: every parameter of the head, unsharded, by
    its name in MultiTokenPredictionHead) for a model whose checkpoint has none: the head
    random_mtp_head builds (this rank's shard of one decoder layer of the family), its values
    replaced by the file's, each parameter's shard cut as the loader cuts the model's.
    ValueError when the file's tensors are not exactly the head's, or a shape differs."""
    from safetensors.torch import load_file

    head = model.random_mtp_head(0)  # the structure and the shards; every value is replaced
    tensors = load_file(str(path))
    names = {name for name, _ in head.named_parameters()}
    if set(tensors) != names:
        raise ValueError(f"{path}: the MTP head's tensors are {sorted(names)}, the file holds {sorted(tensors)}")
    shards = parameter_shards(head)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            value, shard = tensors[name], shards.get(name)
            full = tuple(parameter.shape) if shard is None else tuple(shard.full_shape)
            if tuple(value.shape) != full:
                raise ValueError(f"{path}: {name} has shape {tuple(value.shape)}, the head's is {full}")
            parameter.copy_(value if shard is None else shard.cut(value))  # views of stacked q, k, v too
    return head


@dataclass(frozen=True)
class PendingDrafts:
    """A step's proposals before they reach the host: request_ids[i]'s drafts tokens[i] (on
    the device) follow its first follows[i] tokens."""

    request_ids: tuple[str, ...]
    follows: tuple[int, ...]
    tokens: torch.Tensor  # (n, k) int64

    def read(self) -> dict[str, DraftProposal]:
        """The proposals on the host, by request id (waits for the device if it must)."""
        return {rid: DraftProposal(follows, tuple(row))
                for rid, follows, row in zip(self.request_ids, self.follows, self.tokens.tolist())}


@dataclass(frozen=True)
class DraftStart:
    """Where a request's drafts start: its chunk of this step, the position e of the token the
    first draft follows, that token (0-d int64 on the device) and the hidden row before it,
    h_{e-1} (D,)."""

    chunk: ScheduledChunk
    position: int
    token: torch.Tensor
    hidden: torch.Tensor


def _read_together(rows: Mapping[str, torch.Tensor]) -> dict[str, list[int]]:
    """`rows` (1-D device tensors, by key) as lists on the host, copied in one transfer (one
    wait on the device, not one per row)."""
    if not rows:
        return {}
    flat = torch.cat(list(rows.values())).tolist()
    lists, start = {}, 0
    for key, row in rows.items():
        lists[key] = flat[start : start + row.shape[0]]
        start += row.shape[0]
    return lists


class MtpDrafter:
    """The head's passes over a step (module docstring). Request state slot s owns scratch
    blocks first_scratch_block + s * blocks_per_slot .. + blocks_per_slot - 1. graphs: the
    CUDA graphs of the draft depths (engine/speculative/draft_graphs.py), which propose
    replays when they accept the step's starts; None: every depth eagerly."""

    def __init__(
        self, model, head: MultiTokenPredictionHead, caches: ModelCaches, eager: EagerPass,
        first_scratch_block: int, num_speculative_tokens: int, graphs: DraftGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.head = head
        self.caches = caches
        self.eager = eager  # builds the head's batches: positions, KV slots, pending tokens fed
        self.graphs = graphs
        self.first_scratch_block = first_scratch_block
        self.num_drafts = num_speculative_tokens
        self.blocks_per_slot = self.scratch_blocks_per_slot(caches.block_size, num_speculative_tokens)

    @staticmethod
    def scratch_blocks_per_slot(block_size: int, num_speculative_tokens: int) -> int:
        """Blocks that hold the partial block before a draft's first position and k draft rows."""
        return -(-(block_size - 1 + num_speculative_tokens) // block_size)

    def extend(
        self, computed: list[ScheduledChunk], forward: RouteOutput, previous: dict[str, torch.Tensor],
        sampled: SampledTokens,
    ) -> None:
        """Write the head's K/V of every position the step computed (step 1 of the module doc).
        computed: the step's chunks in forward's row order; previous: request id -> its hidden
        row before its chunk (D,), for every chunk that does not start at 0 (KeyError
        otherwise); sampled: the previous step's tokens, which a PENDING_TOKEN stands for."""
        chunks, rows = [], []
        for i, chunk in enumerate(computed):
            last = forward.last_rows[i]
            own = forward.hidden[last + 1 - len(chunk.token_ids) : last]  # h_s .. h_{e-2}
            if chunk.start_position == 0:  # position 0 has no pair
                if len(chunk.token_ids) > 1:
                    chunks.append(replace(chunk, token_ids=chunk.token_ids[1:], start_position=1))
                    rows.append(own)
            else:
                chunks.append(chunk)
                rows.append(torch.cat([previous[chunk.request_id][None], own]))
        if chunks:
            self._run(self.eager.batch(chunks, sampled), torch.cat(rows))

    @staticmethod
    def rows_before(
        computed: list[ScheduledChunk], restored: Mapping[str, RowRef], last: Mapping[str, RowRef],
    ) -> dict[str, torch.Tensor]:
        """extend's `previous`: the hidden row (D,) before each computed chunk that does not
        start at 0, the one restored this step (in `restored`), else the request's last (in
        `last`, a commit's included), copied before the forward may overwrite it (h_{s-1}).
        RuntimeError for a chunk with neither."""
        rows = {}
        for chunk in computed:
            if chunk.start_position:
                ref = restored.get(chunk.request_id) or last.get(chunk.request_id)
                if ref is None:
                    raise RuntimeError(f"{chunk.request_id}: no hidden row before position {chunk.start_position}")
                rows[chunk.request_id] = ref.kept().row()
        return rows

    @staticmethod
    def starts(
        chunks: Sequence[ScheduledChunk], computed: list[ScheduledChunk], forward: RouteOutput | None,
        last_hidden: Mapping[str, RowRef], tokens: torch.Tensor, sampled_rows: Mapping[str, int],
        verified: Mapping[str, torch.Tensor],
    ) -> list[DraftStart]:
        """propose's starts for each of the step's `chunks` with propose_drafts: after the token
        it sampled (tokens (n,): the step's, row sampled_rows[request id]; the hidden row before
        it last_hidden's), or after a verification chunk's bonus token (verified: its argmax at
        each position (k + 1,), on the device), which follows the drafts the greedy rule
        accepts (the scheduler keeps those too, unless a stop ends the request; the argmax of
        all verification chunks reach the host in one copy, one wait on the device). computed:
        the step's chunks in forward's row order."""
        computed_row = {chunk.request_id: i for i, chunk in enumerate(computed)}
        drafting = [chunk for chunk in chunks if chunk.propose_drafts and chunk.sample]
        on_host = _read_together({c.request_id: verified[c.request_id] for c in drafting if c.num_draft_tokens})
        starts = []
        for chunk in drafting:
            if chunk.num_draft_tokens:
                argmax = verified[chunk.request_id]  # (k + 1,)
                accepted = greedy_accept(chunk.token_ids[1:], on_host[chunk.request_id])
                last = forward.last_rows[computed_row[chunk.request_id]]
                hidden = forward.hidden[last + 1 - len(chunk.token_ids) + accepted]  # the bonus token's h_{e-1}
                starts.append(DraftStart(chunk, chunk.start_position + accepted + 1, argmax[accepted], hidden))
            else:
                position = chunk.start_position + len(chunk.token_ids)
                token = tokens[sampled_rows[chunk.request_id]]
                starts.append(DraftStart(chunk, position, token, last_hidden[chunk.request_id].row()))
        return starts

    def propose(self, starts: Sequence[DraftStart]) -> PendingDrafts | None:
        """num_drafts draft tokens for each start (step 2 of the module doc), one depth at a
        time for all of them, in one replay of the draft graphs where they accept the starts;
        writes only the head's layer of their scratch blocks. The drafts stay on the device
        (PendingDrafts.read takes them to the host once the step is done); None without
        starts."""
        if not starts:
            return None
        block_size = self.caches.block_size
        tables = [self.scratch_table(start, block_size) for start in starts]
        positions = [start.position for start in starts]
        tokens = torch.stack([start.token for start in starts])  # (n,)
        hidden = torch.stack([start.hidden for start in starts])  # (n, D)
        if self.graphs is not None and self.graphs.accepts(positions, tables):
            drafts = self.graphs.draft(tokens, hidden, positions, tables)
        else:
            drafts = self._draft_eagerly(starts, tables, tokens, hidden)
        return PendingDrafts(tuple(start.chunk.request_id for start in starts),
                             tuple(position + 1 for position in positions), drafts)

    def _draft_eagerly(
        self, starts: Sequence[DraftStart], tables: Sequence[tuple[int, ...]], tokens: torch.Tensor,
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """propose's depths without graphs: a batch (and on CUDA a plan) per depth. (n, k)."""
        drafts = []
        for depth in range(self.num_drafts):
            rows = [replace(start.chunk, token_ids=(0,), start_position=start.position + depth,
                            block_table=table, num_draft_tokens=0)
                    for start, table in zip(starts, tables)]
            batch = build_forward_batch(rows, self.caches.block_size, tokens.device)
            hidden = self._run(replace(batch, input_ids=tokens), hidden)  # (n, D)
            tokens = torch.argmax(self.model.compute_logits(hidden), dim=-1)  # (n,)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)

    def _run(self, batch: ForwardBatch, previous_hidden: torch.Tensor) -> torch.Tensor:
        """The head over `batch` (its rows' tokens, positions and KV slots) with the hidden rows
        before them (T, D): keys from position 1 on (first_key 1), on CUDA through the batch's
        plan (engine/models/mtp_head.py run_head). Returns h' (T, D); writes the head layer's
        K/V."""
        batch = replace(batch, chunks=tuple(replace(chunk, first_key=1) for chunk in batch.chunks))
        return run_head(self.model, self.head, self.caches, batch, previous_hidden, self.eager.plan(batch))

    def scratch_table(self, start: DraftStart, block_size: int) -> tuple[int, ...]:
        """The block table of start's draft rows: its own blocks before the one holding its
        position, then its scratch blocks, the first holding a copy of the head layer's K/V of
        the positions before start.position in that block."""
        first = self.first_scratch_block + start.chunk.state_slot * self.blocks_per_slot
        scratch = tuple(range(first, first + self.blocks_per_slot))
        full, partial = divmod(start.position, block_size)
        if partial:
            layer, source = self.head.layer_index, start.chunk.block_table[full]
            for cache in (self.caches.key_cache[layer], self.caches.value_cache[layer]):
                cache[scratch[0], :partial].copy_(cache[source, :partial])
        return start.chunk.block_table[:full] + scratch
