"""Hostile input to the OpenAI API, in process and without Ray: the replica's app
(deployments/frontend.py openai_app) over the embedded tiny model's engine, and the frontend's
handle methods. Every bad request gets a 4xx with an OpenAI error body naming the field at
fault (`param`), streamed or not, and after the barrage the engine serves the same greedy
output as before it, with its pools idle.

The classic bad requests (and the regressions the fuzzer found) are rows of
tests/e2e/test_errors.py, through Serve; tests/e2e/test_fuzz.py throws random bodies at both.
The rows here are what those do not check: JSON values of the wrong type that lax validation
would coerce, OpenAI features that must be refused rather than ignored, the `param` of errors
raised past the field validators, odd bodies and content types, and the handle methods given
something other than a request.
"""

from __future__ import annotations

import asyncio
import gzip
import json

import httpx
import pytest

from deployments.app import request_limits
from deployments.config import AppConfig
from deployments.frontend import LocalPrompts, ModelInfo, OpenAIFrontend, openai_app
from deployments.http.api_keys import ApiKeys
from deployments.http.errors import APIError
from deployments.http.protocol import MAX_CACHE_SALT_CHARS, ChatCompletionRequest, CompletionRequest
from deployments.prompts.rendering import PromptRenderer
from engine.core.async_engine import AsyncLLMEngine
from engine.core.llm_engine import LLMEngine
from engine.engine_config import EngineConfig

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CONFIG = AppConfig()  # the served model name and the limits of a default deployment
USER = [{"role": "user", "content": "Hello"}]
EPHEMERAL = {"type": "ephemeral"}


def chat(**fields) -> dict:
    return {"model": CONFIG.served_model_name, "messages": USER, "max_tokens": 4, "temperature": 0,
            **fields}


def completion(**fields) -> dict:
    return {"model": CONFIG.served_model_name, "prompt": "Hello", "max_tokens": 4, "temperature": 0,
            **fields}


def message(**fields) -> dict:
    return chat(messages=[{"role": "user", "content": "Hello", **fields}])


class Served:
    """The app of one replica over a live engine (LocalPrompts, as the lean path renders)."""

    def __init__(self) -> None:
        limits = request_limits(CONFIG)
        self.engine = LLMEngine(EngineConfig(max_num_seqs=4))
        self.async_engine = AsyncLLMEngine(self.engine)
        renderer = PromptRenderer.from_pretrained(self.engine.config.model_dir)
        self.frontend = OpenAIFrontend(
            LocalPrompts(renderer), lambda request: self.async_engine.generate(request),
            ModelInfo(self.engine.max_model_len, self.engine.config.model_dir),
            CONFIG.served_model_name, limits)

        async def healthy() -> None:
            return None

        async def warm() -> bool:
            return False

        self.app = openai_app(self.frontend, healthy, warm, ApiKeys(), limits)

    def run(self, scenario):
        """asyncio.run(scenario(client)) with an HTTP client of the app."""
        async def main():
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://replica", timeout=30) as client:
                return await asyncio.wait_for(scenario(client), 60)
        return asyncio.run(main())

    def post(self, path: str, body=None, **kwargs) -> httpx.Response:
        async def scenario(client):
            if body is None:
                return await client.post(path, **kwargs)
            return await client.post(path, json=body, **kwargs)
        return self.run(scenario)

    def greedy_outputs(self) -> tuple[str, str]:
        """A greedy chat and a greedy completion (8 tokens each)."""
        answer = self.post(CHAT, chat(max_tokens=8, ignore_eos=True))
        text = self.post(COMPLETIONS, completion(max_tokens=8, ignore_eos=True))
        assert answer.status_code == text.status_code == 200, (answer.text, text.text)
        return answer.json()["choices"][0]["message"]["content"], text.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def served():
    served = Served()
    before = served.greedy_outputs()
    yield served
    try:
        # after every bad request of the module: the same output, nothing left in the engine
        assert served.greedy_outputs() == before
        assert served.engine.pool_usage().num_requests == 0
    finally:
        served.async_engine.shutdown()


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text[:2000]
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] == param, error


# (id, path, body, param): each a 400 naming `param`, streamed or not
BAD_BODIES = [
    # JSON values of another type are refused, not coerced (as OpenAI's API does)
    ("max-tokens-true", CHAT, chat(max_tokens=True), "max_tokens"),
    ("max-tokens-string", CHAT, chat(max_tokens="3"), "max_tokens"),
    ("max-tokens-whole-float", CHAT, chat(max_tokens=2.0), "max_tokens"),
    ("max-completion-tokens-true", CHAT, chat(max_completion_tokens=True), "max_completion_tokens"),
    ("temperature-string", CHAT, chat(temperature="0.5"), "temperature"),
    ("temperature-false", CHAT, chat(temperature=False), "temperature"),
    ("top-k-string", CHAT, chat(top_k="5"), "top_k"),
    ("seed-true", CHAT, chat(seed=True), "seed"),
    ("n-whole-float", CHAT, chat(n=1.0), "n"),
    ("stream-string", CHAT, chat(stream="yes"), "stream"),
    ("ignore-eos-int", CHAT, chat(ignore_eos=1), "ignore_eos"),
    ("include-usage-string", CHAT, chat(stream_options={"include_usage": "true"}),
     "stream_options.include_usage"),
    ("stream-options-list", CHAT, chat(stream_options=[True]), "stream_options"),
    ("prompt-bool-ids", COMPLETIONS, completion(prompt=[True, False]), "prompt"),
    ("prompt-whole-float-ids", COMPLETIONS, completion(prompt=[1.0, 2.0]), "prompt"),
    ("stop-token-id-true", COMPLETIONS, completion(stop_token_ids=[True]), "stop_token_ids[0]"),
    ("min-tokens-string", COMPLETIONS, completion(min_tokens="1"), "min_tokens"),
    # OpenAI features this server does not implement are refused, not ignored
    ("logit-bias", CHAT, chat(logit_bias={"5": -100}), "logit_bias"),
    ("logit-bias-completion", COMPLETIONS, completion(logit_bias={"5": 100}), "logit_bias"),
    ("logit-bias-bad-value", CHAT, chat(logit_bias={"5": "x"}), "logit_bias.5"),
    ("top-logprobs", CHAT, chat(top_logprobs=3), "top_logprobs"),
    ("functions", CHAT, chat(functions=[{"name": "f", "parameters": {}}]), "functions"),
    ("message-tool-calls", CHAT, chat(messages=[*USER, {"role": "assistant", "content": "",
                                                        "tool_calls": [{"id": "call_1"}]}]),
     "messages[1].tool_calls"),
    # refusals past the field validators still name their field
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    ("response-format-json", CHAT, chat(response_format={"type": "json_object"}), "response_format"),
    ("echo", COMPLETIONS, completion(echo=True), "echo"),
    ("suffix", COMPLETIONS, completion(suffix="!"), "suffix"),
    ("min-tokens-above-max-tokens", CHAT, chat(min_tokens=9), "min_tokens"),
    ("stop-token-id-beyond-vocab", COMPLETIONS, completion(stop_token_ids=[10**6]), "stop_token_ids"),
    # a cache_control marker in a list, a cache salt longer than a salt needs to be
    ("cache-control-list", CHAT, message(cache_control=[EPHEMERAL]), "messages[0].cache_control"),
    ("cache-salt-huge", CHAT, chat(cache_salt="s" * 100_000), "cache_salt"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("path,body,param", [row[1:] for row in BAD_BODIES], ids=[row[0] for row in BAD_BODIES])
def test_bad_fields_get_a_400_naming_the_field(served, path, body, param, stream):
    assert_openai_error(served.post(path, {"stream": stream, **body}), 400, param)


def test_a_cache_salt_of_the_longest_accepted_length_is_served(served):
    response = served.post(CHAT, chat(cache_salt="s" * MAX_CACHE_SALT_CHARS, max_tokens=1))
    assert response.status_code == 200, response.text


# (id, raw body, headers): bodies that are not a JSON object, or not readable as one
BAD_WIRE_BODIES = [
    ("json-array", b"[1, 2]", {}),
    ("json-string", b'"hello"', {}),
    ("gzip-encoded", gzip.compress(json.dumps(chat()).encode()), {"content-encoding": "gzip"}),
    ("form-content-type", b"messages=hi", {"content-type": "application/x-www-form-urlencoded"}),
    ("no-content-type", json.dumps(chat()).encode(), {"content-type": ""}),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("content,headers", [row[1:] for row in BAD_WIRE_BODIES],
                         ids=[row[0] for row in BAD_WIRE_BODIES])
def test_bodies_that_are_not_a_json_object_get_a_400(served, path, content, headers):
    headers = {"content-type": "application/json", **headers}
    assert_openai_error(served.post(path, content=content, headers=headers), 400, None)


def test_the_last_of_duplicate_keys_is_the_one_validated(served):
    """JSON objects with a key twice: the last value counts (as json.loads reads it)."""
    refused = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "max_tokens": 0}'
    assert_openai_error(served.post(CHAT, content=refused, headers={"content-type": "application/json"}),
                        400, "max_tokens")


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("method", ["chat", "completions"])
@pytest.mark.parametrize("argument", [None, 5, "Hello", [USER], object()],
                         ids=["none", "int", "string", "list", "object"])
def test_the_handle_methods_refuse_what_is_not_a_request(served, method, argument, stream):
    """OpenAIFrontend's handle methods (OpenAIHandleAPI forwards to them unchanged) given a
    value that is not a request: an APIError 400, before anything reaches the engine. The
    handle over Serve is tests/e2e/test_fuzz.py's."""
    call = getattr(served.frontend, f"{method}_stream" if stream else method)

    async def scenario(_client):
        if stream:
            return [chunk async for chunk in call(argument)]
        return await call(argument)

    with pytest.raises(APIError) as refused:
        served.run(scenario)
    assert refused.value.status_code == 400


@pytest.mark.parametrize("method,request_type,wrong_type", [
    ("chat", ChatCompletionRequest, CompletionRequest),
    ("completions", CompletionRequest, ChatCompletionRequest)])
def test_the_handle_methods_refuse_the_other_routes_request_and_unchecked_bools(
        served, method, request_type, wrong_type):
    """A CompletionRequest given to chat (or the reverse) and a request built with
    model_construct whose token ids are bools: APIError 400."""
    other = (CompletionRequest(prompt="Hello", max_tokens=2) if wrong_type is CompletionRequest
             else ChatCompletionRequest(messages=USER, max_tokens=2))
    unchecked = (request_type.model_construct(messages=USER, max_tokens=True) if method == "chat"
                 else request_type.model_construct(prompt=[True, 3], max_tokens=2))
    for argument, param in ((other, None), (unchecked, "max_tokens" if method == "chat" else "prompt")):
        async def scenario(_client, argument=argument):
            return await getattr(served.frontend, method)(argument)

        with pytest.raises(APIError) as refused:
            served.run(scenario)
        assert refused.value.status_code == 400 and refused.value.param == param


def test_bad_requests_beside_a_running_one_leave_it_untouched(served):
    """Twenty refused requests (one the engine itself refuses) while a request generates: it
    finishes with all its tokens."""
    async def scenario(client):
        running = asyncio.create_task(client.post(CHAT, json=chat(max_tokens=24, ignore_eos=True)))
        refused = await asyncio.gather(
            *(client.post(COMPLETIONS, json=completion(stop_token_ids=[10**6])) for _ in range(10)),
            *(client.post(CHAT, json=chat(max_tokens=0)) for _ in range(10)))
        return await running, refused

    running, refused = served.run(scenario)
    assert {response.status_code for response in refused} == {400}
    assert running.status_code == 200 and running.json()["usage"]["completion_tokens"] == 24

