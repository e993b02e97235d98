"""POST /v1/chat/completions through the official openai client: full and streamed responses."""

from __future__ import annotations

import json

MODEL_NAME = "hybrid-serve-tiny"

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello world! How are you today?"},
]


def test_chat_usage_matches_rendered_prompt(client, render_ids, new_salt):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "cache_salt": new_salt()},
    )
    assert response.object == "chat.completion"
    assert response.model == MODEL_NAME
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(render_ids(MESSAGES))
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12
    assert response.usage.prompt_tokens_details.cached_tokens == 0


def test_max_completion_tokens_wins_over_max_tokens(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=3, max_completion_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.usage.completion_tokens == 5


def test_text_parts_are_accepted(client, render_ids):
    """List-of-text-parts content goes to the chat template as is (how parts join is the template's
    business), so usage equals the independently rendered prompt."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello world!"},
                                          {"type": "text", "text": "How are you today?"}]}]
    response = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=4,
                                              temperature=0)
    assert response.usage.prompt_tokens == len(render_ids(parts))
    assert response.choices[0].message.role == "assistant"


def test_stream_role_first_then_content_then_usage(client, render_ids, new_salt):
    """The stream repeats the full request in the same namespace, so its usage chunk reports the
    whole prompt as cached (restored from the first request's prompt checkpoint)."""
    extra = {"ignore_eos": True, "cache_salt": new_salt()}
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0, extra_body=extra
    )
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == len(render_ids(MESSAGES))
    assert usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == usage_chunk.usage.prompt_tokens
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert streamed_text == full.choices[0].message.content


def test_stream_raw_sse_ends_with_done(http):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "temperature": 0,
            "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][len("data: "):])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert "content" in first["choices"][0]["delta"]
    # without include_usage no usage-only chunk is sent
    assert all(json.loads(e[len("data: "):])["choices"] for e in events[:-1])


def test_stop_string_cuts_the_text(client):
    free = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0].message.content
    assert len(free) >= 4, f"24 tokens gave {free!r}: too short to cut, the test would check nothing"
    stop = free[2:4]
    cut = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == free[: free.index(stop)]


def test_seeded_sampling_is_reproducible(client):
    def sample():
        return client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=1.0, top_p=0.9, seed=7,
            extra_body={"top_k": 50, "ignore_eos": True},
        ).choices[0].message.content

    assert sample() == sample()


def test_models_and_health(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    health = http.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "warming_up": False}  # the session app decodes eagerly
