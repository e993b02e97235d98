"""Many requests at once return exactly what each returns alone (greedy decoding).

The concurrent requests repeat the sequential ones in the same (default) namespace, so they also
restore from the sequential run's prompt checkpoints: concurrency and reuse together must not
change a single token.
"""

from __future__ import annotations

import asyncio

import pytest

MODEL_NAME = "hybrid-serve-tiny"
NUM_REQUESTS = 16

TOPICS = ["the sea", "a fox", "hybrid models", "state space", "attention", "the weather",
          "numbers", "a dog", "the sky", "music", "trees", "rivers", "a city", "bread", "time",
          "stars", "a lazy dog", "mountains", "the moon", "tea"]


def _request(i: int) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}." * (1 + i % 3)}],
        "max_tokens": 4 + 2 * (i % 4),
        "temperature": 0,
        "extra_body": {"ignore_eos": i % 2 == 0},
    }


@pytest.fixture(scope="module")
def alone(client):
    """Each request's response when it runs by itself."""
    return [client.chat.completions.create(**_request(i)) for i in range(NUM_REQUESTS)]


def test_concurrent_greedy_requests_match_sequential(alone, make_async_client, wait_until_idle):
    async def all_at_once():
        async with make_async_client() as async_client:
            return await asyncio.gather(
                *(async_client.chat.completions.create(**_request(i)) for i in range(NUM_REQUESTS)))

    together = asyncio.run(all_at_once())
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b.choices[0].message.content == a.choices[0].message.content, f"request {i}"
        assert b.choices[0].finish_reason == a.choices[0].finish_reason, f"request {i}"
        assert b.usage.prompt_tokens == a.usage.prompt_tokens, f"request {i}"
        assert b.usage.completion_tokens == a.usage.completion_tokens, f"request {i}"
        assert b.usage.prompt_tokens_details.cached_tokens <= b.usage.prompt_tokens
    assert sum(b.usage.prompt_tokens_details.cached_tokens for b in together) > 0
    wait_until_idle()


def test_concurrent_streams_match_sequential(alone, make_async_client):
    async def stream_text(async_client, i: int) -> str:
        stream = await async_client.chat.completions.create(**_request(i), stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    async def all_at_once():
        async with make_async_client() as async_client:
            return await asyncio.gather(*(stream_text(async_client, i) for i in range(NUM_REQUESTS)))

    assert asyncio.run(all_at_once()) == [a.choices[0].message.content for a in alone]
