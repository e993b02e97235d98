"""The object-store tier end to end (issue 20: transfer, survival, warm start).

One app of the session's Serve instance: TRANSFER_APP, checkpoint_transfer on, checkpoint
routing off (Serve's power-of-two router spreads requests at random), fetching whenever a
stored copy saves a token (fetch_min_tokens_per_mib 0: the cost decision is unit-tested in
tests/unit/test_checkpoint_tier.py). It starts with one LLM server replica and is scaled to
two by redeploying (the warm-start test), then serves the transfer and survival tests.

Which replica served a request: Serve offers no way to pin a request to a replica, so these
tests never pin. They rely on what only one replica can produce: a replica that never saw a
namespace (a fresh cache_salt) can answer a request of it with cached tokens only by importing
a stored copy; its own capture would show cached_tokens 0 in that response. So "every
response cached the instruction, and the index lists a second holder" proves the second
replica restored the copy. Per-replica counters come from LLMServer.replica_stats, asked until
every replica has answered. References are the same requests under fresh salts (from scratch,
cached_tokens 0), greedy.

The last test runs no Serve app: two engines over private tp=2 rank groups and an index actor
of their own, to see each rank's shard go rank -> object store -> rank by reference, never
through the replica's process (here, the test process), and a bad rank-1 shard rejected.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

import deployments.app
from deployments.cluster.index import get_index
from deployments.cluster.object_copies import StoredLocator
from tests.cluster_checkpoints.test_routing import INSTRUCTIONS, SMALL, wait_for
from tests.e2e.in_flight import until_it_answers
from tests.e2e.serve_fixtures import E2E_CONFIG, MODEL_NAME

pytestmark = pytest.mark.e2e

TRANSFER_APP, TRANSFER_PREFIX = "hybrid-serve-checkpoint-transfer", "/checkpoint-transfer"
TRANSFER = dict(checkpoint_transfer=True, fetch_min_tokens_per_mib=0.0, fetch_min_tokens=1)
MAX_TRIES = 14  # requests until the other replica serves one (each lands there with p ~ 1/2)
NAMESPACE_DIR = E2E_CONFIG.engine.model_dir


def chat(client, system: str, user: str, salt: str):
    response = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        extra_body={"ignore_eos": True, "cache_salt": salt})
    return response.choices[0].message.content, response.usage.prompt_tokens_details.cached_tokens


def instruction_ids(tokenizer, system: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "system", "content": system}],
                                         add_generation_prompt=False, tokenize=True,
                                         return_dict=False)


def records(salt: str, ids: list[int]):
    import ray

    return ray.get(get_index(TRANSFER_APP).records_covering.remote((NAMESPACE_DIR, salt), ids),
                   timeout=30)


def stored_record(salt: str, ids: list[int]):
    """The index record of the instruction's stored copy, once there is one."""
    return wait_for(lambda: next((r for r in records(salt, ids) if r.stored_copy), None), 15,
                    "the instruction checkpoint was never stored")


def holders(salt: str, ids: list[int]) -> set[str]:
    return {r.replica_id for r in records(salt, ids) if r.on_replica}


def replica_stats(expected: int) -> dict:
    """{replica id: ReplicaStats} of `expected` live replicas (asked until all answered)."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", TRANSFER_APP)
    seen: dict = {}
    deadline = time.monotonic() + 30
    while len(seen) < expected:
        assert time.monotonic() < deadline, f"only {len(seen)} replicas answered"
        stats = handle.replica_stats.remote().result(timeout_s=30)
        seen[stats.replica_id] = stats
    return seen


@pytest.fixture(scope="module")
def scaled(deploy_variant, new_salt, tokenizer):
    """Deploy with one replica, capture an instruction there (and hit it), then scale to two:
    what each replica did by then."""
    from ray import serve

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deployments.app, "LLMServer", deployments.app.LLMServer.options(num_replicas=1))
        client = deploy_variant(TRANSFER_APP, TRANSFER_PREFIX, **SMALL, **TRANSFER)
    salt, system = new_salt(), INSTRUCTIONS[0]
    for n in range(3):  # captured, then hit twice: hot
        chat(client, system, f"before scaling {n}", salt)
    ids = instruction_ids(tokenizer, system)
    stored_record(salt, ids)
    (first,) = replica_stats(1)
    config = E2E_CONFIG.model_copy(update={**SMALL, **TRANSFER})
    started = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deployments.app, "LLMServer", deployments.app.LLMServer.options(num_replicas=2))
        serve.run(deployments.app.build_app(config.model_dump()), name=TRANSFER_APP,
                  route_prefix=TRANSFER_PREFIX)
    print(f"scaled to 2 replicas in {time.monotonic() - started:.1f} s")
    return dict(client=client, salt=salt, system=system, ids=ids, first=first)


def test_a_new_replica_starts_warm(scaled, new_salt):
    client, salt, system, ids = (scaled[k] for k in ("client", "salt", "system", "ids"))
    stats = replica_stats(2)
    # Serve may replace the first replica too while it rolls the new version out: every
    # replica started by the redeploy must have started warm and served nothing yet
    started = set(stats) - {scaled["first"]}
    assert started
    for replica in started:
        assert stats[replica].tier.warm_imported >= 1
        assert stats[replica].engine.scheduler.prompt_tokens_restored == 0
        assert stats[replica].engine.scheduler.prompt_tokens_computed == 0
    for n in range(MAX_TRIES):
        user = f"after scaling {n}"
        text, cached = chat(client, system, user, salt)
        assert cached == len(ids), f"request {n} was not a hit"
        assert text == chat(client, system, user, new_salt())[0]
        # the reference ran too: the new replica served the hit once it restored (no fetch)
        served = [r for r in started
                  if replica_stats(2)[r].engine.scheduler.prompt_tokens_restored >= len(ids)]
        if served:
            new, now = served[0], replica_stats(2)[served[0]]
            break
    else:
        pytest.fail("the new replica never served a request")
    assert now.tier.fetched == 0, "the hit came from a fetch, not from the warm start"
    print(f"new replica {new}: warm imported {now.tier.warm_imported}, first request restored "
          f"{len(ids)} tokens, import {now.tier.import_seconds * 1000:.1f} ms in all")


def test_a_checkpoint_captured_on_one_replica_is_restored_on_the_other(scaled, new_salt, tokenizer):
    client, system = scaled["client"], INSTRUCTIONS[1]
    ids, salt = instruction_ids(tokenizer, system), new_salt()
    text, cached = chat(client, system, "first", salt)
    assert cached == 0
    captured = stored_record(salt, ids)
    for n in range(MAX_TRIES):
        user = f"question {n}"
        text, cached = chat(client, system, user, salt)
        reference, ref_cached = chat(client, system, user, new_salt())
        assert ref_cached == 0 and cached == len(ids) and text == reference
        if len(holders(salt, ids)) == 2:
            break
    else:
        wait_for(lambda: len(holders(salt, ids)) == 2, 5, "no second replica served a request")
    stats = replica_stats(2)
    (other,) = set(stats) - {captured.replica_id}
    tier = stats[other].tier
    assert tier.fetched >= 1 and stats[other].engine.transfers.imported >= 1
    print(f"moved {captured.stored_copy.num_bytes} bytes ({len(ids)} tokens) from "
          f"{captured.replica_id} to {other}: fetch {tier.fetch_seconds * 1000:.1f} ms, import "
          f"{tier.import_seconds * 1000:.1f} ms (all its fetches)")


def _bad_copy(kind: str, header, shards, other_header):
    if kind == "corrupted":
        shard = shards[0]
        return header, [dataclasses.replace(shard, ssm_state=shard.ssm_state + 1.0)]
    if kind == "truncated":
        shard = shards[0]
        return header, [dataclasses.replace(shard, kv=shard.kv[:, :, :-1].clone())]
    return other_header, shards  # mismatched: another checkpoint's header


@pytest.mark.parametrize("kind", ["corrupted", "truncated", "mismatched"])
def test_a_bad_stored_copy_is_rejected_and_the_request_recomputes(scaled, new_salt, tokenizer, kind):
    import ray

    client, system = scaled["client"], INSTRUCTIONS[2]
    ids, salt = instruction_ids(tokenizer, system), new_salt()
    chat(client, system, "first", salt)
    good = stored_record(salt, ids)
    locator: StoredLocator = good.stored_copy.locator
    header, shards = ray.get(locator.header, timeout=30), ray.get(list(locator.shards), timeout=30)
    other = stored_record(scaled["salt"], scaled["ids"]).stored_copy.locator
    bad_header, bad_shards = _bad_copy(kind, header, shards, ray.get(other.header, timeout=30))
    index = get_index(TRANSFER_APP)
    assert ray.get(index.store_copy.remote(good.key, good.stored_copy.num_bytes, bad_header,
                                           *bad_shards), timeout=30)
    time.sleep(0.3)  # noqa: the replicas' mirrors long-poll: a woken poll answers in ms
    rejected_before = sum(sum(s.engine.transfers.rejected.values()) for s in replica_stats(2).values())
    for n in range(MAX_TRIES):
        user = f"bad copy {n}"
        text, cached = chat(client, system, user, salt)
        assert text == chat(client, system, user, new_salt())[0]
        if cached == 0:  # the replica without the checkpoint: it rejected the copy, recomputed
            break
        assert cached == len(ids)  # the capturing replica, restoring its own
    else:
        pytest.fail("no request reached the other replica")
    stats = replica_stats(2)
    reasons = {r: c for s in stats.values() for r, c in s.engine.transfers.rejected.items()}
    assert sum(sum(s.engine.transfers.rejected.values()) for s in stats.values()) == rejected_before + 1
    print(f"{kind} copy rejected: {reasons}; the request recomputed with the right answer")


def test_a_stored_copy_outlives_the_replica_that_captured_it(scaled, new_salt, tokenizer):
    import ray

    client, system = scaled["client"], INSTRUCTIONS[3]
    ids, salt = instruction_ids(tokenizer, system), new_salt()
    chat(client, system, "first", salt)
    captured = stored_record(salt, ids)
    victim = f"SERVE_REPLICA::{TRANSFER_APP}#LLMServer#{captured.replica_id}"
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    answers = []

    def hit() -> None:
        answers.append(chat(client, system, "after the kill", salt))

    until_it_answers(hit, 60)
    text, cached = answers[-1]
    reference, _ = chat(client, system, "after the kill", new_salt())
    assert cached == len(ids) and text == reference
    assert captured.replica_id not in replica_stats(2)


# ---------------------------------------------------------------- tensor_parallel_size 2, rank by rank

TP2_CONFIG = dict(max_num_batched_tokens=40, max_num_seqs=4, kv_cache_bytes=8 * 1024 * 1024,
                  state_cache_bytes=8 * 1024 * 1024, tensor_parallel_size=2)


@pytest.fixture
def shards_seen_here(monkeypatch):
    """How many CheckpointShards this process (the replica's side: engine, executor, store
    and fetch code) has unpickled: a shard whose bytes came through it."""
    from engine.checkpoints.transfer import CheckpointShard

    seen = []

    def counting_setstate(self, state):
        seen.append(state.get("rank"))
        self.__dict__.update(state)

    monkeypatch.setattr(CheckpointShard, "__setstate__", counting_setstate, raising=False)
    return seen


@pytest.mark.timeout(600)
def test_tp2_shards_go_from_rank_to_object_store_to_rank_never_through_the_replica(
        ray_session, shards_seen_here):
    """Replica A's two ranks each put their shard; the index actor stores its own copies
    (resolved from the ranks' objects); A goes; replica B's ranks each resolve and check their
    own stored shard and B serves as from scratch. A stored copy with a corrupted rank-1 shard
    is rejected by rank 1 with nothing published, and the request recomputes correctly. This
    process (the replica's code: engine, RayWorkerExecutor, store and fetch) handles
    references only. Shards by value still import into a Ray rank group (rank 0 scatters).
    Engines with private rank groups, no Serve: two groups start in ~20-40 s on 2 cores."""
    import asyncio

    import ray

    from cache.index_messages import CheckpointRecord, ReplicaReport, token_digest
    from deployments.cluster.index import get_or_create_index
    from deployments.cluster.object_copies import fetch_stored, store_exported
    from deployments.worker_group import RayWorkerExecutor, WorkerGroup
    from engine.checkpoints.import_checks import ImportRejection
    from engine.checkpoints.transfer import RemoteShard
    from engine.engine_config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from tests.engine.reuse_cases import SYSTEM, chat, run
    from tests.engine.test_checkpoint_transfer import snapshot

    config = EngineConfig(**TP2_CONFIG)
    first_turn, second_turn = chat(SYSTEM, "Tell me about the river."), chat(SYSTEM, "And the mountain?")
    index = get_or_create_index("hybrid-serve-tp2-transfer-test", store_budget_bytes=64 * 1024 * 1024)

    async def start_both():
        return await asyncio.gather(*(WorkerGroup.start(config, num_cpus_per_rank=0.2) for _ in "ab"))

    started = time.monotonic()
    group_a, group_b = asyncio.run(start_both())
    print(f"two tp=2 rank groups started in {time.monotonic() - started:.1f} s")
    covered: dict[str, tuple[int, ...]] = {}
    try:
        try:
            a = LLMEngine(config, executor=RayWorkerExecutor(group_a.ranks))
            records, exports = [], []
            for salt in ("tp2-moved", "tp2-corrupt", "tp2-by-value"):
                first = run(a, f"{salt}-first", first_turn, salt)
                covered[salt] = tokens = tuple(first.prompt[: first.boundary])
                started = time.monotonic()
                exported = a.export_checkpoint((config.model_dir, salt), tokens)
                exports.append((exported, time.monotonic() - started))
                assert exported.by_reference and [s.rank for s in exported.shards] == [0, 1]
                assert all(isinstance(s.ref, ray.ObjectRef) for s in exported.shards)
                bundle = a.scheduler.cache.ledger.published_at((config.model_dir, salt), tokens)
                records.append(CheckpointRecord((config.model_dir, salt), token_digest(tokens), len(tokens),
                                                "instruction", exported.nbytes, "replica-a", bundle.bundle_id))
            incarnation = ray.get(index.incarnation.remote(), timeout=30)
            report = ReplicaReport("replica-a", incarnation, tuple(records), full=True)
            assert ray.get(index.report.remote(report), timeout=30).accepted
            for record, (exported, export_s) in zip(records, exports):
                started = time.monotonic()
                assert asyncio.run(store_exported(index, record.key, exported))
                print(f"{record.namespace[1]}: {record.length} tokens, rank shards "
                      f"{[s.nbytes for s in exported.shards]} bytes; export {export_s * 1000:.1f} ms, "
                      f"store {(time.monotonic() - started) * 1000:.1f} ms")
            del exported, exports
        finally:
            group_a.shutdown()  # the stored copies are the index's: they outlive replica A

        b = LLMEngine(config, executor=RayWorkerExecutor(group_b.ranks))
        stored = {}
        for salt, tokens in covered.items():
            found = ray.get(index.records_covering.remote((config.model_dir, salt), list(tokens)), timeout=30)
            (stored[salt],) = [r.stored_copy.locator for r in found if r.stored_copy is not None]

        # rank 1's stored shard corrupted (in a task: this process never holds it)
        locator = stored["tp2-corrupt"]
        fetched = asyncio.run(fetch_stored(locator, 30, by_reference=True))
        assert all(isinstance(s, RemoteShard) for s in fetched.shards)
        def corrupt_ssm(shard):  # nested: pickled by value, the worker cannot import this module
            ssm = shard.ssm_state.clone()
            ssm[0, 0, 0, 0] += 1e-3
            return dataclasses.replace(shard, ssm_state=ssm)  # its checksum kept

        bad_rank1 = ray.remote(num_cpus=0)(corrupt_ssm).remote(locator.shards[1])
        bad = dataclasses.replace(fetched, shards=(fetched.shards[0], RemoteShard(1, 0, bad_rank1)))
        before = snapshot(b)
        rejected = b.import_checkpoint(bad)
        assert rejected.rejection is ImportRejection.CHECKSUM and "rank 1" in rejected.detail
        assert snapshot(b) == before
        served_bad = run(b, "bad-served", second_turn, "tp2-corrupt")
        scratch = run(b, "scratch", second_turn, "tp2-scratch")
        assert served_bad.cached == 0 == scratch.cached and served_bad.tokens == scratch.tokens

        moved = asyncio.run(fetch_stored(stored["tp2-moved"], 30, by_reference=True))
        started = time.monotonic()
        result = b.import_checkpoint(moved)
        import_s = time.monotonic() - started
        assert result.accepted and result.num_bytes == moved.nbytes > 0
        served = run(b, "served", second_turn, "tp2-moved")
        assert served.cached == len(covered["tp2-moved"]) and served.tokens == scratch.tokens
        assert b.stats().transfers.rejected == {"checksum": 1} and b.pool_usage().idle
        print(f"imported rank by rank in {import_s * 1000:.1f} ms ({result.num_bytes} bytes)")
        assert shards_seen_here == [], "shard bytes came through the replica's process"
        ray.get(locator.shards[1], timeout=30)  # and the counter does see one that does
        assert shards_seen_here == [1]

        # shards by value (what a tp=1 replica fetches) still import: rank 0 scatters them
        by_value = asyncio.run(fetch_stored(stored["tp2-by-value"], 30))
        assert not by_value.by_reference and [s.rank for s in by_value.shards] == [0, 1]
        assert b.import_checkpoint(by_value).accepted
        assert run(b, "by-value", second_turn, "tp2-by-value").tokens == scratch.tokens
    finally:
        group_b.shutdown()
        ray.kill(index, no_restart=True)
