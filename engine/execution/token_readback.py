"""A step's sampled tokens on their way to the host, without waiting for the device.

The worker starts the copy right after sampling and reads it when the step is collected, so
it can launch the next step in between (engine/execution/worker.py, async scheduling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class TokenReadback:
    """Copies of a step's sampled tokens to the host, started without waiting for the device.
    On CUDA, a ring of `depth` pinned buffers, each with the event of its copy; on the
    CPU the tokens are on the host already."""

    def __init__(self, num_rows: int, device: torch.device, depth: int) -> None:
        """depth: how many copies may be unread at once (a buffer is reused `depth` copies on)."""
        self._cuda = device.type == "cuda"
        ring = depth if self._cuda else 0
        self._buffers = [torch.zeros(num_rows, dtype=torch.int64, pin_memory=True) for _ in range(ring)]
        self._next = 0

    def start(self, tokens: torch.Tensor) -> PendingTokens:
        """Begin the copy of `tokens` (n,) int64 (the caller may overwrite them once the device
        has passed this point: the copy is ordered before anything launched after it)."""
        if not self._cuda:
            return PendingTokens(tokens.clone(), None)
        host = self._buffers[self._next][: tokens.shape[0]]
        self._next = (self._next + 1) % len(self._buffers)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return PendingTokens(host, done)


@dataclass
class PendingTokens:
    """A copy started: the pinned tensor it lands in, and its event (None on the CPU)."""

    host: torch.Tensor
    done: torch.cuda.Event | None

    def read(self) -> list[int]:
        """Wait for the copy, then the tokens."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()
