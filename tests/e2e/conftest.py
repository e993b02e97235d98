"""End-to-end fixtures: the whole application under Ray Serve, started once per session.

Every test in this directory is marked `e2e`. The session's app itself (`serve_app`), its
variants (`deploy_variant`), its openai `client`, `new_salt` and `tokenizer` live in
serve_fixtures.py, shared with the other Serve test directories; the fixtures here are this
directory's other clients and probes.
"""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest

from tests.e2e.serve_fixtures import APP_NAME, BASE_URL, E2E_CONFIG, MODEL_NAME, PORT  # noqa: F401


def pytest_collection_modifyitems(items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def app_handle(serve_app):
    """The Python handle API, obtained the way applications obtain it."""
    from ray import serve

    return serve.get_app_handle(APP_NAME)


@pytest.fixture(scope="session")
def make_async_client(serve_app):
    """A factory: AsyncOpenAI clients are bound to the event loop they first run on."""

    def make() -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0,
                                  timeout=120)

    return make


@pytest.fixture(scope="session")
def http(serve_app):
    with httpx.Client(base_url=BASE_URL, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def render_ids(tokenizer):
    """Prompt ids computed independently of the server (the chat template call the renderer makes)."""

    def render(messages) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))

    return render


@pytest.fixture(scope="session")
def wait_until_idle(app_handle):
    """Poll the engine's pools until no request holds blocks or a state slot (checkpoints may
    still hold blocks: `usage.idle`); return the usage."""

    def wait(timeout_s: float = 20.0):
        deadline = time.monotonic() + timeout_s
        while True:
            usage = app_handle.pool_usage.remote().result()
            if usage.num_requests == 0 and usage.idle:
                return usage
            if time.monotonic() > deadline:
                raise AssertionError(f"pools did not return to idle within {timeout_s}s: {usage}")
            time.sleep(0.1)

    return wait
