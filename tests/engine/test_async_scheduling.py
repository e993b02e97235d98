"""Async scheduling (EngineConfig.async_scheduling): the engine submits step k+1 before it has
step k's tokens, each chunk that feeds such a token carrying PENDING_TOKEN, which the worker
replaces on the device with the token it sampled in step k. It must change nothing a request
produces, and a request that stops while a step is in flight checkpoints exactly the tokens
computed for it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.core.llm_engine import LLMEngine
from engine.interfaces.request import PENDING_TOKEN
from engine.interfaces.sampling_params import InvalidRequestError, SamplingParams
from engine.interfaces.step_io import RunnerOutput, ScheduledChunk, SchedulerOutput
from engine.execution.worker import Worker

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, return_logits=True)
BLOCKS = 8


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (count,), generator=generator).tolist()
    return [torch.randint(5, vocab, (n,), generator=generator).tolist() for n in lengths]


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], salt: str = ""):
    """Run to completion: id -> (token ids, text, finish reason, cached tokens)."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(GenerationRequest(request_id, prompt, params, cache_salt=salt))
    results = {rid: [[], "", None, 0] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            result = results[out.request_id]
            result[0] += out.new_token_ids
            result[1] += out.new_text
            result[3] = out.num_cached_tokens
            if out.finished:
                result[2] = out.finish_reason
    return {rid: tuple(result) for rid, result in results.items()}


class RecordingExecutor:
    """The in-process worker, recording the order of submit and collect calls and every step
    it was given."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.calls: list[str] = []
        self.steps: list[SchedulerOutput] = []

    def cache_capacity(self):
        return self.worker.cache_capacity()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self.calls.append("submit")
        self.steps.append(scheduler_output)
        self.worker.submit(scheduler_output)

    def collect(self) -> RunnerOutput:
        self.calls.append("collect")
        return self.worker.collect()

    def shutdown(self) -> None:
        pass


def test_async_and_sync_scheduling_produce_the_same_requests():
    sync = LLMEngine(EngineConfig(max_num_batched_tokens=40, max_num_seqs=4, async_scheduling=False))
    prompts = _prompts(7, sync.vocab_size, seed=3)
    first = _run(sync, {"probe": (prompts[0], GREEDY)})["probe"][0]
    kinds = [
        GREEDY,
        SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=11),
        SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=5),
        dataclasses.replace(GREEDY, stop_token_ids=(first[3],)),  # stops on its 4th token
        dataclasses.replace(GREEDY, min_tokens=6, stop_token_ids=(first[1],)),
        SamplingParams(max_tokens=1, temperature=0),
        dataclasses.replace(GREEDY, max_tokens=14),
    ]
    requests = {f"q{i}": (prompt, params) for i, (prompt, params) in enumerate(zip(prompts, kinds))}
    requests["q3"] = (prompts[0], kinds[3])
    expected = _run(sync, requests, salt="sync")
    async_engine = LLMEngine(EngineConfig(max_num_batched_tokens=40, max_num_seqs=4, async_scheduling=True))
    assert async_engine.config.overlaps_steps
    got = _run(async_engine, requests, salt="async")
    for request_id in requests:
        assert got[request_id][:3] == expected[request_id][:3], request_id
    assert expected["q3"][0] == first[:4] and expected["q3"][2] == "stop"
    assert async_engine.pool_usage().idle


def test_the_next_step_is_submitted_before_the_step_in_flight_is_collected():
    executor = RecordingExecutor(EngineConfig(max_num_seqs=2, async_scheduling=True))
    engine = LLMEngine(EngineConfig(max_num_seqs=2, async_scheduling=True), executor=executor)
    prompts = _prompts(2, engine.vocab_size, seed=4)
    results = _run(engine, {f"p{i}": (p, GREEDY) for i, p in enumerate(prompts)})
    assert all(len(tokens) == GREEDY.max_tokens for tokens, *_ in results.values())
    # submit, then (submit, collect) pairs while requests run, then the last collect
    assert executor.calls[:3] == ["submit", "submit", "collect"]
    assert executor.calls.count("submit") == executor.calls.count("collect")
    in_flight = 0
    for call in executor.calls:
        in_flight += 1 if call == "submit" else -1
        assert 0 <= in_flight <= 2
    # every decode step after the first feeds each request the token of the step before, pending
    decode_steps = [s for s in executor.steps if s.chunks and all(len(c.token_ids) == 1 for c in s.chunks)]
    assert len(decode_steps) >= GREEDY.max_tokens - 2
    assert all(c.token_ids == (PENDING_TOKEN,) for s in decode_steps[1:] for c in s.chunks)


def _chunk(request: int, tokens, start: int, sampling=SamplingParams(temperature=0)) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=f"r{request}", token_ids=tuple(tokens), start_position=start,
        block_table=tuple(range(request * BLOCKS, (request + 1) * BLOCKS)), state_slot=request,
        reset_state=start == 0, sample=True, sampling=sampling,
    )


def test_the_worker_feeds_a_pending_token_as_if_it_were_known():
    """Two workers run the same requests: one is given every token, the other submits each
    step before collecting the one before and is given PENDING_TOKEN instead; a preempted
    request comes back with a prefill chunk that ends with its pending token. Same tokens,
    same logits."""
    config = EngineConfig(max_num_seqs=4)
    known, pipelined = Worker(config), Worker(config)
    prompts = _prompts(3, 200, seed=5)
    drawn = SamplingParams(temperature=1.0, seed=3, return_logits=True)
    params = [SamplingParams(temperature=0, return_logits=True), drawn, SamplingParams(temperature=0, return_logits=True)]
    history = {r: list(p) for r, p in enumerate(prompts)}

    first = SchedulerOutput(tuple(_chunk(r, history[r], 0, params[r]) for r in range(3)))
    expected = known.execute(first)
    pipelined.submit(first)
    outputs = []
    for step in range(4):
        for r in range(3):
            history[r].append(expected.sampled_token_ids[f"r{r}"])
        if step == 2:  # r0 re-admitted from scratch: its prefill chunk ends with the pending token
            chunks = [_chunk(0, history[0], 0, params[0])]
            pending = [_chunk(0, history[0][:-1] + [PENDING_TOKEN], 0, params[0])]
        else:
            chunks = [_chunk(0, history[0][-1:], len(history[0]) - 1, params[0])]
            pending = [_chunk(0, (PENDING_TOKEN,), len(history[0]) - 1, params[0])]
        chunks += [_chunk(r, history[r][-1:], len(history[r]) - 1, params[r]) for r in (1, 2)]
        pending += [_chunk(r, (PENDING_TOKEN,), len(history[r]) - 1, params[r]) for r in (1, 2)]
        pipelined.submit(SchedulerOutput(tuple(pending)))
        outputs.append(pipelined.collect())
        got = outputs[-1]
        assert got.sampled_token_ids == expected.sampled_token_ids
        for request_id, logits in expected.logits.items():
            assert torch.allclose(got.logits[request_id], logits, rtol=1e-5, atol=1e-5)
        expected = known.execute(SchedulerOutput(tuple(chunks)))
    last = pipelined.collect()
    assert last.sampled_token_ids == expected.sampled_token_ids
    with pytest.raises(RuntimeError, match="no step in flight"):
        pipelined.collect()


def test_a_pending_token_the_previous_step_did_not_sample_is_refused():
    worker = Worker(EngineConfig(max_num_seqs=2))
    worker.execute(SchedulerOutput((_chunk(0, (5, 6, 7), 0),)))
    with pytest.raises(ValueError, match="r1: a pending token"):
        worker.submit(SchedulerOutput((_chunk(1, (5, PENDING_TOKEN), 0),)))


def test_a_request_that_stops_during_a_step_in_flight_checkpoints_its_last_token():
    """The step in flight when a request stops on a stop token has computed that token too;
    the response checkpoint covers it (one token more than without async scheduling), and a
    continuation restored from it produces what it produces from scratch."""
    probe_engine = LLMEngine(EngineConfig(async_scheduling=False))
    prompt = _prompts(1, probe_engine.vocab_size, seed=6)[0]
    probe = _run(probe_engine, {"probe": (prompt, GREEDY)})["probe"][0]
    stopping = dataclasses.replace(GREEDY, stop_token_ids=(probe[4],))
    covered = {}
    for async_scheduling in (False, True):
        engine = LLMEngine(EngineConfig(async_scheduling=async_scheduling))
        first = _run(engine, {"a": (prompt, stopping)})["a"]
        assert first[0] == probe[:5] and first[2] == "stop"
        continuation = prompt + first[0] + [7, 8, 9]
        restored = _run(engine, {"b": (continuation, GREEDY)})["b"]
        scratch = _run(engine, {"c": (continuation, GREEDY)}, salt="scratch")["c"]
        assert restored[0] == scratch[0] and scratch[3] == 0
        covered[async_scheduling] = restored[3]
    assert covered[False] == len(prompt) + 4  # the stop token was sampled, never computed
    assert covered[True] == len(prompt) + 5  # computed by the step already in flight


def test_a_request_id_is_refused_while_a_step_in_flight_still_computes_it():
    """A request that stopped on a stop token is still in the step in flight (its last token);
    a new request with its id would be handed that step's token, so it is refused until the
    step is collected."""
    engine = LLMEngine(EngineConfig(async_scheduling=True))
    prompt = _prompts(1, engine.vocab_size, seed=8)[0]
    probe = _run(engine, {"probe": (prompt, GREEDY)})["probe"][0]
    engine.add_request(GenerationRequest("a", prompt, dataclasses.replace(GREEDY, stop_token_ids=(probe[1],))))
    finished = False
    while not finished:
        finished = any(out.finished for out in engine.step())
    with pytest.raises(InvalidRequestError, match="still in use by the step in flight"):
        engine.add_request(GenerationRequest("a", prompt, GREEDY))
    engine.step()  # collects it
    again = _run(engine, {"a": (prompt, GREEDY)}, salt="again")["a"]
    assert again[0] == probe and engine.pool_usage().idle


def test_preemption_while_a_token_is_pending_changes_nothing():
    """The exactness workload under the tight budget (preemption and eviction, requests
    preempted while their last token is in flight and re-admitted with it pending), with and
    without async scheduling: the same tokens and logits."""
    from tests.engine.exactness import Tally, check_near_ties, compare, run_workload, tight_config

    outcomes, preemptions = {}, {}
    for async_scheduling in (False, True):
        engine = LLMEngine(dataclasses.replace(tight_config(), async_scheduling=async_scheduling))
        outcomes[async_scheduling] = run_workload(engine, seed=21, num_requests=24, tally=Tally())
        preemptions[async_scheduling] = engine.stats().scheduler.preemptions
    assert preemptions[True] > 0
    assert outcomes[True].keys() == outcomes[False].keys()
    tally = Tally()
    for request_id, want in outcomes[False].items():
        compare(outcomes[True][request_id], want, tally, f"{request_id} async vs sync")
    check_near_ties(tally, "async vs sync")
