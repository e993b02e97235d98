"""What checkpoint-aware routing reads of a request, without the request.

Its own module, not router.py: Serve pickles the router's module by value (RequestRouterConfig),
so a class defined there would be a different class in the process that routes, and the
isinstance check that finds the key among a call's arguments would never match.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptKey:
    """The lean path's ingress request router (deployments/cluster/ingress_router.py) renders
    the HTTP body into one and passes it to `DeploymentHandle.choose_replica`, where the
    CheckpointAwareRouter (deployments/cluster/router.py) reads it as it reads a
    GenerationRequest. The fields mean what GenerationRequest's do."""

    prompt_token_ids: tuple[int, ...]
    cache_salt: str | None = None
    instruction_boundary: int | None = None
