"""Fetch or recompute: whether a replica should fetch a stored checkpoint copy before a request.

A stored copy (the object-store tier, deployments/cluster/object_copies.py) covering more of a
prompt than the replica's own longest checkpoint saves `tokens_saved` prefill tokens and costs
moving `num_bytes` (object store to this replica, then an import). Fetching pays when

    num_bytes / fetch bandwidth  <  tokens_saved / prefill rate
    <=>  tokens_saved / MiB  >  prefill rate (tokens/s) / fetch bandwidth (MiB/s)

so one ratio, `min_tokens_per_mib`, states the break-even for a deployment: measure its
prefill rate and object-store bandwidth, or start from the defaults in deployments/config.py
(README.md, Checkpoints across replicas). `min_tokens` covers what does not scale with bytes
(a fetch's round trips and the import's step-thread turn): fewer tokens saved are recomputed.
Pure: no Ray, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MIB = 1024 * 1024

FetchChoice = Literal["fetch", "recompute"]


@dataclass(frozen=True)
class FetchPolicy:
    """min_tokens_per_mib >= 0 (0: fetch whatever saves min_tokens); min_tokens >= 1."""

    min_tokens_per_mib: float
    min_tokens: int = 1

    def __post_init__(self) -> None:
        if self.min_tokens_per_mib < 0 or self.min_tokens < 1:
            raise ValueError(f"bad fetch policy {self}")

    def decide(self, tokens_saved: int, num_bytes: int) -> FetchChoice:
        """"fetch" when fetching `num_bytes` to skip `tokens_saved` prefill tokens pays (see
        the module doc); "recompute" otherwise, and whenever nothing is saved."""
        if tokens_saved < self.min_tokens:
            return "recompute"
        if num_bytes <= 0:
            return "fetch"
        return "fetch" if tokens_saved * MIB >= self.min_tokens_per_mib * num_bytes else "recompute"
