"""Integer index arrays of one step, built on the host with numpy instead of a Python loop per
token: the forward batch and the GPU plans are laid out from a few per-chunk numbers, so their
host cost grows with the chunks of a step, not with its tokens. Every array is int64.
to_device copies a step's arrays to the device in one copy that the host does not wait for.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain

import numpy as np
import torch


def int64_array(values: Iterable[int]) -> np.ndarray:
    """The values as a 1-D int64 array."""
    return np.fromiter(values, dtype=np.int64)


def flat_int64(sequences: Iterable[Sequence[int]]) -> np.ndarray:
    """The sequences concatenated into one 1-D int64 array."""
    return int64_array(chain.from_iterable(sequences))


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """arange(starts[0], starts[0] + lengths[0]), arange(starts[1], ...), ... concatenated: (sum(lengths),)."""
    ends_in_output = np.cumsum(lengths)
    first_in_output = ends_in_output - lengths
    total = int(ends_in_output[-1]) if len(lengths) else 0
    return np.repeat(starts - first_in_output, lengths) + np.arange(total, dtype=np.int64)


def range_index(lengths: np.ndarray) -> np.ndarray:
    """For each element of the concatenated ranges of `lengths`, the index of its range:
    (sum(lengths),), e.g. lengths 2, 1, 3 -> 0, 0, 1, 2, 2, 2."""
    return np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)


def cumulative_bounds(lengths: np.ndarray) -> np.ndarray:
    """0 and the running sums of lengths: (len(lengths) + 1,), the cu_seqlens of the ranges."""
    return np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(lengths, dtype=np.int64)))


def padded_rows(rows: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """(len(rows), width): row i is rows[i] cut to `width` values, then zero padded."""
    cut = [row[:width] for row in rows]
    lengths = int64_array([len(row) for row in cut])
    out = np.zeros((len(rows), width), dtype=np.int64)
    out[np.arange(width) < lengths[:, None]] = flat_int64(cut)  # fills row by row, in order
    return out


def chunk_pairs(lengths: np.ndarray, chunk: int) -> np.ndarray:
    """(2 NC,): the (sequence, chunk of that sequence) pair of each of the NC chunks of `chunk`
    rows that the sequences of `lengths` are cut into from their starts, in order, flattened
    (a (NC, 2) view of it is fla-core's varlen chunk_indices), e.g. lengths 3, 1 in chunks
    of 2 -> (0, 0), (0, 1), (1, 0)."""
    counts = -(-lengths // chunk)
    return np.stack([range_index(counts), concat_ranges(np.zeros_like(counts), counts)], axis=1).ravel()


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The int64 arrays on `device`, as views of one tensor filled by one copy, ordered on the
    stream before whatever is launched after it. Non-blocking: torch does not synchronise the
    stream after it, as a blocking .to(device) from pageable memory does (the host would wait
    for every kernel already queued; the driver itself may still wait while it stages the
    bytes). The driver has read the pageable bytes when the call returns, so the arrays may be
    dropped at once.

    Every view starts on a 16-byte boundary (each array padded to an even length in the
    packed tensor): Triton specialises pointer arguments on 16-byte alignment, so views at
    offsets that move with the batch's composition built a new variant of every kernel reading
    them, seconds each, mid-serving (benchmarks/ttft_anatomy.py, its burst's compile log)."""
    assert all(a.dtype == np.int64 for a in arrays), "to_device takes int64 arrays"
    lengths = [len(a) for a in arrays]
    starts = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([n + n % 2 for n in lengths], out=starts[1:])
    host = np.zeros(int(starts[-1]), dtype=np.int64)
    for array, start in zip(arrays, starts[:-1].tolist()):
        host[start:start + len(array)] = array
    packed = torch.from_numpy(host).to(device, non_blocking=True)
    return [packed[start:start + n] for start, n in zip(starts[:-1].tolist(), lengths)]
