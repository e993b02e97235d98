"""API keys through the whole application: an app deployed with api_keys_file answers 401
without a valid key (except /health), and each key's checkpoints serve only its own requests.

A private app of the session's Serve instance (deploy_variant), so the other tests' app stays
open.
"""

from __future__ import annotations

import httpx
import openai
import pytest

KEYS_APP = "hybrid-serve-e2e-keys"
KEYS_PREFIX = "/keys"
KEY_A, KEY_B = "tenant-a-secret-key", "tenant-b-secret-key"
MODEL_NAME = "hybrid-serve-tiny"
SYSTEM = "You answer questions about trains in one short, friendly sentence, and cite no sources."
USER_1 = "Which train goes to the coast on Sundays?"
USER_2 = "Is there a night train to the mountains, and does it carry bicycles?"
# About ten bundles of the tiny model (~150 KB each: states, attention tail, hidden row), so
# one tenant's traffic fills it; with two tenants each keeps five against the other.
CHECKPOINT_BUDGET_BYTES = 1_600_000


@pytest.fixture(scope="module")
def keyed(deploy_variant, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "api_keys"
    keys_file.write_text(f"# two tenants\n{KEY_A}\n{KEY_B}\n")
    anonymous = deploy_variant(KEYS_APP, KEYS_PREFIX, api_keys_file=str(keys_file),
                               worker_num_cpus=0.2,
                               engine={"checkpoint_cache_bytes": CHECKPOINT_BUDGET_BYTES})
    return str(anonymous.base_url).rstrip("/")


def client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def chat(c: openai.OpenAI, user: str):
    return c.chat.completions.create(
        model=MODEL_NAME, max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])


def test_every_route_but_health_needs_a_valid_key(keyed):
    root = keyed.removesuffix("/v1")
    with httpx.Client(timeout=120) as http:
        assert http.get(f"{root}/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                             ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")):
            refused = http.request(method, f"{root}{path}", json={"prompt": "x"})
            assert refused.status_code == 401, path
            assert refused.json()["error"]["code"] == "invalid_api_key"
        wrong = http.get(f"{root}/v1/models", headers={"Authorization": "Bearer not-a-key"})
        assert wrong.status_code == 401 and "not-a-key" not in wrong.text
        models = http.get(f"{root}/v1/models", headers={"Authorization": f"Bearer {KEY_A}"})
        assert models.status_code == 200
        metrics = http.get(f"{root}/metrics", headers={"Authorization": f"Bearer {KEY_B}"})
        assert metrics.status_code == 200
        assert KEY_A not in metrics.text and KEY_B not in metrics.text
    with pytest.raises(openai.AuthenticationError):
        chat(client(keyed, "not-a-key"), USER_1)


def test_a_tenants_checkpoints_serve_only_its_own_requests(keyed):
    tenant_a, tenant_b = client(keyed, KEY_A), client(keyed, KEY_B)
    assert cached(chat(tenant_a, USER_1)) == 0
    assert cached(chat(tenant_a, USER_2)) > 0  # a's instruction checkpoint serves a
    assert cached(chat(tenant_b, USER_2)) == 0  # but never b, same system prompt and all
    assert cached(chat(tenant_b, USER_1)) > 0  # b's own does


def test_a_tenant_filling_the_budget_evicts_only_its_own_checkpoints(keyed):
    """Tenant b sends twelve requests with twelve system prompts: three checkpoints each, far
    beyond the budget, so b's captures evict. Tenant a's instruction checkpoint, captured first
    and least recently used, lies within a's fair share (cache/checkpoint_ledger.py
    evict_until) and still serves a afterwards."""
    from ray import serve

    tenant_a, tenant_b = client(keyed, KEY_A), client(keyed, KEY_B)
    system_a = "You are a ferry timetable assistant: answer with departure times only, no prose."

    def ask(c, system, user):
        return c.chat.completions.create(
            model=MODEL_NAME, max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])

    assert cached(ask(tenant_a, system_a, "When is the first ferry?")) == 0
    stats = serve.get_app_handle(KEYS_APP).engine_stats.remote().result()
    evicted_before = sum(c.evicted for c in stats.checkpoints.values())
    for i in range(12):
        ask(tenant_b, f"You are helper number {i} of the harbour office; answer in one line.",
            f"Question {i}: where do I buy tickets?")
    stats = serve.get_app_handle(KEYS_APP).engine_stats.remote().result()
    assert sum(c.evicted for c in stats.checkpoints.values()) - evicted_before >= 10
    assert cached(ask(tenant_a, system_a, "And the last ferry of the day?")) > 0
