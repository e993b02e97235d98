"""What names a checkpoint wherever it lives: the namespace it belongs to and its kind.

A namespace is (model directory, cache salt): two requests share checkpoints only when both
match, so a tenant that sets a cache_salt never restores another tenant's state. Every layer
(engine, cluster index, router, object-store tier) builds it with Namespace.of, the one place
that decides how a missing salt is spelled.
"""

from __future__ import annotations

from enum import Enum
from os import PathLike
from typing import NamedTuple


class Namespace(NamedTuple):
    """(model_dir, salt): a plain tuple on the wire, equal to ("dir", "salt")."""

    model_dir: str
    salt: str

    @classmethod
    def of(cls, model_dir: str | PathLike, salt: str | None) -> Namespace:
        """The namespace of a request to the model at `model_dir` with cache salt `salt`
        (None and "" are the same: no salt)."""
        return cls(str(model_dir), salt or "")


class CheckpointKind(str, Enum):
    """The request boundary a checkpoint was captured at (docs/design.md section 2)."""

    PROMPT = "prompt"  # after the last prompt token
    RESPONSE = "response"  # after the last computed token of a request that finished by stop or length
    INSTRUCTION = "instruction"  # after the leading system/developer messages (verified boundary)
    BREAKPOINT = "breakpoint"  # at a client's cache_control marker (verified like the instruction boundary)

    def __str__(self) -> str:  # "prompt", in labels, logs and f-strings alike
        return self.value
