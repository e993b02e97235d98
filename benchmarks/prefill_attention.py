"""The paged prefill-attention kernel on the restore + 256-token row's shape, over a sweep of
its launch parameters.

After an 8,192-token instruction checkpoint is restored, the user message's 256 queries attend
to 8,448 keys in each of the 1.5B config's 4 attention layers (16 query heads, 4 KV heads, head
dim 128, bf16) through engine/kernels/gpu/paged_attention.py:paged_attention_prefill. This
prints the time of each (block_m, block_n, num_warps, num_stages, num_splits) and marks the
engine's default. Times as in decode_kernels.py: CUDA-graph replays of back-to-back calls.

    python benchmarks/prefill_attention.py --out benchmarks/results/prefill_attention.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from decode_kernels import graph_seconds  # noqa: E402  (this script's folder)

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 4, 128, 16
PREFIX, QUERIES = 8192, 256


def sweep() -> list[dict]:
    from engine.kernels.gpu.paged_attention import paged_attention_prefill, prefill_block_m, prefill_splits

    keys = PREFIX + QUERIES
    blocks = keys // BLOCK_SIZE
    cache = torch.randn(2, blocks + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(blocks, device="cuda").view(1, blocks)
    query = torch.randn(QUERIES, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(query)
    first = torch.zeros(1, dtype=torch.int64, device="cuda")
    length = torch.full((1,), QUERIES, device="cuda")
    start = torch.full((1,), PREFIX, device="cuda")
    default_m = prefill_block_m(QUERIES)
    default_splits = prefill_splits(-(-QUERIES // default_m) * Q_HEADS)
    rows = []
    for block_m, block_n, warps, stages, splits in itertools.product(
        (32, 64, 128), (32, 64), (4, 8), (2, 3), (1, 2, 4, 8)
    ):
        seconds = graph_seconds(lambda: paged_attention_prefill(
            query, cache[0], cache[1], out, first, length, start, table, QUERIES, HEAD_DIM**-0.5,
            num_splits=splits, block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
        ), calls=10, repeats=7)
        default = (block_m, block_n, warps, stages, splits) == (default_m, 64, 4, 3, default_splits)
        rows.append({"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages,
                     "num_splits": splits, "seconds": seconds, "default": default})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/prefill_attention.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_attention.py needs a CUDA device")
    rows = sweep()
    rows.sort(key=lambda r: r["seconds"])
    print(f"{QUERIES} queries after {PREFIX} keys, {Q_HEADS} heads / {KV_HEADS} KV heads, dim {HEAD_DIM}, bf16")
    print(f"{'block_m':>8}{'block_n':>8}{'warps':>6}{'stages':>7}{'splits':>7}{'us':>9}")
    for r in rows[:12] + [r for r in rows[12:] if r["default"]]:
        mark = "  (default)" if r["default"] else ""
        print(f"{r['block_m']:>8}{r['block_n']:>8}{r['num_warps']:>6}{r['num_stages']:>7}{r['num_splits']:>7}"
              f"{r['seconds'] * 1e6:>9.1f}{mark}")
    report = {"device": torch.cuda.get_device_name(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
