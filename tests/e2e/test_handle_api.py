"""The Python handle API: `serve.get_app_handle(name)` with typed request objects."""

from __future__ import annotations

import pytest

from deployments.http.errors import APIError
from deployments.http.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)

MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]


def test_chat_through_handle_matches_http(app_handle, client, render_ids):
    request = ChatCompletionRequest(messages=MESSAGES, max_tokens=6, temperature=0, ignore_eos=True)
    response = app_handle.chat.remote(request).result()
    assert isinstance(response, ChatCompletionResponse)
    assert response.usage.prompt_tokens == len(render_ids(MESSAGES))
    assert response.usage.completion_tokens == 6
    over_http = client.chat.completions.create(model=response.model, messages=MESSAGES, max_tokens=6,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert response.choices[0].message.content == over_http.choices[0].message.content


def test_chat_stream_through_handle(app_handle):
    request = ChatCompletionRequest(messages=MESSAGES, max_tokens=6, temperature=0, ignore_eos=True,
                                    stream_options={"include_usage": True})
    full = app_handle.chat.remote(request).result()
    chunks = list(app_handle.options(stream=True).chat_stream.remote(request))
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content


def test_completions_through_handle(app_handle):
    request = CompletionRequest(prompt="The quick brown fox", max_tokens=5, temperature=0, ignore_eos=True)
    response = app_handle.completions.remote(request).result()
    assert isinstance(response, CompletionResponse)
    assert response.usage.completion_tokens == 5
    chunks = list(app_handle.options(stream=True).completions_stream.remote(request))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == response.choices[0].text


def test_handle_errors_are_api_errors(app_handle):
    with pytest.raises(APIError) as too_long:
        app_handle.chat.remote(ChatCompletionRequest(messages=MESSAGES, max_tokens=10_000)).result()
    assert too_long.value.status_code == 400
    with pytest.raises(APIError) as unknown:
        app_handle.chat.remote(ChatCompletionRequest(model="nope", messages=MESSAGES)).result()
    assert unknown.value.status_code == 404


def test_models_through_handle(app_handle):
    models = app_handle.models.remote().result()
    assert models.data[0].max_model_len == 512
