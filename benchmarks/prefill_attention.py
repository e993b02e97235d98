"""The paged prefill-attention kernel with one query head a program (G = 1, the kernel before
grouping) against its grouped default (every query head of a KV head in one program, each K/V
tile loaded once for all of them), on a few shapes, and over a sweep of its launch parameters.

Shapes of the 1.5B config (16 query heads over 4 KV heads, head dim 128, bf16, block size 16)
through engine/kernels/gpu/paged_attention.py:paged_attention_prefill, each chunk's blocks in
random order:
- restore+256: after an 8,192-token instruction checkpoint is restored, the user message's 256
  queries attend to 8,448 keys in each of the 4 attention layers (about 0.28 ms of the 3.9 ms
  restore + prefill step; benchmarks/gpu_roofline_notes.md);
- restore+32: a short user message after the same prefix (16-query blocks at G = 1);
- 2048-after-6144: a long prompt's later chunk of a chunked prefill;
- 8x128-after-1024: several chunks with cached keys in one launch.
For each shape both run at their default launch parameters (engine/kernels/gpu/prefill_launch.py),
each is compared with engine/kernels/attention_reference.py, and the two with each other. With
--sweep (the default) the restore+256 shape is also timed over (block_m, block_n, num_warps,
num_stages, num_splits) for G = 1 and the grouped G (key tiles of 128 for the grouped G only);
a launch that does not fit an SM's shared memory is recorded with seconds null. Times as in
decode_kernels.py: the median of CUDA-graph replays of back-to-back calls (gpu_timing.py).

    python benchmarks/prefill_attention.py --out benchmarks/results/prefill_attention.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch

from gpu_timing import graph_seconds
from harness import add_out_argument, write_result

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 4, 128, 16
SHAPES = {  # name: (chunks, queries a chunk, cached keys a chunk)
    "restore+256": (1, 256, 8192),
    "restore+32": (1, 32, 8192),
    "2048-after-6144": (1, 2048, 6144),
    "8x128-after-1024": (8, 128, 1024),
}
SWEPT_SHAPE = "restore+256"


@dataclasses.dataclass
class Case:
    """One shape's inputs on the GPU, in paged_attention_prefill's argument order."""

    query: torch.Tensor  # (Sp * n, H, D)
    key_cache: torch.Tensor  # (blocks, BLOCK_SIZE, Hkv, D)
    value_cache: torch.Tensor
    first_rows: torch.Tensor  # (Sp,)
    lengths: torch.Tensor  # (Sp,)
    start_positions: torch.Tensor  # (Sp,)
    block_tables: torch.Tensor  # (Sp, blocks a chunk), a random permutation of the blocks
    max_length: int


def make_case(chunks: int, queries: int, cached: int) -> Case:
    blocks = -(-(cached + queries) // BLOCK_SIZE)
    cache = torch.randn(2, chunks * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device="cuda")  # noqa: E731
    return Case(
        query=torch.randn(chunks * queries, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
        key_cache=cache[0], value_cache=cache[1],
        first_rows=as_t([s * queries for s in range(chunks)]),
        lengths=as_t([queries] * chunks), start_positions=as_t([cached] * chunks),
        block_tables=torch.randperm(chunks * blocks, device="cuda").view(chunks, blocks),
        max_length=queries,
    )


def run(case: Case, out: torch.Tensor, **launch) -> None:
    from engine.kernels.gpu.paged_attention import paged_attention_prefill

    paged_attention_prefill(
        case.query, case.key_cache, case.value_cache, out, case.first_rows, case.lengths,
        case.start_positions, case.block_tables, case.max_length, HEAD_DIM**-0.5, **launch,
    )


def seconds(case: Case, **launch) -> float | None:
    """Median seconds of one call; None when the launch does not fit the device."""
    from triton.runtime.errors import OutOfResources

    out = torch.empty_like(case.query)
    try:
        return graph_seconds(lambda _: run(case, out, **launch), calls=10, repeats=7)
    except OutOfResources:
        return None


def relative_error(actual: torch.Tensor, case: Case) -> float:
    """Against attention_reference.paged_attention, chunk by chunk, in fp64 norms."""
    from engine.kernels.attention_reference import paged_attention

    num, den = 0.0, 0.0
    n = case.max_length
    for s in range(case.first_rows.shape[0]):
        ref = paged_attention(case.query[s * n : (s + 1) * n], case.key_cache, case.value_cache,
                              case.block_tables[s], int(case.start_positions[s]), HEAD_DIM**-0.5)
        num += float((actual[s * n : (s + 1) * n].double() - ref.double()).norm() ** 2)
        den += float(ref.double().norm() ** 2)
    return (num / den) ** 0.5


def compare(name: str) -> dict:
    """G = 1 and the grouped default on one shape, both at their default launch parameters."""
    from engine.kernels.gpu.prefill_launch import prefill_launch

    chunks, queries, cached = SHAPES[name]
    case = make_case(chunks, queries, cached)
    row = {"shape": name, "chunks": chunks, "queries": queries, "cached": cached}
    outputs = []
    for label, given in (("ungrouped", {"heads_per_program": 1}), ("grouped", {})):
        launch = prefill_launch(torch.bfloat16, Q_HEADS, KV_HEADS, queries, chunks, **given)
        out = torch.full_like(case.query, float("nan"))
        run(case, out, **given)
        outputs.append(out)
        row[label] = {**dataclasses.asdict(launch), "seconds": seconds(case, **given),
                      "relative_error": relative_error(out, case)}
    row["max_abs_difference"] = float((outputs[0].float() - outputs[1].float()).abs().max())
    return row


def sweep(grouped_heads: int) -> list[dict]:
    """The swept shape over launch parameters, for G = 1 and G = grouped_heads."""
    case = make_case(*SHAPES[SWEPT_SHAPE])
    rows = []
    for heads in sorted({1, grouped_heads}):
        block_ms = (32, 64, 128) if heads == 1 else tuple(m for m in (16, 32, 64) if heads * m <= 256)
        block_ns = (32, 64) if heads == 1 else (32, 64, 128)
        for block_m, block_n, warps, stages, splits in itertools.product(
            block_ms, block_ns, (4, 8), (2, 3), (1, 2, 4, 8)
        ):
            launch = {"heads_per_program": heads, "block_m": block_m, "block_n": block_n,
                      "num_warps": warps, "num_stages": stages, "num_splits": splits}
            rows.append({**launch, "seconds": seconds(case, **launch)})
    return rows


def print_comparison(rows: list[dict]) -> None:
    print(f"{Q_HEADS} heads / {KV_HEADS} KV heads, dim {HEAD_DIM}, bf16; launch: G x block_m, warps, splits")
    print(f"{'shape':<22}{'G=1 us':>9}{'launch':>14}{'grouped us':>12}{'launch':>14}{'speedup':>9}"
          f"{'rel err 1/G':>17}{'max|diff|':>11}")
    fmt = lambda l: f"{l['heads_per_program']}x{l['block_m']},{l['num_warps']},{l['num_splits']}"  # noqa: E731
    us = lambda l: f"{l['seconds'] * 1e6:.1f}" if l["seconds"] is not None else "n/a"  # noqa: E731
    for r in rows:
        one, grouped = r["ungrouped"], r["grouped"]
        ratio = (f"{one['seconds'] / grouped['seconds']:.2f}x"
                 if one["seconds"] is not None and grouped["seconds"] is not None else "n/a")
        errors = f"{one['relative_error']:.1e}/{grouped['relative_error']:.1e}"
        print(f"{r['shape']:<22}{us(one):>9}{fmt(one):>14}{us(grouped):>12}{fmt(grouped):>14}{ratio:>9}"
              f"{errors:>17}{r['max_abs_difference']:>11.2e}")


def print_sweep(rows: list[dict]) -> None:
    print(f"\n{SWEPT_SHAPE}, fastest 10 launches of each G:")
    print(f"{'G':>3}{'block_m':>8}{'block_n':>8}{'warps':>6}{'stages':>7}{'splits':>7}{'us':>9}")
    for heads in sorted({r["heads_per_program"] for r in rows}):
        timed = sorted((r for r in rows if r["heads_per_program"] == heads and r["seconds"] is not None),
                       key=lambda r: r["seconds"])
        for r in timed[:10]:
            print(f"{heads:>3}{r['block_m']:>8}{r['block_n']:>8}{r['num_warps']:>6}{r['num_stages']:>7}"
                  f"{r['num_splits']:>7}{r['seconds'] * 1e6:>9.1f}")
        misfits = sum(r["seconds"] is None for r in rows if r["heads_per_program"] == heads)
        if misfits:
            print(f"    ({misfits} launches of G = {heads} did not fit)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(parser, "prefill_attention")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES),
                        help="shapes to compare G = 1 and the grouped default on")
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                        help=f"also sweep the launch parameters on {SWEPT_SHAPE!r}")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_attention.py needs a CUDA device")
    from engine.kernels.gpu.prefill_launch import prefill_heads_per_program

    torch.manual_seed(0)
    comparison = [compare(name) for name in args.shapes]
    print_comparison(comparison)
    swept = sweep(prefill_heads_per_program(Q_HEADS, KV_HEADS)) if args.sweep else []
    if swept:
        print_sweep(swept)
    report = {"device": torch.cuda.get_device_name(), "compare": comparison, "sweep_shape": SWEPT_SHAPE,
              "sweep": swept}
    out = write_result(args.out, "prefill_attention", report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
