"""The LLM server's stream merging (pure asyncio, no Ray): deltas that are already waiting
are merged, nothing is lost or reordered, errors surface, and closing the stream closes its
source (which is what aborts the request in the engine)."""

from __future__ import annotations

import asyncio

import pytest

from deployments.llm_server import coalesce
from engine.core.llm_engine import RequestOutput
from engine.core.output_processor import merge_outputs


def output(i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=(i,), new_text=f"<{i}>", finished=finished,
                         finish_reason="length" if finished else None, num_prompt_tokens=3,
                         num_output_tokens=i + 1)


def test_merge_concatenates_and_keeps_the_last_counters():
    merged = merge_outputs([output(0), output(1), output(2, finished=True)])
    assert merged.new_token_ids == (0, 1, 2)
    assert merged.new_text == "<0><1><2>"
    assert merged.finished and merged.finish_reason == "length" and merged.num_output_tokens == 3


def test_waiting_outputs_are_merged_without_loss():
    async def burst():
        for i in range(5):
            yield output(i, finished=i == 4)

    async def main():
        got = []
        async for out in coalesce(burst()):
            got.append(out)
            await asyncio.sleep(0.01)  # a slow consumer
        return got

    got = asyncio.run(main())
    assert len(got) < 5
    assert tuple(t for out in got for t in out.new_token_ids) == (0, 1, 2, 3, 4)
    assert got[-1].finished


def test_error_after_outputs_is_raised_after_them():
    async def failing():
        yield output(0)
        raise ValueError("refused")

    async def main():
        seen = []
        with pytest.raises(ValueError, match="refused"):
            async for out in coalesce(failing()):
                seen.append(out)
        return seen

    assert [o.new_token_ids for o in asyncio.run(main())] == [(0,)]


def test_closing_the_stream_closes_its_source():
    closed = asyncio.Event()

    async def endless():
        try:
            i = 0
            while True:
                yield output(i)
                i += 1
                await asyncio.sleep(0.001)
        finally:
            closed.set()

    async def main():
        stream = coalesce(endless())
        await anext(stream)
        await stream.aclose()
        await asyncio.wait_for(closed.wait(), 1)

    asyncio.run(main())


def test_stream_interval_holds_deltas_until_they_carry_enough_tokens():
    async def steady():
        for i in range(10):
            yield output(i, finished=i == 9)
            await asyncio.sleep(0.002)  # about one engine step apart

    async def main(interval):
        return [out.new_token_ids async for out in coalesce(steady(), interval)]

    deltas = asyncio.run(main(4))
    assert deltas[0] == (0,)  # the first at once
    assert all(len(ids) >= 4 for ids in deltas[1:-1])  # then at least four a delta
    assert len(deltas) <= 4
    assert [t for ids in deltas for t in ids] == list(range(10))  # nothing lost or reordered


def test_stream_interval_one_sends_each_output_as_it_comes():
    async def main():
        taken = asyncio.Event()

        async def in_lockstep():  # the next output only once the last one was received
            for i in range(6):
                yield output(i, finished=i == 5)
                await taken.wait()
                taken.clear()

        deltas = []
        async for out in coalesce(in_lockstep(), stream_interval=1):
            deltas.append(out.new_token_ids)
            taken.set()
        return deltas

    assert asyncio.run(main()) == [(i,) for i in range(6)]


def test_stream_interval_never_holds_back_outputs_before_an_error():
    async def failing():
        yield output(0)
        yield output(1)
        await asyncio.sleep(0.002)
        raise ValueError("engine died")

    async def main():
        seen = []
        with pytest.raises(ValueError, match="engine died"):
            async for out in coalesce(failing(), stream_interval=8):
                seen.append(out.new_token_ids)
        return seen

    assert [t for ids in asyncio.run(main()) for t in ids] == [0, 1]

