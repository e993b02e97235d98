"""Rows of a step's output kept by reference: a request's last hidden row, logits or sampled
token, read only when a capture, a commit or a drafter needs that one row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.interfaces.host_index import int64_array, to_device


@dataclass(frozen=True)
class RowRef:
    """Row `index` of `rows` (n, W), a step's output: a request's last hidden row (W = D),
    its logits (W = V) or their argmax (rows (n,)), kept by reference so a step of n requests
    does not slice n rows it mostly never needs alone (only a capture does)."""

    rows: torch.Tensor
    index: int
    owned: bool = False  # `rows` is no step's output (a copy, a restored row): nothing overwrites it

    def row(self) -> torch.Tensor:
        """(W,)"""
        return self.rows[self.index]

    def kept(self) -> RowRef:
        """This row, safe from the next forward pass (which overwrites a graph's outputs)."""
        return self if self.owned else RowRef(self.row()[None].clone(), 0, owned=True)


def gather_rows(refs: list[RowRef]) -> torch.Tensor:
    """(len(refs), W), or (len(refs),) from 1-D rows: the referenced rows in order, without
    waiting for the device. A decode step samples every row of its output in order: that
    tensor itself, with no launch; consecutive rows of one tensor (a prefill's last row): a
    view of them; other rows of one tensor: one gather (its index list copied to the device
    first, not waited for); otherwise one stack."""
    source = refs[0].rows
    if all(ref.rows is source for ref in refs):
        indices = [ref.index for ref in refs]
        if indices == list(range(source.shape[0])):
            return source
        first = indices[0]
        if indices == list(range(first, first + len(indices))):
            return source[first : first + len(indices)]
        (index,) = to_device([int64_array(indices)], source.device)
        return source.index_select(0, index)
    return torch.stack([ref.row() for ref in refs])
