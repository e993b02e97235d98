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
"""

from __future__ import annotations

import dataclasses
import time

import pytest

import deployments.app
from deployments.checkpoint_index import get_index
from deployments.checkpoint_store import StoredLocator
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
