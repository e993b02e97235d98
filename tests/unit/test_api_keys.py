"""API keys and tenants (deployments/http/api_keys.py), without Serve: loading, the 401s, the
tenant scoping of cache salts, and the middleware in front of a small FastAPI app."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from deployments.http.api_keys import (
    API_KEYS_ENV, TENANT_SCOPE, ApiKeyMiddleware, ApiKeys, scoped_cache_salt, tenant_id,
)
from deployments.http.errors import APIError


def test_no_key_configured_leaves_the_api_open():
    assert not ApiKeys.load(environ={}).enabled


def test_keys_come_from_the_environment_and_the_file(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# operators\nkey-from-file\n\n")
    keys = ApiKeys.load(str(keys_file), environ={API_KEYS_ENV: " key-a , key-b,"})
    assert {keys.tenant_of(f"Bearer {k}") for k in ("key-a", "key-b", "key-from-file")} == {
        tenant_id("key-a"), tenant_id("key-b"), tenant_id("key-from-file")}


def test_a_keys_file_that_is_missing_or_empty_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        ApiKeys.load(str(tmp_path / "absent"), environ={})
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys.load(str(empty), environ={})


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic key-a", "key-a",
                                    "Bearer key-b", "Bearer key-a2"])
def test_missing_malformed_or_unknown_keys_get_401(header):
    keys = ApiKeys.load(environ={API_KEYS_ENV: "key-a"})
    with pytest.raises(APIError) as refused:
        keys.tenant_of(header)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert "key-a" not in refused.value.message


def test_each_key_is_its_own_tenant_and_salts_never_cross_tenants():
    keys = ApiKeys.load(environ={API_KEYS_ENV: "key-a,key-b"})
    a, b = keys.tenant_of("Bearer key-a"), keys.tenant_of("bearer key-b")
    assert a != b and "key" not in a
    assert scoped_cache_salt("", "s") == "s" and scoped_cache_salt("", None) is None
    assert scoped_cache_salt(a, None) != scoped_cache_salt(b, None)
    # whatever salt b sends, its scoped salt starts with b's id, so it cannot equal one of a's
    crafted = scoped_cache_salt(a, "x")
    assert scoped_cache_salt(b, crafted) != crafted and scoped_cache_salt(b, crafted).startswith(b)


def _app(keys: ApiKeys) -> TestClient:
    app = FastAPI()
    app.add_middleware(ApiKeyMiddleware)
    app.state.api_keys = keys

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return {"tenant": request.scope.get(TENANT_SCOPE), "body": await request.json()}

    return TestClient(app)


def test_the_middleware_guards_every_route_but_health_before_the_body_is_read():
    client = _app(ApiKeys.load(environ={API_KEYS_ENV: "key-a"}))
    assert client.get("/health").status_code == 200
    refused = client.post("/v1/completions", content=b"{not json")  # no key, malformed body
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == "Bearer"
    assert refused.json()["error"]["code"] == "invalid_api_key"
    wrong = client.post("/v1/completions", json={}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "nope" not in wrong.text
    ok = client.post("/v1/completions", json={"x": 1}, headers={"Authorization": "Bearer key-a"})
    assert ok.status_code == 200 and ok.json() == {"tenant": tenant_id("key-a"), "body": {"x": 1}}


def test_without_keys_the_middleware_lets_everything_through_unscoped():
    client = _app(ApiKeys())
    answer = client.post("/v1/completions", json={})
    assert answer.status_code == 200 and answer.json()["tenant"] == ""
