"""Every bad input gets its HTTP status and an OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import json

import openai
import pytest

MODEL_NAME = "hybrid-serve-tiny"
USER = [{"role": "user", "content": "Hello"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat(**fields):
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 4, **fields}


def completion(**fields):
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **fields}


BAD_REQUESTS = [
    # (id, path, body (dict, or raw str or bytes), status, param or None when unchecked)
    ("malformed-json", CHAT, '{"messages": [', 400, None),
    ("body-not-an-object", CHAT, "[1, 2]", 400, None),
    ("missing-messages", CHAT, {"model": MODEL_NAME}, 400, "messages"),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages"),
    ("unknown-role", CHAT, chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages[0].role"),
    ("non-string-content", CHAT, chat(messages=[{"role": "user", "content": 42}]), 400,
     "messages[0].content"),
    ("image-part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, None),
    ("missing-content", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("unknown-model", CHAT, chat(model="gpt-4o"), 404, "model"),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", CHAT, chat(max_tokens=-3), 400, "max_tokens"),
    ("max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("beyond-context", CHAT, chat(max_tokens=600), 400, "max_tokens"),
    # the app's default stop limits (AppConfig: max_stop_strings 16, max_stop_string_chars 256)
    ("too-many-stop-strings", CHAT, chat(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("stop-string-too-long", COMPLETIONS, completion(stop=["x" * 257]), 400, "stop"),
    ("too-many-stop-token-ids", COMPLETIONS, completion(stop_token_ids=list(range(17))), 400,
     "stop_token_ids"),
    ("temperature-negative", CHAT, chat(temperature=-0.5), 400, "temperature"),
    ("top-p-zero", CHAT, chat(top_p=0), 400, "top_p"),
    ("top-p-above-one", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("n-two", CHAT, chat(n=2), 400, "n"),
    ("min-tokens-above-max", CHAT, chat(min_tokens=9), 400, "min_tokens"),
    ("empty-stop", CHAT, chat(stop=[""]), 400, "stop"),
    ("stream-beyond-context", CHAT, chat(max_tokens=600, stream=True), 400, "max_tokens"),
    ("completion-missing-prompt", COMPLETIONS, {"model": MODEL_NAME}, 400, "prompt"),
    ("completion-empty-prompt", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("completion-empty-ids", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("completion-id-out-of-vocab", COMPLETIONS, completion(prompt=[10**9]), 400, "prompt"),
    ("completion-prompt-too-long", COMPLETIONS, completion(prompt=[5] * 600, max_tokens=None), 400, "prompt"),
    ("completion-unknown-model", COMPLETIONS, completion(model="nope"), 404, "model"),
    ("completion-temperature-negative", COMPLETIONS, completion(temperature=-1), 400, "temperature"),
    # found by tests/e2e/test_fuzz.py (each was a 500, most by failing the engine step)
    ("temperature-nan", CHAT, json.dumps(chat(temperature=float("nan"))), 400, "temperature"),
    ("temperature-infinity", CHAT, json.dumps(chat(temperature=float("inf"), min_tokens=1)), 400,
     "temperature"),
    ("temperature-huge", CHAT, chat(temperature=1e300, min_tokens=1), 400, "temperature"),
    ("top-p-nan", COMPLETIONS, json.dumps(completion(top_p=float("nan"))), 400, "top_p"),
    ("seed-beyond-64-bits", COMPLETIONS, completion(seed=2**64), 400, "seed"),
    ("stop-token-id-negative", COMPLETIONS, completion(stop_token_ids=[-1]), 400, "stop_token_ids[0]"),
    ("stop-token-id-out-of-vocab", COMPLETIONS, completion(stop_token_ids=[10**6], min_tokens=1), 400,
     "stop_token_ids"),
    ("prompt-lone-surrogate", COMPLETIONS, json.dumps(completion(prompt="a\ud800b")), 400, "prompt"),
    ("model-lone-surrogate", CHAT, json.dumps(chat(model="\udc00")), 400, "model"),
    ("content-lone-surrogate-as-utf8", CHAT, json.dumps(chat(messages=[
        {"role": "user", "content": "a\ud800"}]), ensure_ascii=False).encode("utf-8", "surrogatepass"),
     400, "messages[0].content"),
    ("invalid-utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}], "max_tokens": 1}',
     400, None),
    ("nested-10k-deep", CHAT, '{"messages": ' + "[" * 10_000 + "]" * 10_000 + "}", 400, None),
]


def assert_openai_error(response, status: int, param: str | None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error


def assert_still_serving(http):
    ok = http.post(CHAT, json=chat(temperature=0, max_tokens=1))
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("path,body,status,param", [r[1:] for r in BAD_REQUESTS],
                         ids=[r[0] for r in BAD_REQUESTS])
def test_bad_request_gets_openai_error_and_server_keeps_serving(http, path, body, status, param):
    if isinstance(body, (str, bytes)):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert_openai_error(response, status, param)
    assert_still_serving(http)


def test_unknown_route_and_wrong_method_get_openai_errors(http):
    assert_openai_error(http.get("/v1/nothing-here"), 404, None)
    assert_openai_error(http.get(CHAT), 405, None)
    assert_still_serving(http)


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL_NAME, messages=USER, temperature=-1)
    assert bad.value.status_code == 400
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="not-served", messages=USER)
    assert missing.value.body["code"] == "model_not_found"
    ok = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2)
    assert ok.choices[0].message.role == "assistant"


def test_a_body_over_max_body_bytes_gets_413_and_the_server_keeps_serving(http):
    from deployments.config import AppConfig

    limit = AppConfig().max_body_bytes  # the session app runs the default
    big = json.dumps(chat(messages=[{"role": "user", "content": "x" * (limit + 1)}]))
    response = http.post(CHAT, content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert "max_body_bytes" in response.json()["error"]["message"]
    assert http.post(CHAT, json=chat()).status_code == 200


@pytest.mark.parametrize("extreme", [{"temperature": 1e-300}, {"temperature": 5e-324, "min_tokens": 2},
                                     {"top_p": 5e-324}, {"top_p": 1e-300, "min_tokens": 2}])
def test_extreme_sampling_values_sample_the_top_token(http, extreme):
    """A temperature below 1e-5 is greedy; a top_p below every probability keeps the top token
    (both failed the engine step before: logits / 1e-300 overflow, 5e-324 is 0 in fp32)."""
    greedy = http.post(CHAT, json=chat(temperature=0, ignore_eos=True, **{
        k: v for k, v in extreme.items() if k == "min_tokens"}))
    sampled = http.post(CHAT, json=chat(ignore_eos=True, **extreme))
    assert greedy.status_code == sampled.status_code == 200, sampled.text
    assert sampled.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]


def test_handle_validates_requests_built_without_validation(app_handle):
    """The handle API validates what model_construct built (nothing) and plain dicts, with the
    400 an HTTP body gets: a NaN temperature reached the engine's step before."""
    from deployments.http.errors import APIError
    from deployments.http.protocol import ChatCompletionRequest, ChatCompletionResponse

    unchecked = ChatCompletionRequest.model_construct(messages=USER, max_tokens=2,
                                                      temperature=float("nan"), min_tokens=1)
    with pytest.raises(APIError) as refused:
        app_handle.chat.remote(unchecked).result()
    assert refused.value.status_code == 400 and refused.value.param == "temperature"
    with pytest.raises(APIError) as refused_stream:
        list(app_handle.options(stream=True).chat_stream.remote(unchecked))
    assert refused_stream.value.status_code == 400
    constructed = ChatCompletionRequest.model_construct(messages=USER, max_tokens=2,
                                                        stream_options={"include_usage": True})
    chunks = list(app_handle.options(stream=True).chat_stream.remote(constructed))
    assert chunks[-1].usage.completion_tokens >= 1
    as_dict = app_handle.chat.remote(chat(max_tokens=2)).result()
    assert isinstance(as_dict, ChatCompletionResponse)
