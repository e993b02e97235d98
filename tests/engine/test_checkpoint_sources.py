"""Checkpoints from a CheckpointSource (engine/checkpoints/sources.py): the scheduler asks the
sources at a request's first admission; a request whose checkpoint is being fetched waits in
the scheduler (not in its caller) while the other requests step; a fetch that arrives is
imported and restored, and the output equals the same request computed from scratch; a fetch
that fails, is rejected or runs past its deadline falls back to recompute.

The source here is a test double holding checkpoints exported from another engine; the fetches
end when the test says so. The object-store tier (deployments/cluster/tier.py) is the same
contract over Ray: tests/cluster_checkpoints/test_transfer.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from cache.checkpoint_keys import Namespace
from engine.checkpoints.import_checks import ImportRejection
from engine.checkpoints.transfer import ExportedCheckpoint
from engine.core.async_engine import AsyncLLMEngine
from engine.core.llm_engine import LLMEngine
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.request import RequestStatus
from tests.engine.conversations import render
from tests.engine.reuse_cases import GREEDY, SYSTEM, chat, run
from tests.engine.test_checkpoint_transfer import assert_exact, corrupted, export_instructions

CONFIG = dict(max_num_batched_tokens=40, max_num_seqs=8)
SECOND = chat(SYSTEM, "And the mountain, briefly please?")
OTHER = chat("You count sheep.", "How many are there tonight?")


class Fetch:
    """A CheckpointFetch that ends when `finish` is called (from any thread)."""

    verified = False

    def __init__(self, checkpoint: ExportedCheckpoint | None, deadline: float) -> None:
        self.num_tokens = len(checkpoint.header.token_ids) if checkpoint is not None else 0
        self.deadline = deadline
        self._checkpoint = checkpoint
        self._ended = threading.Event()
        self.settled: tuple[bool, int] | None = None
        self.abandoned = False

    def finish(self, checkpoint: ExportedCheckpoint | None = None, *, failed: bool = False) -> None:
        if checkpoint is not None:
            self._checkpoint = checkpoint
        if failed:
            self._checkpoint = None
        self._ended.set()

    def done(self) -> bool:
        return self._ended.is_set()

    def result(self) -> ExportedCheckpoint | None:
        assert self.done(), "result() before done()"
        return self._checkpoint

    def settle(self, accepted: bool, num_bytes: int) -> None:
        self.settled = (accepted, num_bytes)

    def abandon(self) -> None:
        self.abandoned = True


class Source:
    """A CheckpointSource holding exported checkpoints; records what it was asked."""

    def __init__(self, *held: ExportedCheckpoint, timeout_s: float = 60.0) -> None:
        self.held = list(held)
        self.timeout_s = timeout_s
        self.asked: list[tuple[Namespace, int, int]] = []  # (namespace, tokens asked, have)
        self.fetches: list[Fetch] = []

    def lookup(self, namespace, token_ids, have):
        self.asked.append((namespace, len(token_ids), have))
        covering = [c for c in self.held if c.header.namespace == namespace
                    and tuple(token_ids[: len(c.header.token_ids)]) == c.header.token_ids
                    and len(c.header.token_ids) > have]
        if not covering:
            return None
        fetch = Fetch(max(covering, key=lambda c: len(c.header.token_ids)), time.monotonic() + self.timeout_s)
        self.fetches.append(fetch)
        return fetch


@pytest.fixture(scope="module")
def exporter() -> LLMEngine:
    return LLMEngine(EngineConfig(**CONFIG))


@pytest.fixture
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(**CONFIG))


def add(engine: LLMEngine, request_id: str, conversation, salt: str) -> None:
    prompt = render(engine.tokenizer, conversation)
    engine.add_request(GenerationRequest(request_id, prompt, GREEDY, cache_salt=salt))


def drain(engine: LLMEngine, outputs: dict[str, list[int]], cached: dict[str, int], *,
          until=lambda: False, max_steps: int = 10_000) -> None:
    """Step until nothing is unfinished or `until()`, collecting each request's tokens."""
    for _ in range(max_steps):
        if until() or not engine.has_unfinished_requests():
            return
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
    raise AssertionError("the engine did not finish")


def test_a_request_waits_in_the_scheduler_while_its_checkpoint_is_fetched_then_restores_it(exporter, engine):
    first, exported = export_instructions(exporter, "fetched")
    source = Source(exported)
    engine.add_checkpoint_source(source)
    add(engine, "fetching", SECOND, "fetched")
    add(engine, "other", OTHER, "elsewhere")
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}

    # the other request, behind it in the queue, runs to its end while the fetch is pending
    drain(engine, outputs, cached, until=lambda: "other" not in engine.scheduler.requests)
    waiting = engine.scheduler.requests["fetching"]
    assert waiting.status is RequestStatus.FETCHING and "fetching" in engine.scheduler.waits.pending
    assert waiting not in engine.scheduler.running and waiting not in engine.scheduler.waiting
    assert len(outputs["other"]) == GREEDY.max_tokens and "fetching" not in outputs
    asked_namespace, asked_tokens, have = source.asked[0]
    assert asked_namespace == Namespace.of(engine.config.model_dir, "fetched")
    assert (asked_tokens, have) == (len(render(engine.tokenizer, SECOND)), 0)
    drain(engine, outputs, cached, until=engine.only_fetching, max_steps=5)  # its response capture
    assert engine.only_fetching() and not engine.step()  # a step now only looks at the fetch

    (fetch,) = source.fetches
    fetch.finish()
    drain(engine, outputs, cached)
    assert fetch.settled == (True, exported.nbytes) and not fetch.abandoned
    assert cached["fetching"] == first.boundary
    stats = engine.stats().scheduler
    assert (stats.fetches_started, stats.fetches_restored) == (1, 1)
    scratch = run(engine, "scratch", SECOND, "fetched-scratch")
    assert scratch.cached == 0 and outputs["fetching"] == scratch.tokens
    # the request left its own prompt checkpoint: the same request again restores all of it
    # here, and the source, asked with that, has nothing longer
    served = run(engine, "served-again", SECOND, "fetched")
    assert served.cached == len(served.prompt) and source.asked[-1][2] == len(served.prompt)
    assert len(source.fetches) == 1
    assert_exact(served, scratch, "restored after a fetch")
    assert engine.pool_usage().idle


def test_a_fetch_past_its_deadline_falls_back_to_recompute(exporter, engine):
    _, exported = export_instructions(exporter, "late")
    source = Source(exported, timeout_s=0.05)  # never finished
    engine.add_checkpoint_source(source)
    late = run(engine, "late", SECOND, "late")
    (fetch,) = source.fetches
    assert fetch.abandoned and fetch.settled is None
    assert late.cached == 0
    scratch = run(engine, "scratch", SECOND, "late-scratch")
    assert_exact(late, scratch, "recomputed after a late fetch")
    stats = engine.stats().scheduler
    assert (stats.fetches_started, stats.fetches_restored) == (1, 0)
    assert engine.pool_usage().idle


@pytest.mark.parametrize("outcome", ["failed", "rejected"])
def test_a_failed_or_rejected_fetch_recomputes(exporter, engine, outcome):
    _, exported = export_instructions(exporter, f"bad-{outcome}")
    source = Source(exported)
    engine.add_checkpoint_source(source)
    add(engine, "bad", SECOND, f"bad-{outcome}")
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    drain(engine, outputs, cached, until=lambda: bool(source.fetches))
    (fetch,) = source.fetches
    if outcome == "failed":
        fetch.finish(failed=True)
    else:
        fetch.finish(corrupted(exported))
    drain(engine, outputs, cached)
    assert cached["bad"] == 0
    assert fetch.settled == (None if outcome == "failed" else (False, 0))
    scratch = run(engine, "scratch", SECOND, f"bad-{outcome}-scratch")
    assert outputs["bad"] == scratch.tokens
    assert engine.stats().transfers.rejected == ({} if outcome == "failed" else {ImportRejection.CHECKSUM.value: 1})


def test_an_aborted_request_abandons_its_fetch(exporter, engine):
    _, exported = export_instructions(exporter, "aborted")
    source = Source(exported)
    engine.add_checkpoint_source(source)
    add(engine, "aborted", SECOND, "aborted")
    drain(engine, {}, {}, until=lambda: bool(source.fetches))
    engine.abort_request("aborted")
    (fetch,) = source.fetches
    assert fetch.abandoned and not engine.scheduler.waits.pending
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("aborted", "abort")]
    drain(engine, {}, {}, max_steps=3)
    fetch.finish()  # arriving after the abort changes nothing
    engine.step()
    assert fetch.settled is None and engine.pool_usage().idle


def test_a_source_is_not_asked_when_checkpoints_are_off(exporter):
    _, exported = export_instructions(exporter, "off")
    engine = LLMEngine(EngineConfig(**CONFIG, checkpoint_slots=()))
    source = Source(exported)
    engine.add_checkpoint_source(source)
    run(engine, "off", SECOND, "off")
    assert source.asked == []


def test_the_async_engine_waits_for_a_fetch_on_its_step_thread(exporter):
    first, exported = export_instructions(exporter, "async-fetched")
    source = Source(exported)
    engine = LLMEngine(EngineConfig(**CONFIG))
    prompt = render(engine.tokenizer, SECOND)

    async def main() -> tuple[list[int], int]:
        async_engine = AsyncLLMEngine(engine)
        try:
            await async_engine.add_checkpoint_source(source)
            loop = asyncio.get_running_loop()
            # the fetch ends from another thread a little after the request was asked for it
            loop.run_in_executor(None, lambda: (_wait_for(lambda: source.fetches), time.sleep(0.2),
                                                source.fetches[0].finish()))
            tokens, cached = [], 0
            async for out in async_engine.generate(
                    GenerationRequest("async", prompt, GREEDY, cache_salt="async-fetched")):
                tokens += out.new_token_ids
                cached = out.num_cached_tokens
            return tokens, cached
        finally:
            async_engine.shutdown()

    tokens, cached = asyncio.run(main())
    assert cached == first.boundary and source.fetches[0].settled == (True, exported.nbytes)
    assert tokens == run(exporter, "async-reference", SECOND, "async-fetched-scratch").tokens


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.005)


def test_a_checkpoint_is_not_fetched_twice_for_one_request(exporter, engine):
    """A request back from its fetch is admitted on what it brought: no source is asked again."""
    _, exported = export_instructions(exporter, "once")
    source = Source(dataclasses.replace(exported))
    engine.add_checkpoint_source(source)
    add(engine, "once", SECOND, "once")
    drain(engine, {}, {}, until=lambda: bool(source.fetches))
    source.fetches[0].finish()
    drain(engine, {}, {})
    assert len(source.asked) == 1
