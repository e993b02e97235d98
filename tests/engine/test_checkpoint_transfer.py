"""Moving a checkpoint between engines (issue 20, engine side; docs/design.md section 5.1).

Engine A serves a request whose instructions it checkpoints; the checkpoint is exported and
imported into engine B, where a new request sharing the instructions restores it and produces
what B computes from scratch. A corrupted, truncated or mismatched checkpoint is rejected,
counted by reason, leaves B unchanged, and B then computes the request from scratch with the
right answer. The same at tensor_parallel_size 2 (one spawned process per rank, gloo on CPU).
Shards by reference (what Ray rank actors export and import) go through the same checks in
two phases, each rank checking its own before any rank writes: here with a dict standing in
for the object store; through Ray at tp=2 in tests/cluster_checkpoints/test_transfer.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

import pytest
import torch

from engine.core.async_engine import AsyncLLMEngine
from engine.checkpoints.import_checks import ImportRejection, check_exported
from engine.checkpoints.shards import ShardStage
from engine.checkpoints.transfer import ExportedCheckpoint, RemoteShard, make_shard
from engine.engine_config import EngineConfig
from engine.execution.executor import ShardsByReference
from engine.interfaces.generation_request import GenerationRequest
from engine.core.llm_engine import LLMEngine
from engine.execution.worker import Worker
from tests.engine.exactness import Outcome, Tally, check_near_ties, compare
from tests.engine.reuse_cases import GREEDY, SYSTEM, Alone, chat, run

CONFIG = dict(max_num_batched_tokens=40, max_num_seqs=8)
FIRST = chat(SYSTEM, "Tell me about the river.")
SECOND = chat(SYSTEM, "And the mountain, briefly please?")


@pytest.fixture(scope="module")
def source() -> LLMEngine:
    return LLMEngine(EngineConfig(**CONFIG))


@pytest.fixture(scope="module")
def target() -> LLMEngine:
    return LLMEngine(EngineConfig(**CONFIG))


def export_instructions(engine: LLMEngine, salt: str) -> tuple[Alone, ExportedCheckpoint]:
    """Serve FIRST in namespace `salt` on `engine` and export its instruction checkpoint."""
    first = run(engine, f"{salt}-first", FIRST, salt)
    assert first.boundary is not None
    exported = engine.export_checkpoint((engine.config.model_dir, salt), first.prompt[: first.boundary])
    assert exported is not None
    return first, exported


def assert_exact(served: Alone, scratch: Alone, label: str) -> None:
    """Greedy tokens identical, logits within LOGITS_RTOL (tests/engine/exactness.py)."""
    tally = Tally()
    compare(Outcome(served.tokens, served.logits, served.text, served.cached),
            Outcome(scratch.tokens, scratch.logits, scratch.text, scratch.cached), tally, label)
    check_near_ties(tally, label)


def snapshot(engine: LLMEngine) -> tuple:
    """What an import must not change when it is rejected."""
    ledger = engine.scheduler.cache.ledger
    return engine.pool_usage(), ledger.bytes_held, len(ledger), len(engine.checkpoint_events)


def served_and_scratch(engine: LLMEngine, salt: str) -> tuple[Alone, Alone]:
    """SECOND in namespace `salt`, then again in a namespace of its own (from scratch)."""
    served = run(engine, f"{salt}-second", SECOND, salt)
    scratch = run(engine, f"{salt}-scratch", SECOND, f"{salt}-scratch")
    assert scratch.cached == 0
    return served, scratch


# ---------------------------------------------------------------- a checkpoint moves and serves


def test_an_imported_instruction_checkpoint_serves_like_a_local_one(source, target):
    first, exported = export_instructions(source, "moved")
    header = exported.header
    boundary = first.boundary
    assert (header.kind, header.token_ids, header.namespace) == (
        "instruction", tuple(first.prompt[:boundary]), (source.config.model_dir, "moved"))
    assert header.tensor_parallel_size == 1 and len(exported.shards) == 1
    shard = exported.shards[0]
    assert shard.kv.shape[2] == boundary and boundary % header.block_size != 0  # full blocks and a tail
    assert pickle.loads(pickle.dumps(exported)).shards[0].checksum == shard.checksum
    assert source.stats().transfers.exported == 1
    assert source.stats().transfers.exported_bytes == exported.nbytes

    target.record_checkpoint_events()
    result = target.import_checkpoint(exported)
    assert result.accepted and not result.deduplicated and result.rejection is None
    assert (result.num_tokens, result.num_bytes) == (boundary, exported.nbytes)
    events = target.drain_checkpoint_events()
    assert [(e.action, e.kind, e.token_ids) for e in events] == [("published", "instruction", header.token_ids)]

    served, scratch = served_and_scratch(target, "moved")
    assert served.cached == boundary
    assert sum(served.chunk_sizes) == len(served.prompt) - boundary + len(served.tokens) - 1
    assert_exact(served, scratch, "imported instruction checkpoint")
    # and what A, restoring its own checkpoint, serves
    assert run(source, "moved-on-source", SECOND, "moved").tokens == served.tokens

    again = target.import_checkpoint(exported)
    assert again.accepted and again.deduplicated
    transfers = target.stats().transfers
    assert (transfers.imported, transfers.imported_bytes, transfers.deduplicated) == (1, exported.nbytes, 1)
    assert transfers.rejected == {}
    assert target.pool_usage().idle and source.pool_usage().idle


def test_a_whole_prompt_checkpoint_samples_without_a_forward_pass(source, target):
    """A prompt checkpoint (block-aligned or not) carries the hidden row: repeating the prompt
    on B computes nothing before its first token."""
    first = run(source, "whole-first", FIRST, "whole")
    exported = source.export_checkpoint((source.config.model_dir, "whole"), first.prompt)
    assert exported.header.kind == "prompt"
    assert target.import_checkpoint(exported).accepted
    repeat = run(target, "whole-repeat", FIRST, "whole")
    assert repeat.cached == len(first.prompt) and repeat.chunk_sizes[0] == 0
    scratch = run(target, "whole-scratch", FIRST, "whole-scratch")
    assert_exact(repeat, scratch, "imported prompt checkpoint")
    assert target.pool_usage().idle


def test_a_transfer_between_steps_changes_no_request_in_flight(source):
    """With async scheduling a step is in flight between step() calls: export and import
    collect it first, and its outputs come with the next step(), unchanged."""
    engine = LLMEngine(EngineConfig(**CONFIG, async_scheduling=True))
    assert engine.config.overlaps_steps
    alone = run(engine, "alone", chat("Be brief.", "Count to five."), "in-flight-alone")
    _, exported = export_instructions(source, "in-flight")

    prompt = alone.prompt
    engine.add_request(GenerationRequest("busy", prompt, GREEDY, cache_salt="in-flight-busy"))
    tokens = []
    for _ in range(3):
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert engine._in_flight  # a step is in flight
    assert engine.import_checkpoint(exported).accepted
    assert engine.export_checkpoint(exported.header.namespace, exported.header.token_ids) is not None
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == alone.tokens
    assert run(engine, "after", SECOND, "in-flight").cached == exported.header.num_tokens
    assert engine.pool_usage().idle


def test_exporting_what_is_not_published_gives_none(source):
    assert source.export_checkpoint((source.config.model_dir, "nothing-here"), [1, 2, 3]) is None
    first = run(source, "partial-first", FIRST, "partial")
    # a prefix of a checkpoint is not a checkpoint
    assert source.export_checkpoint((source.config.model_dir, "partial"), first.prompt[: first.boundary - 1]) is None


# ---------------------------------------------------------------- rejections


def corrupted(exported: ExportedCheckpoint) -> ExportedCheckpoint:
    shard = exported.shards[0]
    kv = shard.kv.clone()
    kv[1, 0, 3, 0, 5] += 1.0  # one value of one value vector
    return dataclasses.replace(exported, shards=(dataclasses.replace(shard, kv=kv),))


def truncated(exported: ExportedCheckpoint) -> ExportedCheckpoint:
    shard = exported.shards[0]
    return dataclasses.replace(exported, shards=(dataclasses.replace(shard, kv=shard.kv[:, :, :-3].clone()),))


def other_model(exported: ExportedCheckpoint) -> ExportedCheckpoint:
    model = dataclasses.replace(exported.header.model, config_sha256="0" * 64)
    return dataclasses.replace(exported, header=dataclasses.replace(exported.header, model=model))


def other_dtype(exported: ExportedCheckpoint) -> ExportedCheckpoint:
    model = dataclasses.replace(exported.header.model, dtype="bfloat16")
    return dataclasses.replace(exported, header=dataclasses.replace(exported.header, model=model))


def other_device(exported: ExportedCheckpoint) -> ExportedCheckpoint:
    model = dataclasses.replace(exported.header.model, device_type="cuda")
    return dataclasses.replace(exported, header=dataclasses.replace(exported.header, model=model))


def other_block_size(exported: ExportedCheckpoint) -> ExportedCheckpoint:
    return dataclasses.replace(exported, header=dataclasses.replace(exported.header, block_size=8))


def other_token_ids(exported: ExportedCheckpoint) -> ExportedCheckpoint:
    tokens = exported.header.token_ids
    changed = tokens[:-1] + ((tokens[-1] + 1) % 100,)
    return dataclasses.replace(exported, header=dataclasses.replace(exported.header, token_ids=changed))


def other_namespace(exported: ExportedCheckpoint) -> ExportedCheckpoint:
    namespace = ("/elsewhere/model", exported.header.namespace[1])
    return dataclasses.replace(exported, header=dataclasses.replace(exported.header, namespace=namespace))


def ssm_in_bfloat16(exported: ExportedCheckpoint) -> ExportedCheckpoint:
    shard = exported.shards[0]
    ssm = shard.ssm_state.to(torch.bfloat16)
    return dataclasses.replace(exported, shards=(dataclasses.replace(shard, ssm_state=ssm),))


def no_shards(exported: ExportedCheckpoint) -> ExportedCheckpoint:
    return dataclasses.replace(exported, shards=())


def fp8_kv_cache(exported: ExportedCheckpoint) -> ExportedCheckpoint:
    """The same checkpoint as an engine with an FP8 KV cache would export it: K/V bytes in
    float8_e4m3fn (scales 1.0), the header and layouts saying so, checksums recomputed."""
    header = exported.header
    layouts = tuple(dataclasses.replace(layout, kv_dtype="float8_e4m3fn") for layout in header.layouts)
    shards = tuple(make_shard(shard.rank, header.digest, shard.conv_state, shard.ssm_state,
                              shard.kv.to(torch.float8_e4m3fn), shard.hidden_row) for shard in exported.shards)
    return ExportedCheckpoint(dataclasses.replace(header, kv_cache="fp8_e4m3:0123456789abcdef", layouts=layouts),
                              shards)


REJECTIONS = {
    "corrupted": (corrupted, ImportRejection.CHECKSUM),
    "truncated": (truncated, ImportRejection.LENGTH),
    "other_model": (other_model, ImportRejection.MODEL),
    "other_dtype": (other_dtype, ImportRejection.MODEL),
    "other_device": (other_device, ImportRejection.MODEL),
    "other_block_size": (other_block_size, ImportRejection.BLOCK_SIZE),
    "other_token_ids": (other_token_ids, ImportRejection.DIGEST),
    "other_namespace": (other_namespace, ImportRejection.NAMESPACE),
    "ssm_in_bfloat16": (ssm_in_bfloat16, ImportRejection.SHAPE),
    "no_shards": (no_shards, ImportRejection.MALFORMED),
    "fp8_kv_cache": (fp8_kv_cache, ImportRejection.KV_CACHE),
}


@pytest.mark.parametrize("case", REJECTIONS)
def test_a_bad_checkpoint_is_rejected_and_the_request_computed_from_scratch(source, target, case):
    damage, reason = REJECTIONS[case]
    salt = f"reject-{case}"
    _, exported = export_instructions(source, salt)
    before = snapshot(target)
    rejected_before = target.stats().transfers.rejected.get(reason.value, 0)

    result = target.import_checkpoint(damage(exported))
    assert not result.accepted and result.rejection is reason, result.detail
    assert target.stats().transfers.rejected[reason.value] == rejected_before + 1
    assert snapshot(target) == before  # nothing held, nothing published, no event

    served, scratch = served_and_scratch(target, salt)
    assert served.cached == 0
    assert served.tokens == scratch.tokens
    assert served.tokens == run(source, f"{salt}-on-source", SECOND, salt).tokens
    assert target.pool_usage().idle


def test_not_an_exported_checkpoint_is_malformed(target):
    result = target.import_checkpoint({"header": None})
    assert result.rejection is ImportRejection.MALFORMED


@pytest.mark.parametrize("bad_token", [-1, "vocab_size", True, 5.0])
def test_token_ids_that_are_not_ids_of_the_vocabulary_are_malformed(source, target, bad_token):
    """The header's token ids are checked before anything else reads them: a negative id, one
    at the vocabulary's size, a bool and a float each make the checkpoint malformed. A header
    marked verified (the host tier's: this engine exported it, from a request whose ids it
    checked on admission) is not scanned again; its length still is."""
    _, exported = export_instructions(source, "bad-token")
    bad = target.vocab_size if bad_token == "vocab_size" else bad_token
    tokens = exported.header.token_ids[:-1] + (bad,)
    damaged = dataclasses.replace(exported, header=dataclasses.replace(exported.header, token_ids=tokens))
    rejected = check_exported(damaged, target.transfers.expected)
    assert rejected is not None and rejected.reason is ImportRejection.MALFORMED, rejected
    assert check_exported(damaged, target.transfers.expected, verified=True) is None
    too_long = tokens * (target.transfers.expected.max_model_len // len(tokens) + 1)
    overlong = dataclasses.replace(exported, header=dataclasses.replace(exported.header, token_ids=too_long))
    rejected = check_exported(overlong, target.transfers.expected, verified=True)
    assert rejected is not None and rejected.reason is ImportRejection.MALFORMED, rejected
    assert check_exported(exported, target.transfers.expected) is None  # the undamaged one passes


def test_a_checkpoint_that_does_not_fit_is_rejected_for_space(source):
    _, exported = export_instructions(source, "no-space")
    small = LLMEngine(EngineConfig(**CONFIG, checkpoint_cache_bytes=1024))
    result = small.import_checkpoint(exported)
    assert result.rejection is ImportRejection.NO_SPACE
    assert small.stats().transfers.rejected == {"no_space": 1}
    usage = small.pool_usage()
    assert usage.idle and usage.num_checkpoints == 0 and usage.free_blocks == usage.total_blocks
    off = LLMEngine(EngineConfig(**CONFIG, checkpoint_slots=()))
    assert off.import_checkpoint(exported).rejection is ImportRejection.DISABLED


def test_imported_checkpoints_are_evicted_like_local_ones(source):
    """Room for one bundle's bytes: the second import evicts the first (its blocks come back,
    the worker frees its tensors at the next step)."""
    exports = [export_instructions(source, f"evict-{i}")[1] for i in range(2)]
    per_bundle = source.scheduler.cache.ledger.published_at(
        exports[0].header.namespace, exports[0].header.token_ids).num_bytes
    engine = LLMEngine(EngineConfig(**CONFIG, checkpoint_cache_bytes=per_bundle))
    engine.record_checkpoint_events()
    assert all(engine.import_checkpoint(e).accepted for e in exports)
    events = [(e.action, e.namespace[1]) for e in engine.drain_checkpoint_events()]
    # the second import's reservation evicts the first before it publishes
    assert events == [("published", "evict-0"), ("dropped", "evict-0"), ("published", "evict-1")]
    served = run(engine, "evict-served", SECOND, "evict-1")
    assert served.cached == exports[1].header.num_tokens
    assert len(engine.executor.checkpoints) == engine.stats().num_checkpoints
    assert run(engine, "evict-gone", SECOND, "evict-0").cached == 0
    assert engine.pool_usage().idle


def test_the_async_engine_exports_and_imports_between_steps():
    source_engine = LLMEngine(EngineConfig(**CONFIG))
    first, _ = export_instructions(source_engine, "async-moved")
    tokens = tuple(first.prompt[: first.boundary])

    async def scenario():
        a = AsyncLLMEngine(source_engine)
        b = AsyncLLMEngine(LLMEngine(EngineConfig(**CONFIG)))
        try:
            exported = await a.export_checkpoint((source_engine.config.model_dir, "async-moved"), tokens)
            return exported, await b.import_checkpoint(exported), b.engine
        finally:
            a.shutdown()
            b.shutdown()

    exported, result, engine_b = asyncio.run(scenario())
    assert exported.header.token_ids == tokens and result.accepted
    assert run(engine_b, "async-served", SECOND, "async-moved").cached == len(tokens)


# ---------------------------------------------------------------- shards by reference


class DictStoreWorker(ShardsByReference, Worker):
    """The in-process Worker with its shards by reference: `store` (a dict) stands in for the
    object store, and this rank resolves, checks and holds its own shard (ShardStage), as a Ray
    rank actor does (deployments/cluster/rank_shards.py)."""

    def __init__(self, config: EngineConfig, store: dict) -> None:
        super().__init__(config)
        self.store = store
        self.stage = ShardStage(self.rank)
        self.discarded: list[int] = []

    def export_shards(self, op):
        shard = self.export_shard(op)
        if shard is None:
            return [None]
        self.store[key := f"shard-{len(self.store)}"] = shard
        return [RemoteShard(self.rank, shard.nbytes, key)]

    def stage_shards(self, op, shards):
        return [self.stage.stage(op, self.store[shards[0].ref])]

    def import_staged(self, op, transfer_id):
        shard = self.stage.take(transfer_id)
        return frozenset({self.rank}) if shard is not None and self.import_shard(op, shard) else frozenset()

    def discard_staged(self, transfer_id):
        self.discarded.append(transfer_id)
        self.stage.discard(transfer_id)


def by_reference(exported: ExportedCheckpoint, store: dict, label: str) -> ExportedCheckpoint:
    """`exported` with its shards put into `store` under `label`, as references."""
    shards = []
    for shard in exported.shards:
        store[f"{label}-{shard.rank}"] = shard
        shards.append(RemoteShard(shard.rank, shard.nbytes, f"{label}-{shard.rank}"))
    return dataclasses.replace(exported, shards=tuple(shards))


def test_shards_by_reference_are_checked_by_their_rank_before_anything_changes(source, target):
    store: dict = {}
    config = EngineConfig(**CONFIG)
    engine = LLMEngine(config, executor=DictStoreWorker(config, store))
    ranks: DictStoreWorker = engine.executor
    _, moved = export_instructions(source, "by-ref")
    _, other = export_instructions(source, "by-ref-other")

    for label, damage, reason in [("corrupted", corrupted, ImportRejection.CHECKSUM),
                                  ("truncated", truncated, ImportRejection.LENGTH),
                                  ("ssm_in_bfloat16", ssm_in_bfloat16, ImportRejection.SHAPE)]:
        before = snapshot(engine)
        result = engine.import_checkpoint(by_reference(damage(moved), store, label))
        assert result.rejection is reason, result.detail
        assert snapshot(engine) == before and ranks.stage.take(len(ranks.discarded) - 1) is None
    # another checkpoint's shard under this header: its checksum binds the other digest
    swapped = dataclasses.replace(by_reference(other, store, "other"), header=moved.header)
    assert engine.import_checkpoint(swapped).rejection is ImportRejection.CHECKSUM
    assert len(ranks.discarded) == 4
    # references into an engine whose ranks take values: nothing to resolve them with
    assert target.import_checkpoint(by_reference(moved, store, "to-values")).rejection is ImportRejection.MALFORMED

    result = engine.import_checkpoint(by_reference(moved, store, "good"))
    assert result.accepted and result.num_bytes == moved.nbytes
    assert len(ranks.discarded) == 4  # written, not discarded
    served, scratch = served_and_scratch(engine, "by-ref")
    assert served.cached == moved.header.num_tokens
    assert_exact(served, scratch, "checkpoint imported by reference")
    again = engine.import_checkpoint(by_reference(moved, store, "again"))
    assert again.deduplicated and ranks.discarded[-1] == 5 and ranks.stage.take(5) is None
    assert engine.stats().transfers.rejected == {"checksum": 2, "length": 1, "shape": 1}

    exported = engine.export_checkpoint(moved.header.namespace, moved.header.token_ids)
    assert exported.by_reference and store[exported.shards[0].ref].checksum == moved.shards[0].checksum
    assert engine.pool_usage().idle


# ---------------------------------------------------------------- tensor_parallel_size 2


@pytest.mark.timeout(600)
def test_transfer_between_tensor_parallel_engines(target):
    """tp=2 A exports one shard per rank; a tp=2 B imports them, restores and matches a
    from-scratch run (and tp=1); a corrupted rank-1 shard and a tp-size mismatch are rejected."""
    a = LLMEngine(EngineConfig(**CONFIG, tensor_parallel_size=2))
    try:
        first, exported = export_instructions(a, "tp2-moved")
        _, other = export_instructions(a, "tp2-corrupt")
        assert a.pool_usage().idle
    finally:
        a.shutdown()
    assert exported.header.tensor_parallel_size == 2 and [s.rank for s in exported.shards] == [0, 1]
    heads = [s.kv.shape[3] for s in exported.shards]
    assert heads == [1, 1]  # the tiny model's 2 KV heads, one per rank
    assert all(s.kv.shape[2] == first.boundary for s in exported.shards)
    assert exported.shards[0].checksum != exported.shards[1].checksum

    tp1_reject = target.import_checkpoint(exported)
    assert tp1_reject.rejection is ImportRejection.TENSOR_PARALLEL

    b = LLMEngine(EngineConfig(**CONFIG, tensor_parallel_size=2))
    try:
        result = b.import_checkpoint(exported)
        assert result.accepted and result.num_bytes == exported.nbytes
        served, scratch = served_and_scratch(b, "tp2-moved")
        assert served.cached == first.boundary
        assert_exact(served, scratch, "tp=2 imported instruction checkpoint")
        reference = run(target, "tp2-reference", SECOND, "tp2-reference")  # tp=1, from scratch
        assert served.tokens == reference.tokens

        shard = other.shards[1]
        ssm = shard.ssm_state.clone()
        ssm[0, 0, 0, 0] += 1e-3
        bad = dataclasses.replace(other, shards=(other.shards[0], dataclasses.replace(shard, ssm_state=ssm)))
        before = snapshot(b)
        assert b.import_checkpoint(bad).rejection is ImportRejection.CHECKSUM
        assert snapshot(b) == before
        served_bad, scratch_bad = served_and_scratch(b, "tp2-corrupt")
        assert served_bad.cached == 0 and served_bad.tokens == scratch_bad.tokens

        tp2_reject = b.import_checkpoint(export_instructions(target, "tp1-into-tp2")[1])
        assert tp2_reject.rejection is ImportRejection.TENSOR_PARALLEL
        assert b.stats().transfers.rejected == {"checksum": 1, "tensor_parallel": 1}
        assert b.pool_usage().idle
    finally:
        b.shutdown()
