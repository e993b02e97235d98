"""Hostile input at the HTTP edge and the handle API (issue 23, point 1): property-based fuzzing.

Hypothesis generates request bodies for POST /v1/chat/completions and /v1/completions: mostly
valid requests with one or more fields mutated (wrong types, huge and negative numbers, NaN and
infinities as the raw JSON literals `NaN`/`Infinity`, JSON nested 10,000 deep, huge strings,
invalid UTF-8 bytes, lone surrogates, unknown fields, empty and oversized message lists, roles
out of order, thousands of stop strings, out-of-range token ids, a cache_salt of every shape),
some random JSON values, and bodies that are not JSON at all or come with the wrong content
type. Every answer must be a 4xx with an OpenAI error body or a valid completion (a stream of
valid chunks ending in `data: [DONE]`), never a 5xx; afterwards a valid request succeeds and
the engine's pools go back to idle. The handle API gets the same treatment with typed
requests: every failure is an APIError with a 4xx status.

Valid-looking requests ask for 1-4 tokens so the run stays cheap on the tiny CPU model.

    # CI: 1,000 HTTP examples (HYBRID_SERVE_FUZZ_EXAMPLES, default 1000) and 100 handle examples
    .venv/bin/python -m pytest -q tests/e2e/test_fuzz.py
    # the long run: 20,000 HTTP examples (and 2,000 handle examples)
    HYBRID_SERVE_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest -q tests/e2e/test_fuzz.py

Each run draws a fresh seed and prints it (shown with a failure); HYBRID_SERVE_FUZZ_SEED=<seed>
replays that run. No example database is kept.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, note, seed, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from deployments.http.errors import APIError
from deployments.http.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)

MODEL_NAME = "hybrid-serve-tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
VOCAB_SIZE = 2048  # the embedded tiny model's; ids around it are the interesting ones

HTTP_EXAMPLES = max(1, int(os.environ.get("HYBRID_SERVE_FUZZ_EXAMPLES", "1000")))
HANDLE_EXAMPLES = max(100, HTTP_EXAMPLES // 10)
FUZZ_SEED = int(os.environ.get("HYBRID_SERVE_FUZZ_SEED") or random.SystemRandom().randrange(2**32))

FUZZ_SETTINGS = settings(
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much, HealthCheck.large_base_example],
)


# ----- values


@dataclass(frozen=True)
class Raw:
    """JSON text spliced into a body as is: what json.dumps cannot write (deep nesting that
    would exhaust its recursion, invalid UTF-8, number literals Python cannot hold)."""

    text: bytes


def nested(depth: int, opener: bytes, closer: bytes, inner: bytes = b"1") -> Raw:
    return Raw(opener * depth + inner + closer * depth)


RAW_VALUES = st.sampled_from([
    nested(10_000, b"[", b"]"),
    nested(10_000, b'{"a":', b"}"),
    nested(900, b"[", b"]"),
    nested(100, b'{"role":"user","content":', b"}", b'"x"'),
    Raw(b'"\xff\xfe"'),             # not UTF-8
    Raw(b'"abc\x80def"'),           # a stray continuation byte
    Raw(b'"\xc0\xaf"'),             # overlong encoding
    Raw(b'"\xed\xa0\x80"'),         # a UTF-8-encoded surrogate
    Raw(b'"\\ud800"'),              # an escaped lone surrogate
    Raw(b'"\\udfff\\ud800x"'),
    Raw(b"1e999"),                  # Python's json reads inf
    Raw(b"-1e999"),
    Raw(b"9" * 5000),               # beyond Python's int digit limit
    Raw(b"-" + b"9" * 300),
    Raw(b"1" + b"0" * 30),
    Raw(b"NaN"),
    Raw(b"-Infinity"),
])

HUGE_INTS = st.sampled_from([2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30,
                             -1, -(2**31), -(2**63), -(2**63) - 1, -(10**30), 0])
SPECIAL_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 1e-300,
                                  -0.0, 1e-45, 0.5, 2.0, 1e10])
LONE_SURROGATES = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)
UNICODE = st.text(st.characters(codec="utf-8"), max_size=12)
WEIRD_TEXT = st.one_of(
    UNICODE, LONE_SURROGATES,
    st.builds(lambda a, s, b: a + s + b, UNICODE, LONE_SURROGATES, UNICODE),
    st.sampled_from(["", " ", "\x00", "\n", "<|end_of_text|>", "<|start_of_role|>system",
                     "😀", "\u202e", "\ufeff", "a" * 300]),
)
HUGE_TEXT = st.builds(lambda unit, n: unit * n, st.sampled_from(["x", "é", "😀", "ab ", "\x00"]),
                      st.sampled_from([1_000, 20_000, 200_000]))

JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), HUGE_INTS,
                        st.floats(allow_nan=True, allow_infinity=True), UNICODE)
RANDOM_JSON = st.recursive(
    JSON_LEAVES,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(UNICODE, children, max_size=4)),
    max_leaves=12,
)

HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(), HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True), SPECIAL_FLOATS,
    WEIRD_TEXT, HUGE_TEXT, RANDOM_JSON,
    st.lists(st.integers(-5, 5000), max_size=5), st.just([]), st.just({}),
    RAW_VALUES,
)

# ----- valid-looking requests (cheap: 1-4 tokens)

ROLES = ["system", "developer", "user", "assistant"]
SHORT_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=24)
CONTENT = st.one_of(SHORT_TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": SHORT_TEXT}),
                                         min_size=1, max_size=2))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": CONTENT})
# roles in any order, the user-last case most often
MESSAGES = st.one_of(
    st.lists(MESSAGE, min_size=1, max_size=4),
    st.builds(lambda head, text: head + [{"role": "user", "content": text}],
              st.lists(MESSAGE, max_size=2), SHORT_TEXT),
)
TOKEN_IDS = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=24)

# sampling values that pass validation and reach the sampler: the engine must survive them
SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(st.just(0), st.floats(0, 2),
                             st.sampled_from([1e-300, 5e-324, 1e-45, 1e-8, 2.0, 1e6, 1e300])),
    "top_p": st.one_of(st.floats(1e-9, 1), st.sampled_from([5e-324, 1e-300, 1.0])),
    "top_k": st.one_of(st.integers(0, 3000), HUGE_INTS.filter(lambda v: v >= 0)),
    "seed": st.one_of(st.none(), st.integers(), HUGE_INTS),
    "min_tokens": st.integers(0, 4),
    "stop": st.one_of(SHORT_TEXT, st.lists(SHORT_TEXT, max_size=4)),
    "stop_token_ids": st.lists(st.one_of(st.integers(0, VOCAB_SIZE + 10), HUGE_INTS), max_size=4),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "cache_salt": st.one_of(SHORT_TEXT, st.just("fuzz")),
    "user": SHORT_TEXT,
    "n": st.just(1),
    "presence_penalty": st.just(0),
    "logprobs": st.sampled_from([None, False, 0]),
})

MAX_TOKENS = st.integers(1, 4)
VALID_CHAT = st.builds(lambda m, n, s: {"model": MODEL_NAME, "messages": m, "max_tokens": n, **s},
                       MESSAGES, MAX_TOKENS, SAMPLING)
VALID_COMPLETION = st.builds(lambda p, n, s: {"model": MODEL_NAME, "prompt": p, "max_tokens": n, **s},
                             st.one_of(SHORT_TEXT, TOKEN_IDS), MAX_TOKENS, SAMPLING)

SHARED_FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                 "stop_token_ids", "ignore_eos", "min_tokens", "n", "stream", "stream_options",
                 "user", "presence_penalty", "frequency_penalty", "logprobs", "cache_salt"]
CHAT_FIELDS = SHARED_FIELDS + ["messages", "max_completion_tokens", "tools", "response_format"]
COMPLETION_FIELDS = SHARED_FIELDS + ["prompt", "echo", "suffix", "best_of"]
UNKNOWN_FIELDS = st.one_of(st.sampled_from(["logit_bias", "top_logprobs", "functions", "tool_choice",
                                            "parallel_tool_calls", "metadata", "store", "", "__proto__"]),
                           UNICODE)

# structured mutations a generic "field := hostile value" rarely finds
CACHE_SALTS = st.one_of(HOSTILE, WEIRD_TEXT, HUGE_TEXT, st.just(""), st.just(None),
                        st.lists(SHORT_TEXT, max_size=3), st.dictionaries(SHORT_TEXT, SHORT_TEXT, max_size=2))
MANY_STOPS = st.builds(lambda n, unit: [f"{unit}{i}" for i in range(n)],
                       st.sampled_from([16, 17, 1000, 5000]), st.sampled_from(["s", "", "😀", "\ud800"]))
STOP_VALUES = st.one_of(MANY_STOPS, st.lists(WEIRD_TEXT, max_size=4), HUGE_TEXT, WEIRD_TEXT)
STOP_TOKEN_IDS = st.one_of(
    st.lists(st.one_of(st.integers(), HUGE_INTS, st.integers(VOCAB_SIZE - 2, VOCAB_SIZE + 2)), max_size=6),
    st.builds(lambda n: list(range(n)), st.sampled_from([16, 17, 5000])),
)
BAD_ROLES = st.one_of(st.sampled_from(["tool", "function", "ipython", "", "USER", "System"]), HOSTILE)
BAD_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": BAD_ROLES, "content": SHORT_TEXT}),
    st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": HOSTILE}),
    st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": st.lists(
        st.one_of(HOSTILE, st.fixed_dictionaries({"type": HOSTILE, "text": HOSTILE})), max_size=3)}),
    st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": SHORT_TEXT, "name": HOSTILE}),
    st.fixed_dictionaries({"role": st.sampled_from(ROLES)}),
    st.fixed_dictionaries({"content": SHORT_TEXT}),
    HOSTILE,
)
MESSAGE_LISTS = st.one_of(
    st.just([]),
    st.lists(st.one_of(MESSAGE, BAD_MESSAGE), min_size=1, max_size=5),
    st.builds(lambda m, n: [m] * n, MESSAGE, st.sampled_from([100, 2_000, 20_000])),  # oversized
    st.builds(lambda text: [{"role": "user", "content": text}], HUGE_TEXT),
    st.permutations([{"role": r, "content": "hi"} for r in ROLES]),  # roles out of order
)
PROMPTS = st.one_of(
    st.just(""), st.just([]), WEIRD_TEXT, HUGE_TEXT,
    st.lists(st.one_of(st.integers(), HUGE_INTS, st.integers(VOCAB_SIZE - 2, VOCAB_SIZE + 2)),
             min_size=1, max_size=8),
    st.lists(TOKEN_IDS, min_size=1, max_size=3),  # a batch (list of lists)
    st.lists(st.one_of(SHORT_TEXT, HOSTILE), min_size=1, max_size=3),
    st.builds(lambda n: [5] * n, st.sampled_from([511, 512, 600, 100_000])),
    HOSTILE,
)


def mutations(fields: list[str], structural: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """One mutation of a body: (key, value) to set, or (key, DELETE) to remove."""
    return st.one_of(
        st.tuples(st.sampled_from(fields), HOSTILE),
        st.tuples(UNKNOWN_FIELDS, HOSTILE),
        st.tuples(st.sampled_from(fields), st.just(DELETE)),
        *(st.tuples(st.just(key), values) for key, values in structural.items()),
    )


DELETE = object()
SHARED_STRUCTURAL = {"cache_salt": CACHE_SALTS, "stop": STOP_VALUES, "stop_token_ids": STOP_TOKEN_IDS,
                     "max_tokens": st.one_of(HUGE_INTS, st.integers(-3, 600))}
CHAT_MUTATIONS = mutations(CHAT_FIELDS, {**SHARED_STRUCTURAL, "messages": MESSAGE_LISTS})
COMPLETION_MUTATIONS = mutations(COMPLETION_FIELDS, {**SHARED_STRUCTURAL, "prompt": PROMPTS})


def mutated(body: dict, changes: list[tuple]) -> dict:
    body = dict(body)
    for key, value in changes:
        if value is DELETE:
            body.pop(key, None)
        else:
            body[key] = value
    return cheap(body)


def cheap(body: dict) -> dict:
    """`body` with its generation kept to a few tokens on the CPU model: a token budget that
    would be accepted above 4 becomes 4, and a missing or null one (the whole context, hundreds
    of tokens) is bounded: chat by max_completion_tokens 2 (which wins over max_tokens),
    completions by max_tokens 1. Budgets beyond the context stay: they are refused."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        budget = None
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                budget = int(value)
            except (ValueError, OverflowError):
                pass
        if budget is not None and 4 < budget <= 512:
            body[key] = 4
    if "messages" in body:
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_completion_tokens"] = 2
    elif body.get("max_tokens") is None:
        body["max_tokens"] = 1
    return body


CHAT_BODIES = st.one_of(
    VALID_CHAT,
    st.builds(mutated, VALID_CHAT, st.lists(CHAT_MUTATIONS, min_size=1, max_size=3)),
    st.builds(mutated, VALID_CHAT, st.lists(CHAT_MUTATIONS, min_size=1, max_size=3)),
)
COMPLETION_BODIES = st.one_of(
    VALID_COMPLETION,
    st.builds(mutated, VALID_COMPLETION, st.lists(COMPLETION_MUTATIONS, min_size=1, max_size=3)),
    st.builds(mutated, VALID_COMPLETION, st.lists(COMPLETION_MUTATIONS, min_size=1, max_size=3)),
)


# ----- bodies on the wire


def encode(value, ascii_only: bool) -> bytes:
    """JSON text of `value`, NaN and infinities as Python writes them (NaN, Infinity), Raw
    values spliced in. Without ascii_only, lone surrogates go out as their raw 3-byte
    (invalid UTF-8) encoding."""
    raws: list[Raw] = []

    def placeholders(v):
        if isinstance(v, Raw):
            raws.append(v)
            return f"@@raw{len(raws) - 1}@@"
        if isinstance(v, dict):
            return {k: placeholders(x) for k, x in v.items()}
        if isinstance(v, list):
            return [placeholders(x) for x in v]
        return v

    text = json.dumps(placeholders(value), allow_nan=True, ensure_ascii=ascii_only)
    data = text.encode("utf-8", "surrogatepass")
    for i, raw in enumerate(raws):
        data = data.replace(f'"@@raw{i}@@"'.encode(), raw.text, 1)
    return data


@dataclass(frozen=True)
class WireRequest:
    path: str
    content: bytes
    content_type: str | None = "application/json"

    def __repr__(self) -> str:  # hypothesis prints failing examples; keep them readable
        shown = self.content[:600] + (b"...(%d bytes)" % len(self.content) if len(self.content) > 600 else b"")
        return f"WireRequest({self.path!r}, {shown!r}, content_type={self.content_type!r})"


PATHS = st.sampled_from([CHAT, COMPLETIONS])
CONTENT_TYPES = st.sampled_from([None, "text/plain", "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                                 "application/json; charset=utf-16", "application/vnd.api+json",
                                 "application/octet-stream", "application", "*/*", ""])
JSON_REQUESTS = st.one_of(
    st.builds(WireRequest, st.just(CHAT), st.builds(encode, CHAT_BODIES, st.booleans())),
    st.builds(WireRequest, st.just(COMPLETIONS), st.builds(encode, COMPLETION_BODIES, st.booleans())),
)
ODD_REQUESTS = st.one_of(
    st.builds(WireRequest, PATHS, st.builds(encode, st.one_of(RANDOM_JSON, HOSTILE), st.booleans())),
    st.builds(WireRequest, PATHS, st.sampled_from([
        b"", b" ", b"null", b"{", b'{"messages": [', b"{}}", b'{"model": "x"} trailing', b"\xff\xfe\x00{",
        b"\x00\x00\x00{", b"not json", b"{'single': 'quotes'}", b'{"a": 1, "a": 2}',
        b"[" * 100_000, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}' * 2,
    ])),
    st.builds(WireRequest, PATHS, st.builds(encode, st.one_of(VALID_CHAT, VALID_COMPLETION), st.booleans()),
              CONTENT_TYPES),
    st.builds(WireRequest, PATHS, st.binary(max_size=64),
              st.one_of(st.just("application/json"), CONTENT_TYPES)),
    # a body over max_body_bytes (8 MiB by default)
    st.builds(lambda path: WireRequest(path, b'{"prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}'), PATHS),
)
WIRE_REQUESTS = st.one_of(JSON_REQUESTS, JSON_REQUESTS, JSON_REQUESTS, ODD_REQUESTS)


# ----- what every answer must be


def assert_openai_error(response) -> None:
    """A 4xx whose body is {"error": {"message": str, "type": str, "param", "code"}}."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:2000])
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    error = ErrorResponse.model_validate(body).error
    assert error.message and error.type, body


def assert_valid_completion(path: str, response) -> None:
    """A 200 carrying a full response, or an SSE stream of valid chunks ending in [DONE]."""
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in response.text.split("\n\n") if e]
        assert events and events[-1] == "data: [DONE]", response.text[-2000:]
        chunk_model = ChatCompletionChunk if path == CHAT else CompletionChunk
        chunks = []
        for event in events[:-1]:
            assert event.startswith("data: "), event
            payload = json.loads(event.removeprefix("data: "))
            assert "error" not in payload, payload  # an error after the headers went out
            chunks.append(chunk_model.model_validate(payload))
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
        assert len(finals) == 1, response.text[-2000:]
        return
    response_model = ChatCompletionResponse if path == CHAT else CompletionResponse
    completion = response_model.model_validate(response.json())
    assert completion.choices[0].finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def assert_answer(request: WireRequest, response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:2000])
    if response.status_code == 200:
        assert_valid_completion(request.path, response)
    else:
        assert_openai_error(response)


def assert_serving_and_idle(http, wait_until_idle) -> None:
    ok = http.post(CHAT, json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}],
                               "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text
    ChatCompletionResponse.model_validate(ok.json())
    usage = wait_until_idle()
    assert usage.num_requests == 0


# ----- the fuzzers


def test_http_fuzz_never_answers_5xx(http, wait_until_idle):
    print(f"fuzz seed: {FUZZ_SEED} (HYBRID_SERVE_FUZZ_SEED={FUZZ_SEED} replays it), "
          f"{HTTP_EXAMPLES} examples")
    answers: Counter[str] = Counter()

    @settings(FUZZ_SETTINGS, max_examples=HTTP_EXAMPLES)
    @seed(FUZZ_SEED)
    @given(request=WIRE_REQUESTS)
    def fuzz(request: WireRequest) -> None:
        headers = {} if request.content_type is None else {"content-type": request.content_type}
        response = http.post(request.path, content=request.content, headers=headers)
        note(f"answer: {response.status_code} {response.text[:500]!r}")
        answers[f"{request.path} {response.status_code}"] += 1
        assert_answer(request, response)

    fuzz()
    print("answers:", dict(sorted(answers.items())))
    # the strategies reach both the engine and the refusals, on both routes
    for path in (CHAT, COMPLETIONS):
        assert answers[f"{path} 200"] and answers[f"{path} 400"], answers
    assert_serving_and_idle(http, wait_until_idle)


def handle_value(value):
    """Raw JSON splices have no Python object; the handle gets a stand-in of the same kind."""
    if isinstance(value, Raw):
        return [[[[1]]]] if value.text.startswith((b"[", b"{")) else value.text.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {k: handle_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [handle_value(v) for v in value]
    return value


HANDLE_REQUESTS = st.tuples(
    st.one_of(st.tuples(st.just(ChatCompletionRequest), CHAT_BODIES),
              st.tuples(st.just(CompletionRequest), COMPLETION_BODIES)),
    st.sampled_from(["validate", "construct", "dict"]),
    st.booleans(),
)


def test_handle_fuzz_raises_only_4xx_api_errors(app_handle, http, wait_until_idle):
    """Typed requests through the handle: validated ones (a ValidationError at construction is
    the caller's own typed error), objects built with model_construct (never validated) and
    plain dicts. Every failure must be an APIError with a 4xx status."""
    print(f"fuzz seed: {FUZZ_SEED} (HYBRID_SERVE_FUZZ_SEED={FUZZ_SEED} replays it), "
          f"{HANDLE_EXAMPLES} examples")
    outcomes: Counter[str] = Counter()

    @settings(FUZZ_SETTINGS, max_examples=HANDLE_EXAMPLES)
    @seed(FUZZ_SEED)
    @given(case=HANDLE_REQUESTS)
    def fuzz(case) -> None:
        (model, body), how, stream = case
        body = handle_value(body)
        if how == "validate":
            try:
                request = model.model_validate(body)
            except ValidationError:
                outcomes["refused at construction"] += 1
                return
        elif how == "construct":
            request = model.model_construct(**{k: v for k, v in body.items() if isinstance(k, str)})
        else:
            request = body
        chat = model is ChatCompletionRequest
        try:
            if stream:
                method = app_handle.options(stream=True).chat_stream if chat else \
                    app_handle.options(stream=True).completions_stream
                chunks = list(method.remote(request))
                assert all(isinstance(c, ChatCompletionChunk if chat else CompletionChunk) for c in chunks)
            else:
                method = app_handle.chat if chat else app_handle.completions
                result = method.remote(request).result()
                assert isinstance(result, ChatCompletionResponse if chat else CompletionResponse)
            outcomes[f"{how}: completed"] += 1
        except APIError as exc:
            outcomes[f"{how}: APIError {exc.status_code}"] += 1
            assert 400 <= exc.status_code < 500, exc
            assert exc.message and exc.type

    fuzz()
    print("outcomes:", dict(sorted(outcomes.items())))
    assert outcomes["validate: completed"] and outcomes["construct: APIError 400"], outcomes
    assert_serving_and_idle(http, wait_until_idle)


@pytest.mark.parametrize("ascii_only", [True, False])
def test_encode_splices_raw_json_and_writes_nan_literals(ascii_only):
    """The fuzzer's own encoder: what the server receives is what the strategies meant."""
    data = encode({"a": Raw(b"[[1]]"), "t": math.nan, "i": -math.inf, "s": "\ud800"}, ascii_only)
    assert data.startswith(b'{"a": [[1]], "t": NaN, "i": -Infinity, "s": ')
    assert data.endswith(b'"\\ud800"}' if ascii_only else b'"\xed\xa0\x80"}')
