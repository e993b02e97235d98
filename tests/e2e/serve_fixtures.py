"""The Serve session every Serve test directory shares: one Serve instance and its main app
per pytest session (tests/e2e, tests/cluster_checkpoints).

Registered for the whole suite by tests/conftest.py (`pytest_plugins`), so each fixture here
exists once however many directories use it: a directory that deployed the app again would
redeploy it under the others. The app runs the embedded tiny model with a small config (short
context, 16 sequences) so the suite stays fast on a 2-core CPU box, with all four checkpoint
slots on. Tests that look at `cached_tokens` send their own fresh `cache_salt` (`new_salt`),
so checkpoints left by other tests can never hit them.
"""

from __future__ import annotations

import dataclasses
import os
import uuid

import pytest

from deployments.config import AppConfig
from engine.engine_config import EngineConfig

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
        checkpoint_slots=("prompt", "response", "instruction", "breakpoint"),
        checkpoint_cache_bytes=32 * 1024 * 1024,
    ),
)



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
    import openai
    from ray import serve

    from deployments.app import build_app

    deployed: list[str] = []

    def deploy(name: str, route_prefix: str, engine: dict | None = None, **overrides):
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
def client(serve_app):
    """An openai client of the session's app."""
    import openai

    return openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def new_salt():
    """A factory of cache_salts no other request uses: each a namespace of its own, empty at first."""

    def make() -> str:
        return f"test-{uuid.uuid4().hex}"

    return make


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(E2E_CONFIG.engine.model_dir)
