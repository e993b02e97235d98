"""Checkpoint-aware request routing for the LLM server (a Ray Serve custom request router).

Serve runs one router per deployment handle, in the process that holds the handle: on the
classic path the ingress replica, for `LLMServer.generate`; on the lean path the ingress
request router (deployments/cluster/ingress_router.py), which HAProxy asks where each HTTP
request goes. For each request this router:

1. reads the GenerationRequest from the call's arguments, or the PromptKey the ingress request
   router rendered from the HTTP body (the renderer's token ids, the cache_salt: the engine's
   namespace is (model_dir, cache_salt or "")),
2. looks up, in its local mirror of the application's cluster index (deployments/
   index_mirror.py; no actor call per request), the replicas that hold the longest checkpoint
   whose tokens are a prefix of the prompt,
3. sends the request to the least loaded of those holders whose queue length (requests in
   flight there, probed for each request) is below `queue_threshold`,
4. when no replica holds a prefix yet (or the mirror is not current: its first sync, the index
   down) but the request has an instruction boundary, sends it where this router sent the
   same instructions (namespace and tokens up to the boundary) in the last PLACEMENT_TTL_S
   seconds, if that replica is below the threshold ("recent placement"): the first requests of a new system prompt then meet on one replica, which
   captures its checkpoint once, instead of each replica computing it before the index
   hears of the first capture. The first of them goes to the less loaded of power-of-two's
   pair, probed here, and is remembered;
5. sends it to a random pair of the other replicas when every holder is at the threshold or
   above ("overloaded"),
6. and otherwise leaves it to Serve's power-of-two choices: no holder, no token ids, a call
   that is not a generation (model info, pool usage), or no current mirror (index actor down),
   for requests without an instruction boundary.

Power-of-two choices is also the rank after the holders: a holder that turns out full
(max_ongoing_requests) passes the request on to it in the same routing attempt. A digest
collision or a stale index entry sends a request to a replica without the checkpoint: a
miss there (the engine compares exact tokens), never a wrong answer.

Unlike Ray Serve LLM's PrefixCacheAffinityRouter, which matches request text against a tree
of text the router itself sent (a guess of what each replica caches, per router), this one
matches the renderer's token ids against what each replica reports it actually holds, and
every router of the application shares that one picture; the recent placements are the one
guess it makes, per router, for the seconds before the index confirms a capture
(benchmarks/cluster_routing.py compares both).

Built on Ray 2.60's RequestRouter API (ray.serve.request_router); the power-of-two fallback
calls Serve's PowerOfTwoChoicesRequestRouter.choose_replicas (ray.serve._private). Serve
pickles this module by value into every process that routes (RequestRouterConfig), so the
types a caller passes in (GenerationRequest, PromptKey) live in other modules: a class of this
module would be a copy there, and isinstance would never match.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from cache.checkpoint_keys import Namespace
from cache.index_messages import LookupResult, token_digest
from deployments.cluster.index import get_index
from deployments.cluster.index_mirror import ActorIndexSource, IndexMirror
from deployments.cluster.prompt_key import PromptKey
from deployments.metrics import RoutingMetrics
from engine.interfaces.generation_request import GenerationRequest

logger = logging.getLogger("ray.serve")

Reason = Literal["holder", "recent_placement", "no_holder", "overloaded", "no_tokens",
                 "index_unavailable"]
COUNTED_REQUEST_IDS = 4096  # requests remembered so a retried routing attempt is counted once
# How long a placement stands in for the index: the capture, the replica's next report and the
# mirror's next sync take about a second or two; beyond this the index knows, or it was evicted.
PLACEMENT_TTL_S = 10.0
MAX_PLACEMENTS = 4096


class RecentPlacements:
    """Where this router recently sent each set of instructions: digest of (namespace, the
    prompt up to its instruction boundary) -> (replica id, when), at most MAX_PLACEMENTS,
    each for PLACEMENT_TTL_S seconds. A guess: a wrong one costs a miss, never a wrong answer."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._placed: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    @staticmethod
    def key(namespace: tuple[str, str], request: GenerationRequest | PromptKey) -> bytes | None:
        """The placement key of a request with an instruction boundary, else None."""
        boundary = request.instruction_boundary
        if not boundary:
            return None
        return token_digest(request.prompt_token_ids[:boundary]) + "\0".join(namespace).encode()

    def get(self, key: bytes) -> str | None:
        placed = self._placed.get(key)
        if placed is None or self._clock() - placed[1] > PLACEMENT_TTL_S:
            return None
        return placed[0]

    def record(self, key: bytes, replica_id: str) -> None:
        self._placed[key] = (replica_id, self._clock())
        self._placed.move_to_end(key)
        while len(self._placed) > MAX_PLACEMENTS:
            self._placed.popitem(last=False)


@dataclass(frozen=True)
class HolderChoice:
    """What the lookup decided: the holders to try first (least loaded first; empty for a
    fallback) and why."""

    replica_ids: tuple[str, ...]
    reason: Reason
    matched_tokens: int = 0
    overloaded: frozenset[str] = frozenset()  # the holders at the threshold or unanswered


def choose_holders(match: LookupResult | None, queue_lens: dict[str, int | None],
                   queue_threshold: int) -> HolderChoice:
    """The holders of `match` whose queue length is known and below `queue_threshold`,
    least loaded first. match None: no current index. A holder whose queue length is unknown
    (it did not answer a probe) counts as overloaded."""
    if match is None:
        return HolderChoice((), "index_unavailable")
    if not match.replica_ids:
        return HolderChoice((), "no_holder")
    ready = sorted((queue_lens[r], r) for r in match.replica_ids
                   if queue_lens.get(r) is not None and queue_lens[r] < queue_threshold)
    if not ready:
        return HolderChoice((), "overloaded", match.length, frozenset(match.replica_ids))
    return HolderChoice(tuple(r for _, r in ready), "holder", match.length)


def generation_request(pending_request: PendingRequest | None) -> GenerationRequest | PromptKey | None:
    """The GenerationRequest a `generate` call carries, or the PromptKey an ingress request
    router's pick carries; None for anything else (another method)."""
    if pending_request is None:
        return None
    args = list(pending_request.args or ()) + list((pending_request.kwargs or {}).values())
    return next((a for a in args if isinstance(a, (GenerationRequest, PromptKey))), None)


class CheckpointAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Set with RequestRouterConfig(request_router_class=CheckpointAwareRouter,
    request_router_kwargs={"model_dir": ..., "queue_threshold": ...}) (deployments/app.py)."""

    def initialize_state(self, model_dir: str, queue_threshold: int,
                         app_name: str | None = None) -> None:
        """model_dir: the engine's config.model_dir (the first half of its namespace).
        queue_threshold: a holder with this many requests in flight or more is overloaded.
        app_name: whose index to mirror (default: this deployment's application)."""
        self._model_dir = model_dir
        self._queue_threshold = queue_threshold
        app = app_name or self._deployment_id.app_name

        async def connect() -> ActorIndexSource:
            return ActorIndexSource(await asyncio.to_thread(get_index, app))

        self._mirror = IndexMirror(connect)
        try:  # sync before the first request where the router starts on a running loop
            self._mirror.start()
        except RuntimeError:  # no running loop here: the first routed request starts it
            pass
        self._placements = RecentPlacements()
        self._metrics = RoutingMetrics()
        self._counted: OrderedDict[str, None] = OrderedDict()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        """[holders below the threshold, then power-of-two's pair]; [a random pair of the
        other replicas, then power-of-two's pair] when every holder is overloaded; else
        power-of-two's pair."""
        request = generation_request(pending_request)
        choice = HolderChoice((), "no_tokens")
        if request is not None and candidate_replicas:
            try:
                choice = await self._choose_holders(request, candidate_replicas)
            except Exception:  # never let routing fail a request: fall back
                logger.warning("checkpoint-aware routing failed; using power-of-two choices",
                               exc_info=True)
                choice = HolderChoice((), "index_unavailable")
            self._count(pending_request, choice.reason)
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas=candidate_replicas, pending_request=pending_request)
        if choice.reason == "overloaded":
            # Serve's power-of-two draws from all the deployment's replicas, whatever
            # candidates it is given, and its cached counts may not show the holders full:
            # first a random pair of the other replicas, then Serve's pair as a last resort.
            others = [r for r in candidate_replicas if r.replica_id.unique_id not in choice.overloaded]
            return ([random.sample(others, min(2, len(others)))] if others else []) + fallback
        if not choice.replica_ids:
            return fallback
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[r] for r in choice.replica_ids], *fallback]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's update; replicas that left are forgotten by the index too."""
        before = set(self._replica_id_set)
        super().update_replicas(replicas)
        self._mirror.forget_replicas(r.unique_id for r in before - set(self._replica_id_set))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._mirror.forget_replicas([replica_id.unique_id])

    # ---- internals ----------------------------------------------------------------------------

    async def _choose_holders(self, request: GenerationRequest | PromptKey,
                              candidates: list[RunningReplica]) -> HolderChoice:
        if not request.prompt_token_ids:
            return HolderChoice((), "no_tokens")
        self._mirror.start()
        by_id = {r.replica_id.unique_id: r for r in candidates}
        namespace = Namespace.of(self._model_dir, request.cache_salt)
        match = self._mirror.lookup(namespace, request.prompt_token_ids, among=by_id)
        queue_lens: dict[str, int | None] = {}
        if match is not None and match.replica_ids:
            queue_lens = await self._queue_lens([by_id[r] for r in match.replica_ids])
        choice = choose_holders(match, queue_lens, self._queue_threshold)
        key = RecentPlacements.key(namespace, request)
        if choice.reason not in ("no_holder", "index_unavailable") or key is None:
            return choice
        return await self._place(key, candidates, by_id, choice.reason) or choice

    async def _place(self, key: bytes, candidates: list[RunningReplica],
                     by_id: dict[str, RunningReplica], reason: Reason) -> HolderChoice | None:
        """Instructions no replica is known to hold (none does, or the mirror is not current:
        its first sync, the index down): their recent placement if it is below the threshold;
        else the less loaded of a fresh power-of-two pair, remembered, with `reason`. None:
        leave it to power-of-two choices (nothing answered the probe)."""
        placed = self._placements.get(key)
        if placed is not None and placed in by_id:
            queue_len = (await self._queue_lens([by_id[placed]])).get(placed)
            if queue_len is not None and queue_len < self._queue_threshold:
                return HolderChoice((placed,), "recent_placement")
        (pair, *_) = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas=candidates) or [[]]
        lens = {r: n for r, n in (await self._queue_lens(pair)).items() if n is not None}
        if not lens:
            return None
        chosen = min(lens, key=lambda r: (lens[r], r))
        self._placements.record(key, chosen)
        return HolderChoice((chosen,), reason)

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[str, int | None]:
        """Each holder's requests in flight, probed now (None when it does not answer in
        time). Not Serve's cached counts: a replica's answer to an earlier send can land after
        the router counted that send, and then the cache is one short, which sent requests to
        a holder already at the threshold (tests/cluster_checkpoints). One probe of the
        holders per routed request: a round trip of about a millisecond, against the prefill
        a hit saves."""
        probed = await self._probe_queue_lens(replicas, 0)
        return {replica.replica_id.unique_id: queue_len for replica, queue_len in probed}

    def _count(self, pending_request: PendingRequest, reason: Reason) -> None:
        """Record the decision once per request (a request Serve routes again after every
        candidate was full comes back here)."""
        request_id = pending_request.metadata.internal_request_id
        if request_id in self._counted:
            return
        self._counted[request_id] = None
        if len(self._counted) > COUNTED_REQUEST_IDS:
            self._counted.popitem(last=False)
        try:
            self._metrics.record(reason)
        except Exception:
            logger.warning("recording a routing metric failed", exc_info=True)
