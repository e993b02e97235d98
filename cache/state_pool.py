"""A pool of recurrent-state slots (pure Python).

Each running request owns exactly one slot: the row of every Mamba layer's conv and SSM state
tensors that holds its recurrence. The pool only tracks ownership; the tensors live in the worker.
"""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free slot, or None when every slot is in use."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._in_use.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._in_use:
            raise ValueError(f"state slot {slot} is not in use")
        self._in_use.remove(slot)
        self._free.append(slot)
