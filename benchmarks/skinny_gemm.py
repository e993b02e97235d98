"""Skinny GEMM benchmark: skinny_linear (engine/kernels/gpu/skinny_gemm.py) vs F.linear (cuBLAS)
for one row (decode batch size 1) on the linear shapes of the 1.5B GraniteMoeHybrid config.

    python benchmarks/skinny_gemm.py --out benchmarks/results/skinny_gemm.json

Needs a CUDA device, torch and triton. Measures, in one run:

  * the floor: device-to-device copy bandwidth of a 1 GiB tensor (bytes read + written / time);
  * for the MLP output shape also the gated variant (SiLU-and-mul in the GEMM's prologue) vs
    the activation kernel followed by skinny_linear;
  * for each distinct (N, K): seconds per call of skinny_linear (autotuned) and of F.linear on
    x (1, K), each as a CUDA graph of back-to-back calls replayed many times, so launch overhead
    is what it is inside the model's decode graphs. Each call reads a different copy of the
    weight, 512 MiB of copies in rotation, so weights come from HBM as in a decode step (3 GB of
    weights never stay in the 50 MB L2). Weight bandwidth = N * K * 2 bytes / time;
  * decode-step totals: the sum over the model's linear layers (20 Mamba in_proj + out_proj,
    4 attention q, k, v, o, 24 MLP input + output, the LM head) with skinny_linear everywhere
    (the engine's choice: engine/layers/parallel_linear.py), F.linear everywhere and the faster
    of the two per shape, against the time to stream those weights at the copy rate.

Autotuning happens on each shape's first (eager) call; the run takes well under a minute.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's engine, not an installed one

from harness import add_out_argument, write_result  # noqa: E402  (this script's folder)
from roofline.floors import measure_copy_bandwidth  # noqa: E402

DTYPE = torch.bfloat16
ROTATION_BYTES = 512 << 20  # weight copies cycled through by one graph, >> L2
MIN_CALLS_PER_GRAPH = 20
MIN_TIMED_SECONDS = 0.02  # per measurement: graph replays until at least this long


@dataclass(frozen=True)
class LinearShape:
    """One distinct (N, K) of the model and how many times a decode step runs it."""

    name: str
    features: int  # N
    depth: int  # K
    per_step: int

    @property
    def weight_bytes(self) -> int:
        return self.features * self.depth * DTYPE.itemsize


# The 1.5B config (benchmarks/roofline/model.py): 20 Mamba layers, 4 attention layers (16 query
# heads and 4 KV heads of 128), 24 MLPs of 5632, vocabulary 49152, hidden 2048.
MODEL_SHAPES = (
    LinearShape("mamba.in_proj", 8512, 2048, 20),
    LinearShape("mamba.out_proj", 2048, 4096, 20),
    LinearShape("mlp.input", 11264, 2048, 24),
    LinearShape("mlp.output", 2048, 5632, 24),
    LinearShape("attn.q+o", 2048, 2048, 8),
    LinearShape("attn.k+v", 512, 2048, 8),
    LinearShape("lm_head", 49152, 2048, 1),
)


def weight_rotation(shape: LinearShape) -> tuple[torch.Tensor, int]:
    """(copies, N, K) random weights filling ROTATION_BYTES (at least 2 copies), and the number
    of calls per graph: enough to read every copy once, and at least MIN_CALLS_PER_GRAPH."""
    copies = max(2, math.ceil(ROTATION_BYTES / shape.weight_bytes))
    bank = torch.randn(copies, shape.features, shape.depth, device="cuda", dtype=DTYPE) / shape.depth**0.5
    return bank, max(MIN_CALLS_PER_GRAPH, copies)


def seconds_per_call(call: Callable[[int], object], calls: int) -> float:
    """call(i) for i < calls captured back to back in one CUDA graph (after an eager warm-up on
    a side stream, as torch.cuda.graph asks), replayed until MIN_TIMED_SECONDS have passed;
    returns graph time / calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()  # first replay uploads the graph
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    replays = max(5, math.ceil(MIN_TIMED_SECONDS / max(time.perf_counter() - t0, 1e-6)))
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) / 1e3 / (replays * calls)


def bench_shape(shape: LinearShape, copy_bw: float) -> dict:
    """skinny_linear and F.linear seconds per call on one row, weight bandwidth and its fraction
    of the copy rate, and the tuned config."""
    from engine.kernels.gpu.skinny_gemm import chosen_config, skinny_linear

    bank, calls = weight_rotation(shape)
    copies = bank.shape[0]
    x = torch.randn(1, shape.depth, device="cuda", dtype=DTYPE)
    skinny_linear(x, bank[0])  # autotunes this (N, K) eagerly
    torch.cuda.synchronize()
    config = dataclasses.asdict(chosen_config())
    skinny_s = seconds_per_call(lambda i: skinny_linear(x, bank[i % copies]), calls)
    torch_s = seconds_per_call(lambda i: F.linear(x, bank[i % copies]), calls)
    gated = {}
    if shape.name == "mlp.output":  # the MLP's output at one row: SiLU-and-mul fused or before it
        from engine.kernels.gpu.activation import silu_and_mul

        gate_up = torch.randn(1, 2 * shape.depth, device="cuda", dtype=DTYPE)
        skinny_linear(gate_up, bank[0], gated=True)  # autotunes the gated variant
        gated = {
            "gated_s": seconds_per_call(lambda i: skinny_linear(gate_up, bank[i % copies], gated=True), calls),
            "silu_then_skinny_s": seconds_per_call(
                lambda i: skinny_linear(silu_and_mul(gate_up), bank[i % copies]), calls),
        }
    del bank
    torch.cuda.empty_cache()
    return {
        "name": shape.name, "N": shape.features, "K": shape.depth,
        "per_step": shape.per_step, "weight_bytes": shape.weight_bytes, "calls_per_graph": calls,
        "skinny_s": skinny_s, "torch_s": torch_s,
        "skinny_Bps": shape.weight_bytes / skinny_s, "torch_Bps": shape.weight_bytes / torch_s,
        "skinny_vs_copy": shape.weight_bytes / skinny_s / copy_bw,
        "torch_vs_copy": shape.weight_bytes / torch_s / copy_bw,
        "speedup_vs_torch": torch_s / skinny_s,
        "skinny_config": config, **gated,
    }


def step_totals(results: list[dict], copy_bw: float) -> dict:
    """Sum over one decode step's linear layers at M = 1: skinny_linear everywhere (the
    engine's choice), F.linear everywhere, and the faster of the two per shape; each with
    its fraction of the floor (weight bytes at the copy rate)."""
    weight_bytes = sum(r["per_step"] * r["weight_bytes"] for r in results)
    floor_s = weight_bytes / copy_bw

    def total(seconds_of: Callable[[dict], float]) -> dict:
        seconds = sum(r["per_step"] * seconds_of(r) for r in results)
        return {"seconds": seconds, "fraction_of_floor": floor_s / seconds}

    return {
        "weight_bytes": weight_bytes, "floor_s": floor_s,
        "skinny": total(lambda r: r["skinny_s"]),
        "torch": total(lambda r: r["torch_s"]),
        "best_of_both": total(lambda r: min(r["skinny_s"], r["torch_s"])),
    }


def _compact(config: dict) -> str:
    return "n{block_n} k{block_k} w{num_warps} s{num_stages}".format(**config)


def print_table(results: list[dict], step: dict) -> None:
    print(f"\n{'shape':<16}{'N':>6}{'K':>6}{'skinny us':>11}{'%copy':>7}{'torch us':>10}{'%copy':>7}"
          f"{'speedup':>9}  config")
    for r in results:
        print(f"{r['name']:<16}{r['N']:>6}{r['K']:>6}{r['skinny_s'] * 1e6:>11.2f}"
              f"{100 * r['skinny_vs_copy']:>6.0f}%{r['torch_s'] * 1e6:>10.2f}{100 * r['torch_vs_copy']:>6.0f}%"
              f"{r['speedup_vs_torch']:>8.2f}x  "
              f"{_compact(r['skinny_config'])}")
    for r in results:
        if "gated_s" in r:
            print(f"{r['name']} with the SiLU-and-mul prologue: {r['gated_s'] * 1e6:.2f} us per call, "
                  f"vs {r['silu_then_skinny_s'] * 1e6:.2f} us for silu_and_mul then skinny_linear")
    print(f"\ndecode step, M = 1: {step['weight_bytes'] / 1e9:.2f} GB of linear weights, "
          f"floor {step['floor_s'] * 1e3:.3f} ms")
    for key in ("skinny", "torch", "best_of_both"):
        print(f"  {key:<14}{step[key]['seconds'] * 1e3:8.3f} ms  {100 * step[key]['fraction_of_floor']:5.1f}% of floor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(parser, "skinny_gemm")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/skinny_gemm.py needs a CUDA device (torch sees none); "
                         "it times Triton and cuBLAS kernels on the GPU")
    import triton

    started = time.perf_counter()
    copy_bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e12:.2f} TB/s (read+write), "
          f"torch {torch.__version__}, triton {triton.__version__}", flush=True)
    results = []
    for shape in MODEL_SHAPES:
        results.append(bench_shape(shape, copy_bw))
        print(f"{shape.name} done ({time.perf_counter() - started:.0f}s)", flush=True)
    step = step_totals(results, copy_bw)
    print_table(results, step)
    report = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "dtype": str(DTYPE), "M": 1, "copy_bandwidth_Bps": copy_bw, "rotation_bytes": ROTATION_BYTES,
        "shapes": results, "decode_step": step, "elapsed_s": time.perf_counter() - started,
    }
    out = write_result(args.out, "skinny_gemm", report)
    print(f"\nwrote {out} ({report['elapsed_s']:.0f}s)")


if __name__ == "__main__":
    main()
