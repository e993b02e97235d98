"""The in-process engine on the embedded model: batching, chunking, preemption, pauses and
stops never change what a request produces."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from engine.core.async_engine import AsyncLLMEngine
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.core.llm_engine import LLMEngine
from engine.interfaces.sampling_params import InvalidRequestError, SamplingParams
from engine.parallel.cache_capacity import CacheBudgetError

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, return_logits=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(max_num_batched_tokens=512, max_num_seqs=8))


def prompts(engine: LLMEngine, count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 70, (count,), generator=generator).tolist()
    return [torch.randint(5, engine.vocab_size, (n,), generator=generator).tolist() for n in lengths]


def run_all(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], pauses=None):
    """Run requests to completion; returns id -> (token ids, text, logits rows, finish reason)."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(GenerationRequest(request_id, prompt, params,
                                             pause_positions=(pauses or {}).get(request_id, ())))
    results = {rid: ([], [], [], None) for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, text, logits, _ = results[out.request_id]
            tokens += out.new_token_ids
            text.append(out.new_text)
            if out.logits is not None:
                logits.append(out.logits)
            if out.finished:
                results[out.request_id] = (tokens, text, logits, out.finish_reason)
    return {rid: (t, "".join(x), lg, r) for rid, (t, x, lg, r) in results.items()}


def assert_same_run(actual, expected):
    """Same tokens, and one logits row per token in both runs, each within 1e-4 relative."""
    assert actual[0] == expected[0]
    assert len(actual[2]) == len(actual[0]) and len(expected[2]) == len(expected[0]), (
        f"{len(actual[2])} and {len(expected[2])} logits rows for {len(actual[0])} tokens")
    for got, want in zip(actual[2], expected[2], strict=True):
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_batched_and_chunked_runs_match_each_request_alone(engine):
    batch = prompts(engine, 6)
    alone = {f"a{i}": run_all(engine, {f"a{i}": (p, GREEDY)})[f"a{i}"] for i, p in enumerate(batch)}
    small_budget = LLMEngine(EngineConfig(max_num_batched_tokens=13, max_num_seqs=4))
    together = run_all(small_budget, {f"a{i}": (p, GREEDY) for i, p in enumerate(batch)})
    for request_id, result in alone.items():
        assert_same_run(together[request_id], result)
        assert result[3] == "length" and len(result[0]) == GREEDY.max_tokens


def test_preemption_does_not_change_outputs(engine):
    batch = prompts(engine, 5, seed=1)
    expected = run_all(engine, {f"p{i}": (p, GREEDY) for i, p in enumerate(batch)})
    # 12 blocks of 16 tokens for five requests of up to ~80 tokens forces preemption.
    per_block = engine.executor.model.kv_bytes_per_block(16)
    tight = LLMEngine(EngineConfig(kv_cache_bytes=12 * per_block, max_model_len=160, max_num_seqs=5))
    actual = run_all(tight, {f"p{i}": (p, GREEDY) for i, p in enumerate(batch)})
    for request_id in expected:
        assert_same_run(actual[request_id], expected[request_id])
    assert tight.pool_usage().idle
    assert tight.scheduler.stats.preemptions > 0


def test_a_pause_position_ends_a_chunk_and_captures_the_hidden_row_there(engine):
    prompt = prompts(engine, 1, seed=2)[0] + prompts(engine, 1, seed=3)[0]
    pause = len(prompt) // 2 + 1
    engine.add_request(GenerationRequest("paused", prompt, GREEDY, pause_positions=(pause,)))
    first = engine.step()
    while engine.last_step is None:  # with async scheduling the next call collects the first step
        first += engine.step()
    trace = engine.last_step
    chunk = trace.scheduler_output.chunks[0]
    assert (chunk.start_position, len(chunk.token_ids), chunk.sample) == (0, pause, False)
    assert first == []
    hidden_at_pause = trace.runner_output.hidden_rows["paused"]
    while engine.has_unfinished_requests():
        engine.step()
    # The hidden row after `pause` tokens equals the last row of a forward over just them.
    prefix_engine_run = run_all(engine, {"prefix": (prompt[:pause], dataclasses.replace(GREEDY, max_tokens=1))})
    model = engine.executor.model
    expected_logits = prefix_engine_run["prefix"][2][0]
    got_logits = model.compute_logits(hidden_at_pause[None].to(next(model.parameters()).dtype))[0]
    assert (got_logits - expected_logits).abs().max() <= 1e-4 * expected_logits.abs().max()
    # And pausing did not change what the request produced.
    paused = run_all(engine, {"p2": (prompt, GREEDY)}, pauses={"p2": (pause,)})["p2"]
    plain = run_all(engine, {"p3": (prompt, GREEDY)})["p3"]
    assert_same_run(paused, plain)


def test_stop_strings_and_stop_tokens_end_requests(engine):
    prompt = prompts(engine, 1, seed=4)[0]
    free = run_all(engine, {"free": (prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))})["free"]
    tokens, text = free[0], free[1]
    stop_token = tokens[5]
    by_token = run_all(
        engine,
        {"tok": (prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=(stop_token,)))},
    )["tok"]
    first = tokens.index(stop_token)
    assert by_token[0] == tokens[: first + 1] and by_token[3] == "stop"
    visible = text.strip()
    if len(visible) >= 6:
        stop_string = visible[len(visible) // 2 : len(visible) // 2 + 3]
        by_string = run_all(
            engine,
            {"str": (prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=(stop_string,)))},
        )["str"]
        assert by_string[3] == "stop"
        assert by_string[1] == text[: text.index(stop_string)]


def test_requests_that_cannot_run_are_refused_clearly(engine):
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        engine.add_request(GenerationRequest("long", [5] * 10, SamplingParams(max_tokens=engine.max_model_len)))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(GenerationRequest("empty", [], SamplingParams()))
    with pytest.raises(InvalidRequestError):
        engine.add_request(GenerationRequest("oov", [engine.vocab_size + 3], SamplingParams()))
    with pytest.raises(InvalidRequestError, match="stop token ids"):  # masked in the logits: would fail the step
        engine.add_request(GenerationRequest("oov-stop", [5], SamplingParams(
            min_tokens=1, stop_token_ids=(engine.vocab_size,))))
    with pytest.raises(CacheBudgetError, match="kv_cache_bytes"):
        LLMEngine(EngineConfig(kv_cache_bytes=1024))
    assert not engine.has_unfinished_requests()


def test_ids_past_a_published_checkpoint_are_range_checked(engine):
    """add_request checks only the ids past the longest published checkpoint of the prompt's
    namespace: an id out of range right after one, or inside a prefix that leaves it early, is
    refused all the same; the prompt that follows it with valid ids runs."""
    prompt = prompts(engine, 1, seed=9)[0] + list(range(40, 80))
    run_all(engine, {"first": (prompt, GREEDY)})  # publishes its prompt checkpoint
    covered = engine.longest_checkpoint((engine.config.model_dir, ""), prompt + [7])
    assert covered == len(prompt)
    for bad in (prompt + [engine.vocab_size], prompt + [-1], prompt[:3] + [engine.vocab_size] + prompt[4:] + [7]):
        with pytest.raises(InvalidRequestError, match="prompt token ids must be ints in"):
            engine.add_request(GenerationRequest("bad-id", bad, GREEDY))
    assert run_all(engine, {"good": (prompt + [7, 8], GREEDY)})["good"][3] == "length"
    assert not engine.has_unfinished_requests()


def test_a_prompt_tuple_is_kept_and_must_hold_ints_other_sequences_are_converted(engine):
    """GenerationRequest keeps a tuple prompt as given and converts any other sequence to a
    tuple of ints; add_request refuses a tuple holding something other than ints (a bool, a
    float, a numpy integer), with nothing queued."""
    prompt = tuple(prompts(engine, 1, seed=11)[0])
    assert GenerationRequest("kept", prompt, GREEDY).prompt_token_ids is prompt
    converted = GenerationRequest("converted", np.array(prompt), GREEDY).prompt_token_ids
    assert converted == prompt and {type(t) for t in converted} == {int}
    for bad in (True, 5.0, np.int64(5)):
        with pytest.raises(InvalidRequestError, match="prompt token ids must be ints in"):
            engine.add_request(GenerationRequest("bad-type", prompt + (bad,), GREEDY))
    assert not engine.has_unfinished_requests()
    assert run_all(engine, {"good": (list(prompt), GREEDY)})["good"][3] == "length"


def test_async_engine_streams_and_aborts_free_the_pools(engine):
    async_engine = AsyncLLMEngine(engine)
    prompt = prompts(engine, 1, seed=5)[0]

    async def scenario():
        outputs = [o async for o in async_engine.generate(GenerationRequest("s1", prompt, GREEDY))]
        stream = async_engine.generate(GenerationRequest(
            "s2", prompt, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)))
        async for _ in stream:
            break
        await stream.aclose()
        with pytest.raises(InvalidRequestError):
            async for _ in async_engine.generate(GenerationRequest("bad", [], GREEDY)):
                pass
        for _ in range(200):
            if engine.pool_usage().num_requests == 0:
                break
            await asyncio.sleep(0.01)
        return outputs

    try:
        outputs = asyncio.run(scenario())
    finally:
        async_engine.shutdown()
    assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) == GREEDY.max_tokens
    usage = engine.pool_usage()
    assert usage.num_requests == 0 and usage.idle


def test_a_stream_interval_merges_outputs_before_they_reach_the_event_loop(engine):
    """After the first output, a stream with stream_interval 4 gets outputs of 4 tokens (one
    token a step here), merged on the step thread, with the same tokens and text as one output
    a step; outputs with logits are never merged."""
    async_engine = AsyncLLMEngine(engine)
    prompt = prompts(engine, 1, seed=7)[0]
    plain = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)

    async def run(request_id, sampling, interval):
        request = GenerationRequest(request_id, prompt, sampling)
        return [o async for o in async_engine.generate(request, stream_interval=interval)]

    async def scenario():
        return (await run("one", plain, 1), await run("four", plain, 4),
                await run("logits", GREEDY, 4))

    try:
        every_step, merged, with_logits = asyncio.run(scenario())
    finally:
        async_engine.shutdown()
    assert [len(o.new_token_ids) for o in every_step] == [1] * 14
    assert [len(o.new_token_ids) for o in merged] == [1, 4, 4, 4, 1]
    assert merged[-1].finished and merged[-1].num_output_tokens == 14
    assert [t for o in merged for t in o.new_token_ids] == [t for o in every_step for t in o.new_token_ids]
    assert "".join(o.new_text for o in merged) == "".join(o.new_text for o in every_step)
    assert len(with_logits) == GREEDY.max_tokens and all(o.logits is not None for o in with_logits)


def test_merge_backlog_gives_a_lagging_caller_what_piled_up_as_one_output(engine):
    """With merge_backlog, a caller that lags (here 30 ms after each output, several steps)
    gets fewer outputs than tokens, with the same tokens and text in the same order as a
    caller that keeps up; outputs with logits are never merged."""
    async_engine = AsyncLLMEngine(engine)
    prompt = prompts(engine, 1, seed=11)[0]
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def run(request_id, sampling, lag_s):
        outputs = []
        request = GenerationRequest(request_id, prompt, sampling)
        async for out in async_engine.generate(request, merge_backlog=True):
            outputs.append(out)
            await asyncio.sleep(lag_s)
        return outputs

    async def scenario():
        return (await run("keeps-up", plain, 0), await run("lags", plain, 0.03),
                await run("logits", GREEDY, 0.03))

    try:
        kept_up, lagged, with_logits = asyncio.run(scenario())
    finally:
        async_engine.shutdown()
    assert len(lagged) < 12 and lagged[-1].finished and lagged[-1].num_output_tokens == 12
    assert [t for o in lagged for t in o.new_token_ids] == [t for o in kept_up for t in o.new_token_ids]
    assert "".join(o.new_text for o in lagged) == "".join(o.new_text for o in kept_up)
    assert len(with_logits) == GREEDY.max_tokens and all(o.logits is not None for o in with_logits)


def test_in_pass_capture_stays_off_where_the_worker_cannot_do_it():
    """On CPU the worker reports no in-pass support, so the scheduler keeps cutting chunks at
    the instruction boundary whatever the config asks (tests/gpu covers the CUDA side)."""
    engine = LLMEngine(EngineConfig(max_model_len=256, in_pass_capture=True))
    assert engine.executor.cache_capacity().in_pass_capture is False
    assert engine.scheduler.checkpoints.in_pass_capture is False
