"""Merging a stream's outputs (pure asyncio, no engine): merge_outputs, and the backlog a
lagging caller of AsyncLLMEngine.generate(merge_backlog=True) gets as one delta; the engine
itself is in tests/engine/test_llm_engine.py."""

from __future__ import annotations

import asyncio

from engine.core.async_engine import _merge_waiting
from engine.core.output_processor import RequestOutput, merge_outputs
from engine.execution.executor import ExecutorDiedError


def output(i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=(i,), new_text=f"<{i}>", finished=finished,
                         finish_reason="length" if finished else None, num_prompt_tokens=3,
                         num_output_tokens=i + 1)


def queue_of(*items) -> asyncio.Queue:
    waiting: asyncio.Queue = asyncio.Queue()
    for item in items:
        waiting.put_nowait(item)
    return waiting


def test_merge_concatenates_and_keeps_the_last_counters():
    merged = merge_outputs([output(0), output(1), output(2, finished=True)])
    assert merged.new_token_ids == (0, 1, 2)
    assert merged.new_text == "<0><1><2>"
    assert merged.finished and merged.finish_reason == "length" and merged.num_output_tokens == 3


def test_the_waiting_outputs_are_merged_behind_the_first():
    waiting = queue_of(output(1), output(2))
    merged, died = _merge_waiting(output(0), waiting)
    assert merged.new_token_ids == (0, 1, 2) and merged.num_output_tokens == 3
    assert died is None and waiting.empty()


def test_nothing_waiting_leaves_the_output_as_it_is():
    first = output(0)
    assert _merge_waiting(first, queue_of()) == (first, None)


def test_an_executor_death_behind_waiting_outputs_comes_after_them():
    error = ExecutorDiedError("rank 1 is gone")
    merged, died = _merge_waiting(output(0), queue_of(output(1), error))
    assert merged.new_token_ids == (0, 1) and died is error
