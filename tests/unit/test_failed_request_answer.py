"""What a client learns when the engine fails its request (tests/engine/test_step_faults.py
shows which request fails): a 500 with an OpenAI error body that names the request id and no
exception, message or other internals of the server."""

from __future__ import annotations

import json

import pytest

from deployments.http.errors import APIError, as_api_error, error_json
from deployments.http.openai_format import raise_if_failed
from engine.core.llm_engine import FAILED_REQUEST_MESSAGE
from engine.core.output_processor import RequestOutput

INTERNALS = ("RuntimeError", "Traceback", "worker.py", "injected", "CUDA")


def failed(error: str) -> RequestOutput:
    return RequestOutput("chatcmpl-42", (), "", True, "error", 7, 3, error=error)


@pytest.mark.parametrize("error", [FAILED_REQUEST_MESSAGE,
                                   "RuntimeError: injected at worker.py:12 (CUDA error)"])
def test_an_engine_failure_is_a_500_naming_the_request_and_no_internals(error):
    with pytest.raises(APIError) as raised:
        raise_if_failed(failed(error))
    body = json.loads(error_json(raised.value).body)["error"]
    assert raised.value.status_code == 500 and body["type"] == "server_error"
    assert "chatcmpl-42" in body["message"]
    assert not any(word in body["message"] for word in INTERNALS), body["message"]


def test_an_unknown_exception_is_a_500_without_its_name_or_message():
    error = as_api_error(KeyError("secret internals at worker.py"))
    assert error.status_code == 500 and error.message == "Internal server error"
