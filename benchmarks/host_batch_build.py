"""Host time spent building one step's batch before the first kernel launches.

    .venv/bin/python benchmarks/host_batch_build.py                 # CPU only, a few seconds
    .venv/bin/python benchmarks/host_batch_build.py --repeats 500 --out /tmp/host.json

Times, on the CPU, the three functions a CUDA step calls before its first kernel:

  forward batch   engine/interfaces/forward_batch.py build_forward_batch (token ids, positions, KV write slots)
  gpu plan        engine/kernels/gpu/batch_plan.py build_gpu_batch_plan, with device cpu (on
                  CUDA the same packing plus one host-to-device copy)
  in-pass plan    engine/kernels/gpu/in_pass_capture.py build_in_pass_plan (prefill cases with
                  an in-pass capture only)

for two steps at block size 16:

  prefill 8448    one fresh prefill chunk of 8,448 tokens with an in-pass capture at 8,192
  decode 64x1024  64 decode chunks (one token each) at position 1,024

Each time is the best of --repeats calls (a shared machine: compare rows of the same run).
Prints a table and writes JSON (--out, default benchmarks/results/host_batch_build.json).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's engine, not an installed one
from engine.interfaces.forward_batch import build_forward_batch  # noqa: E402
from engine.interfaces.sampling_params import SamplingParams  # noqa: E402
from engine.interfaces.step_io import ScheduledChunk  # noqa: E402
from engine.kernels.gpu.batch_plan import build_gpu_batch_plan  # noqa: E402
from engine.kernels.gpu.in_pass_capture import CaptureSplit, build_in_pass_plan  # noqa: E402
from harness import add_out_argument, markdown_table, write_result  # noqa: E402

BLOCK_SIZE = 16
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Row:
    case: str
    tokens: int
    chunks: int
    forward_batch_ms: float
    gpu_plan_ms: float
    in_pass_plan_ms: float | None  # None: the case takes no in-pass capture

    @property
    def total_ms(self) -> float:
        return self.forward_batch_ms + self.gpu_plan_ms + (self.in_pass_plan_ms or 0.0)


def _chunk(index: int, num_tokens: int, start_position: int, first_block: int) -> ScheduledChunk:
    """A chunk of `num_tokens` tokens at `start_position`, owning consecutive blocks from
    `first_block` (as many as its positions need) and state slot `index`."""
    num_blocks = -(-(start_position + num_tokens) // BLOCK_SIZE)
    return ScheduledChunk(
        request_id=f"r{index}",
        token_ids=tuple((7 * t + index) % 32000 for t in range(num_tokens)),
        start_position=start_position,
        block_table=tuple(range(first_block, first_block + num_blocks)),
        state_slot=index,
        reset_state=start_position == 0,
        sample=True,
        sampling=SamplingParams(),
    )


def prefill_case(num_tokens: int) -> list[ScheduledChunk]:
    return [_chunk(0, num_tokens, 0, 0)]


def decode_case(num_chunks: int, position: int) -> list[ScheduledChunk]:
    blocks_each = -(-(position + 1) // BLOCK_SIZE)
    return [_chunk(i, 1, position, i * blocks_each) for i in range(num_chunks)]


def best_ms(call: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls, in milliseconds (after one warm-up call)."""
    call()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return 1000 * best


def measure(case: str, chunks: list[ScheduledChunk], capture_at: int | None, repeats: int) -> Row:
    """Time the three builders on `chunks`; the in-pass plan only when `capture_at` (tokens of
    chunk 0 before the capture) is given."""
    batch = build_forward_batch(chunks, BLOCK_SIZE, CPU)
    in_pass_ms = None
    if capture_at is not None:
        prefill = [(i, batch.cu_seqlens[i], c.num_tokens) for i, c in enumerate(batch.chunks) if c.num_tokens > 1]
        splits = [CaptureSplit(0, 0, capture_at, chunks[0].state_slot, chunks[0].reset_state)]
        in_pass_ms = best_ms(lambda: build_in_pass_plan(prefill, splits, {}, {}, CPU), repeats)
    return Row(
        case=case,
        tokens=batch.num_tokens,
        chunks=len(chunks),
        forward_batch_ms=best_ms(lambda: build_forward_batch(chunks, BLOCK_SIZE, CPU), repeats),
        gpu_plan_ms=best_ms(lambda: build_gpu_batch_plan(batch, BLOCK_SIZE, CPU), repeats),
        in_pass_plan_ms=in_pass_ms,
    )


def table(rows: list[Row]) -> str:
    return markdown_table(
        ["case", "tokens", "chunks", "forward batch ms", "gpu plan ms", "in-pass plan ms", "total ms"],
        [[r.case, f"{r.tokens}", f"{r.chunks}", f"{r.forward_batch_ms:.3f}", f"{r.gpu_plan_ms:.3f}",
          "n/a" if r.in_pass_plan_ms is None else f"{r.in_pass_plan_ms:.3f}", f"{r.total_ms:.3f}"]
         for r in rows])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=200, help="calls per measurement; the best counts")
    p.add_argument("--label", default="", help="free text stored in the JSON (e.g. the commit)")
    add_out_argument(p, "host_batch_build")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    rows = [
        measure("prefill 8448", prefill_case(8448), capture_at=8192, repeats=args.repeats),
        measure("decode 64x1024", decode_case(64, 1024), capture_at=None, repeats=args.repeats),
    ]
    report = table(rows)
    print(f"block size {BLOCK_SIZE}, best of {args.repeats} calls, torch threads 1\n")
    print(report)
    out = write_result(args.out, "host_batch_build", {
        "label": args.label,
        "args": vars(args),
        "rows": [{**asdict(r), "total_ms": r.total_ms} for r in rows],
        "table": report,
    }, machine_extra={"torch": torch.__version__})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
