"""The output-token budget (engine.interfaces.sampling_params.output_budget): the one rule of how
many tokens a request may generate, which the engine's add_request and the ingress both ask.
Each case pins a value or a refusal (its param and, for the four refusals, the exact message
the HTTP 400 body carries); as_api_error turns a refusal into that body, across pickling."""

from __future__ import annotations

import pickle

import pytest

from engine.interfaces.sampling_params import InvalidRequestError, output_budget

# a server's limits, as RequestLimits holds them
LIMITS = {"max_prompt_tokens": 100, "max_output_tokens": 50}


@pytest.mark.parametrize("prompt, asked, context, limits, budget", [
    (10, 5, 1000, {}, 5),                 # asked, and it fits: what was asked
    (10, 990, 1000, {}, 990),             # prompt + max_tokens == max_model_len still fits
    (10, None, 1000, {}, 990),            # none asked, no server cap: the room the prompt leaves
    (100, None, 1000, LIMITS, 50),        # none asked: the server's cap, not the room (900)
    (100, None, 120, LIMITS, 20),         # none asked: the room, below the cap
    (100, 50, 1000, LIMITS, 50),          # at both server limits: accepted
    (999, None, 1000, {}, 1),             # one token of room
])
def test_the_budget(prompt, asked, context, limits, budget):
    assert output_budget(prompt, asked, context, **limits) == budget


# (prompt tokens, max_tokens, max_model_len, limits, param, message)
REFUSALS = [
    pytest.param(101, 1, 1000, LIMITS, "prompt",
                 "the prompt has 101 tokens; this server accepts at most 100 (max_prompt_tokens)",
                 id="prompt-beyond-max_prompt_tokens"),
    pytest.param(10, 51, 1000, LIMITS, "max_tokens",
                 "max_tokens is 51; this server generates at most 50 tokens a request (max_output_tokens)",
                 id="max_tokens-beyond-max_output_tokens"),
    pytest.param(100, None, 100, {}, "prompt",
                 "This model's maximum context length is 100 tokens; the prompt has 100 tokens, "
                 "leaving no room to generate.", id="no-room-none-asked"),
    pytest.param(120, 5, 100, {}, "prompt",
                 "This model's maximum context length is 100 tokens; the prompt has 120 tokens, "
                 "leaving no room to generate.", id="no-room-asked"),
    pytest.param(10, 991, 1000, {}, "max_tokens",
                 "This model's maximum context length is 1000 tokens. However, you requested 1001 "
                 "tokens (10 in the prompt, 991 for the completion).", id="beyond-the-context"),
    # the order of the checks: the server's limits before the context, the prompt first
    pytest.param(101, 51, 80, LIMITS, "prompt",
                 "the prompt has 101 tokens; this server accepts at most 100 (max_prompt_tokens)",
                 id="prompt-limit-first"),
    pytest.param(90, 51, 80, LIMITS, "max_tokens",
                 "max_tokens is 51; this server generates at most 50 tokens a request (max_output_tokens)",
                 id="output-limit-before-no-room"),
]


@pytest.mark.parametrize("prompt, asked, context, limits, param, message", REFUSALS)
def test_refusals_name_the_field_and_say_why(prompt, asked, context, limits, param, message):
    with pytest.raises(InvalidRequestError) as refused:
        output_budget(prompt, asked, context, **limits)
    assert (str(refused.value), refused.value.param) == (message, param)
    if param == "prompt":  # the chat API names its prompt field "messages"
        with pytest.raises(InvalidRequestError) as chat:
            output_budget(prompt, asked, context, **limits, prompt_param="messages")
        assert (str(chat.value), chat.value.param) == (message, "messages")


def test_a_refusal_is_the_http_400_body_the_ingress_sends():
    """The ingress's refusals reach as_api_error as they are, or (from the engine, through Ray)
    pickled: both give 400 invalid_request_error with the message and the param."""
    from deployments.http.errors import as_api_error

    with pytest.raises(InvalidRequestError) as refused:
        output_budget(30, None, 30, prompt_param="messages")
    for exc in (refused.value, pickle.loads(pickle.dumps(refused.value))):
        body = as_api_error(exc).to_response().model_dump()["error"]
        assert body == {"message": str(refused.value), "type": "invalid_request_error",
                        "param": "messages", "code": None}
