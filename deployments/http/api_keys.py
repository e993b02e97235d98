"""Optional API keys: who may call the HTTP API, and whose checkpoints a request may share.

Keys come from the environment variable HYBRID_SERVE_API_KEYS (comma separated) and/or the
file AppConfig.api_keys_file (one key a line; blank lines and lines starting with # are
skipped), read when the ingress replica starts. With no key configured the API is open. With
keys, every HTTP route but /health needs `Authorization: Bearer <key>` (ApiKeyMiddleware);
anything else is answered 401 with an OpenAI error body, before the body is read.

Each key is a tenant: its id is a digest of the key, and the ingress puts it in front of the
request's cache_salt (scoped_cache_salt), so a tenant's checkpoints are shared only among its
own requests; a cache_salt narrows that further and can never reach another tenant's (every
scoped salt starts with the fixed-length id of its tenant). Only digests of the keys are kept;
no key is logged, exported or echoed in an error. Python handle calls (DeploymentHandle) are
in-cluster code and are not checked; they use the unscoped namespace.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from deployments.http.errors import APIError, send_error

API_KEYS_ENV = "HYBRID_SERVE_API_KEYS"
TENANT_SCOPE = "hybrid_serve.tenant"  # the ASGI scope key the middleware sets
TENANT_ID_CHARS = 16


@dataclass(frozen=True)
class ApiKeys:
    """The configured keys, as (digest, tenant id) pairs; empty: the API is open."""

    digests: tuple[tuple[bytes, str], ...] = ()

    @classmethod
    def load(cls, keys_file: str | None = None, environ: dict | None = None) -> ApiKeys:
        """Keys from the environment and `keys_file`. Raises ValueError when the file cannot be
        read or holds no key (a file given by mistake must not leave the API open)."""
        environ = os.environ if environ is None else environ
        keys = [key.strip() for key in environ.get(API_KEYS_ENV, "").split(",") if key.strip()]
        if keys_file is not None:
            try:
                lines = Path(keys_file).read_text().splitlines()
            except OSError as exc:
                raise ValueError(f"api_keys_file {keys_file!r} cannot be read: {exc.strerror}") from None
            from_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
            if not from_file:
                raise ValueError(f"api_keys_file {keys_file!r} holds no key")
            keys += from_file
        return cls(tuple((_digest(key), tenant_id(key)) for key in dict.fromkeys(keys)))

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def tenant_of(self, authorization: str | None) -> str:
        """The tenant id of a `Bearer <key>` header; raises APIError 401 for a missing or
        unknown key. Compares digests in constant time, every configured key each call."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
        presented = _digest(key.strip())
        tenant = ""
        for digest, candidate in self.digests:
            if hmac.compare_digest(presented, digest):
                tenant = candidate
        if not tenant:
            raise unauthorized("Incorrect API key provided.")
        return tenant


def tenant_id(key: str) -> str:
    """A tenant's public id: the first TENANT_ID_CHARS hex digits of a digest of its key."""
    return hashlib.sha256(b"hybrid-serve tenant\0" + key.encode()).hexdigest()[:TENANT_ID_CHARS]


def scoped_cache_salt(tenant: str, cache_salt: str | None) -> str | None:
    """The cache salt the engine sees: the request's own without keys, else the tenant's id,
    then the request's salt."""
    if not tenant:
        return cache_salt
    return f"{tenant}:{cache_salt or ''}"


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "invalid_request_error", None, "invalid_api_key")


class ApiKeyMiddleware:
    """ASGI middleware: with keys configured (scope["app"].state.api_keys, set by the ingress
    replica), answers 401 to any HTTP request but GET /health without a valid key, and records
    the caller's tenant id in the scope (TENANT_SCOPE) for the routes."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            keys: ApiKeys = getattr(scope["app"].state, "api_keys", ApiKeys())
            tenant = ""
            if keys.enabled and not scope["path"].endswith("/health"):
                headers = dict(scope.get("headers") or [])
                authorization = headers.get(b"authorization", b"").decode("utf-8", "replace")
                try:
                    tenant = keys.tenant_of(authorization)
                except APIError as exc:
                    await send_error(scope, receive, send, exc, {"WWW-Authenticate": "Bearer"})
                    return
            scope[TENANT_SCOPE] = tenant
        await self.app(scope, receive, send)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
