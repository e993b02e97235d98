"""Launch parameters of the paged prefill-attention kernel (paged_attention.py:_prefill_kernel).

A program of that kernel takes block_m queries of one chunk in heads_per_program (G) query heads
that share one KV head: a (G * block_m, D) tile, whose K/V tiles are loaded once for its rows.
K/V traffic therefore falls with the tile's rows, whether they come from queries or heads; heads
also fill the tile for short chunks, and keep a long chunk's causal edge at block_m queries.
The defaults here: every query head of a KV head in one program (the largest power of two that
divides H / Hkv), tiles of up to 128 rows for 16-bit inputs (64 for fp32), 8 warps at 128 rows,
and enough key splits for about two 64-row programs or one 128-row program per SM (a 128-row
tile's Q and K/V stages take most of an SM's shared memory). benchmarks/prefill_attention.py
compares G = 1 with the grouped default and sweeps launches: on the H200 (16 heads over 4 KV
heads) a 32-token message after an 8,192-token prefix takes 35.7 us a layer grouped against
50.0 us at one head a program (1.40x), 256 queries over 8,448 keys 78.6 against 82.9 us, and
the sweep's fastest launch for the latter is the default (4 heads x 32 queries, 8 warps, 4
splits).

Pure Python: importable and testable without Triton or a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def prefill_max_rows(dtype: torch.dtype) -> int:
    """Rows (queries x heads) of the prefill kernel's default tile: 128 for 16-bit inputs, 64
    for fp32 (whose Q and K/V stages would not fit in shared memory at 128)."""
    return 128 if dtype.itemsize <= 2 else 64


def prefill_heads_per_program(num_heads: int, num_kv_heads: int, max_rows: int = 128) -> int:
    """Query heads per program (G): the largest power of two that divides the heads per KV
    head, at most max_rows // 16 (a tile of 16-query blocks). 1 without GQA, and for 3 heads
    per KV head."""
    group = num_heads // num_kv_heads
    return min(group & -group, max_rows // 16)


def prefill_block_m(max_length: int, heads_per_program: int = 1, max_rows: int = 128) -> int:
    """Queries per program for chunks of at most max_length queries: 64 (16 for chunks of at
    most 32 queries), fewer where heads_per_program of them would pass max_rows rows, never
    under 16 (tl.dot's smallest tile). With G = 1: 64, or 16 for the short chunks."""
    return max(16, min(64 if max_length > 32 else 16, max_rows // heads_per_program))


def prefill_splits(num_programs: int, num_sms: int = 132, programs_per_sm: int = 2) -> int:
    """Key splits per query block (num_programs: query blocks over all chunks and head groups)
    so that the launch has about programs_per_sm programs per SM: 1 when the query blocks
    alone give that many, at most 8."""
    return max(1, min(8, (programs_per_sm * num_sms) // max(num_programs, 1)))


@dataclass(frozen=True)
class PrefillLaunch:
    """Launch parameters of the prefill kernel: G query heads x block_m queries a program."""

    heads_per_program: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int


def prefill_launch(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, max_length: int, num_chunks: int,
    heads_per_program: int | None = None, block_m: int | None = None, block_n: int = 64,
    num_warps: int | None = None, num_stages: int = 3, num_splits: int | None = None,
) -> PrefillLaunch:
    """paged_attention_prefill's launch for these shapes, each None replaced by its default:
    G from prefill_heads_per_program, block_m from prefill_block_m, 8 warps for tiles of 128
    rows or more (else 4), splits from prefill_splits at one such tile an SM (else two).
    Depends on the shapes only, never on chunk contents (a CUDA graph replays it)."""
    max_rows = prefill_max_rows(dtype)
    if heads_per_program is None:
        heads_per_program = prefill_heads_per_program(num_heads, num_kv_heads, max_rows)
    if block_m is None:
        block_m = prefill_block_m(max_length, heads_per_program, max_rows)
    wide = heads_per_program * block_m >= 128
    if num_warps is None:
        num_warps = 8 if wide else 4
    if num_splits is None:
        num_programs = -(-max_length // block_m) * num_chunks * (num_heads // heads_per_program)
        num_splits = prefill_splits(num_programs, programs_per_sm=1 if wide else 2)
    return PrefillLaunch(heads_per_program, block_m, block_n, num_warps, num_stages, num_splits)
