"""Checkpoints held elsewhere: the contract between the scheduler and a checkpoint source.

This engine's own published checkpoints are the first place a request's prefix is looked up
(CheckpointPolicy.lookup, which pins what it finds). A CheckpointSource is any other place that
may hold a longer one: the object-store tier shared by the replicas (deployments/cluster/
tier.py) and the host tier (engine/checkpoints/host_tier.py), asked first. Every source answers
the same question in the same way,
at the same moment: when the scheduler is about to admit a request for the first time.

    Scheduler (step thread)                 CheckpointSource
      admission of a request   -- lookup(namespace, token_ids, have) -->  None: nothing longer,
                                                                          or not worth fetching
                               <-- CheckpointFetch (already started) --
      the request leaves the waiting queue and waits in PrefixWaits.pending; the others step
      each step: fetch.done()? or past fetch.deadline?
      LLMEngine imports fetch.result() (checked in full), tells the source settle(...), and
      the request goes back to the head of the queue, where it restores the imported
      checkpoint like a local one; a failed, rejected or late fetch recomputes instead.

Nothing here waits: lookup returns at once, and the scheduler only polls. A source is called
on the engine's step thread and must be safe to call from it. Pure Python: no torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cache.checkpoint_keys import Namespace

if TYPE_CHECKING:
    from engine.checkpoints.transfer import ExportedCheckpoint
    from engine.interfaces.request import Request


class CheckpointFetch(Protocol):
    """A checkpoint on its way from a source. num_tokens: the prefix it covers; deadline: the
    time.monotonic() after which the engine stops waiting and recomputes; verified: the
    checkpoint never left this engine's process (the host tier), so its tensors may be on the
    engine's device already and its checksums are not recomputed on import."""

    num_tokens: int
    deadline: float
    verified: bool

    def done(self) -> bool:
        """The fetch has ended, with a checkpoint or without one. Never blocks."""

    def result(self) -> ExportedCheckpoint | None:
        """Once done: the checkpoint, or None when the fetch failed (the source counted why)."""

    def settle(self, accepted: bool, num_bytes: int) -> None:
        """The engine imported the result: published here (accepted), or rejected by its
        import checks (the source should not offer that copy again)."""

    def abandon(self) -> None:
        """The engine no longer waits for it (past its deadline, or its request ended). The
        source may let it finish for other requests; its result is not imported for this one."""


class CheckpointSource(Protocol):
    def lookup(self, namespace: Namespace, token_ids: tuple[int, ...], have: int) -> CheckpointFetch | None:
        """A fetch, already started, of a checkpoint in `namespace` whose tokens are a prefix
        of `token_ids` longer than `have` (the longest this engine holds), when the source has
        one and judges it worth fetching; None otherwise. Returns at once; never raises (a
        source that fails answers None)."""


@dataclass
class PendingFetch:
    """A request the scheduler took off its waiting queue to wait for `fetch`."""

    request: Request
    fetch: CheckpointFetch


@dataclass(frozen=True)
class FetchedCheckpoint:
    """A fetch that ended, handed to the engine to import: `checkpoint` None means there is
    nothing to import (the fetch failed or ran past its deadline) and the request recomputes."""

    request_id: str
    fetch: CheckpointFetch
    checkpoint: ExportedCheckpoint | None
