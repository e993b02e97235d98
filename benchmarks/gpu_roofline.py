"""Roofline benchmark of the engine's GPU path on one device, in one process (no Ray).

Measures, in the same run, device-to-device copy bandwidth and the bf16 matmul rate (the
floors, roofline/floors.py), then drives engine.worker.Worker on a ~1.5B dense
GraniteMoeHybrid with random bf16 weights (roofline/model.py, written to a temp dir) and
reports each result as a ratio to its floor:

  * numerics: bf16 GPU logits vs the fp32 CPU reference path on a short prompt + greedy tokens
    (roofline/numerics.py);
  * cold prefill of 8,192 tokens (time to first token) vs model FLOPs / matmul rate, and the
    checkpoint rows: capture and restore of an 8,192-token bundle, restore + 256-token prefill
    (a prefill CUDA graph, and the same step eagerly) vs the cold 8,448-token prefill, and the
    cold 8,448-token prefill that captures at 8,192 (split and in-pass) vs the same prefill
    without capture (roofline/prefill_rows.py);
  * decode tokens/s at batch 1, 16, 64 with 1,024 tokens of context vs the bytes a step must
    move / copy bandwidth, replaying the worker's CUDA graphs, then the same steps eagerly for
    comparison (roofline/decode_rows.py); then where a batch-1 step's GPU time goes around its
    graph (roofline/decode_anatomy.py);
  * for each row, one step under torch.profiler: GPU kernel time vs wall time (what dominates;
    roofline/instruments.py).

Time to first token (the cold prefill rows, restore + prefill) is the time to the sampled
token on the host, as serving it takes. The JSON is rewritten after each stage (with
"partial": true), so a run cut short by its time limit still leaves its rows.

    python benchmarks/gpu_roofline.py --out benchmarks/results/gpu_roofline.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from engine.engine_config import EngineConfig
from engine.execution.worker import Worker
from harness import add_out_argument, write_result
from roofline.decode_anatomy import decode_step_anatomy
from roofline.decode_rows import DECODE_STEPS_RUN, HOST_PROFILE_STEPS, decode_row
from roofline.floors import measure_copy_bandwidth, measure_matmul_rate
from roofline.instruments import profile_step
from roofline.model import BLOCK_SIZE, parameter_counts, sized_config, write_random_checkpoint
from roofline.numerics import numerics_check
from roofline.prefill_rows import checkpoint_rows, cold_prefill_row
from roofline.report import print_report

DECODE_BATCHES = (1, 16, 64)
USER_MESSAGE_TOKENS = 256  # the user message after the instruction checkpoint


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(parser, "gpu_roofline")
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--no-eager", action="store_true", help="skip the eager decode rows (comparison only)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save_partial(rows: list[dict]) -> None:
        """The JSON so far, so a run cut short by its time limit still leaves its rows."""
        write_result(args.out, "gpu_roofline", {**report, "rows": rows, "partial": True})
    try:
        import fla
        import triton

        report.update(triton=triton.__version__, fla=getattr(fla, "__version__", "?"))
    except ImportError as e:
        report["import_error"] = str(e)
    copy_bw, matmul = measure_copy_bandwidth(), measure_matmul_rate()
    report["floors"] = {"copy_bytes_per_s": copy_bw, "matmul_flop_per_s": matmul}
    print(f"copy {copy_bw / 1e12:.2f} TB/s (read+write)  matmul {matmul / 1e12:.0f} TFLOP/s", flush=True)

    num_requests = 1 + sum(DECODE_BATCHES)
    # decode runs on past the context: bench_decode, host_profile and decode_step_anatomy take
    # about 270 steps of batch 1's request
    blocks_per_seq = -(-max(args.prefill_tokens + USER_MESSAGE_TOKENS, args.context + 512) // BLOCK_SIZE)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "granite-hybrid-1p5b-random"
        write_random_checkpoint(model_dir)
        print(f"checkpoint written ({time.perf_counter() - t_start:.0f}s)", flush=True)
        probe = EngineConfig(model_dir=str(model_dir), dtype="bfloat16", device="cuda")
        worker = Worker(sized_config(probe, num_requests, blocks_per_seq))
        counts = parameter_counts(worker.model)
        report["parameters"] = counts
        report["numerics"] = numerics_check(worker, model_dir)
        print(f"numerics {report['numerics']}  ({time.perf_counter() - t_start:.0f}s)", flush=True)

        rows = [cold_prefill_row(worker, args.prefill_tokens, blocks_per_seq, matmul, counts["body"])]
        rows += checkpoint_rows(worker, blocks_per_seq, BLOCK_SIZE, args.prefill_tokens, USER_MESSAGE_TOKENS,
                                profile=lambda step: profile_step(worker, step, top=12))
        print(f"checkpoint rows done ({time.perf_counter() - t_start:.0f}s)", flush=True)
        save_partial(rows)
        prefill_graphs = worker.prefill_graphs
        if prefill_graphs is not None:
            report["prefill_graph_sizes"] = list(prefill_graphs.sizes)
            report["prefill_graph_capture_s"] = prefill_graphs.capture_seconds
            report["prefill_graph_replays"] = prefill_graphs.replays
        graphs = worker.decode_graphs
        report["decode_graph_sizes"] = list(graphs.batch_sizes) if graphs is not None else []
        report["decode_graph_capture_s"] = graphs.capture_seconds if graphs is not None else None
        # Decode through the worker's CUDA graphs, then the same steps eagerly (graphs detached;
        # the same requests, prefilled again) to show what the graphs remove.
        modes = (("graphs", graphs),) if args.no_eager else (("graphs", graphs), ("eager", None))
        for mode, runner in modes:
            worker.decode_graphs = runner
            first = 1
            for b in DECODE_BATCHES:
                rows.append(decode_row(worker, mode, first, b, args.context, blocks_per_seq, copy_bw))
                first += b
                print(f"decode batch {b} {mode}: {rows[-1]['tokens_per_s']:.0f} tok/s "
                      f"({time.perf_counter() - t_start:.0f}s)", flush=True)
                save_partial(rows)
        worker.decode_graphs = graphs
        if graphs is not None:
            report["decode_graph_replays"] = graphs.replays
        # batch 1's request after bench_decode's steps and host_profile's
        position = args.context + DECODE_STEPS_RUN + HOST_PROFILE_STEPS
        report["batch1_step_anatomy"] = decode_step_anatomy(worker, 1, position, blocks_per_seq)
        print(f"batch-1 step anatomy done ({time.perf_counter() - t_start:.0f}s)", flush=True)
        report["rows"] = rows
    report["wall_seconds"] = time.perf_counter() - t_start

    print_report(report)
    out = write_result(args.out, "gpu_roofline", report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
