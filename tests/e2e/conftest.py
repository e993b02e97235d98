"""End-to-end fixtures: the whole application under Ray Serve, started once per session.

Every test in this directory is marked `e2e`. The app runs the embedded tiny model with a small
config (short context, 16 sequences) so the suite stays fast on a 2-core CPU box, with all three
checkpoint slots on. Tests that look at `cached_tokens` send their own fresh `cache_salt`
(`new_salt`), so checkpoints left by other tests can never hit them.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from deployments.config import AppConfig
from engine.config import EngineConfig

APP_NAME = "hybrid-serve-e2e"
MODEL_NAME = "hybrid-serve-tiny"
PORT = int(os.environ.get("HYBRID_SERVE_E2E_PORT", "8000"))
BASE_URL = f"http://127.0.0.1:{PORT}"

E2E_CONFIG = AppConfig(
    served_model_name=MODEL_NAME,
    engine=EngineConfig(
        max_model_len=512,
        block_size=16,
        max_num_batched_tokens=256,
        max_num_seqs=16,
        kv_cache_bytes=32 * 1024 * 1024,
        state_cache_bytes=32 * 1024 * 1024,
        checkpoint_slots=("prompt", "response", "instruction"),
        checkpoint_cache_bytes=32 * 1024 * 1024,
    ),
)


def pytest_collection_modifyitems(items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def serve_app(ray_session):
    """Deploy the app once; shut Serve down at the end of the session."""
    from ray import serve

    from deployments.app import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    try:
        handle = serve.run(build_app(E2E_CONFIG.model_dump()), name=APP_NAME, route_prefix="/")
        yield handle
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def deploy_variant(serve_app):
    """A factory: deploy E2E_CONFIG with `engine` overriding fields of its EngineConfig and
    `overrides` its other fields, as another app of the same Serve instance under
    `route_prefix`; returns an openai client for it. Deleted at the end of the test module,
    so that the variants of different modules never hold the session's CPUs together (a
    tensor-parallel variant's placement group would wait for them for ever)."""
    from ray import serve

    from deployments.app import build_app

    deployed: list[str] = []

    def deploy(name: str, route_prefix: str, engine: dict | None = None, **overrides) -> openai.OpenAI:
        engine_config = dataclasses.replace(E2E_CONFIG.engine, **(engine or {}))
        config = E2E_CONFIG.model_copy(update={**overrides, "engine": engine_config})
        serve.run(build_app(config.model_dump()), name=name, route_prefix=route_prefix)
        deployed.append(name)
        return openai.OpenAI(base_url=f"{BASE_URL}{route_prefix}/v1", api_key="unused",
                             max_retries=0, timeout=120)

    yield deploy
    for name in deployed:
        serve.delete(name)


@pytest.fixture(scope="session")
def app_handle(serve_app):
    """The Python handle API, obtained the way applications obtain it."""
    from ray import serve

    return serve.get_app_handle(APP_NAME)


@pytest.fixture(scope="session")
def client(serve_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0, timeout=120)


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
def tokenizer():
    return AutoTokenizer.from_pretrained(E2E_CONFIG.engine.model_dir)


@pytest.fixture(scope="session")
def render_ids(tokenizer):
    """Prompt ids computed independently of the server (the chat template call the renderer makes)."""

    def render(messages) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))

    return render


@pytest.fixture(scope="session")
def new_salt():
    """A factory of cache_salts no other request uses: each a namespace of its own, empty at first."""

    def make() -> str:
        return f"test-{uuid.uuid4().hex}"

    return make


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
