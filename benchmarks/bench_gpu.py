"""hybrid-serve-bench on the GPU: the 1.5B random-weight configuration (benchmarks/roofline/model.py),
one in-process engine per checkpoint_slots setting (hybrid_serve_bench/engine_target.py; no Ray,
no HTTP), every pass of the CPU benchmark at several concurrencies, in one process so each engine
starts (loads, captures its CUDA graphs, compiles its kernels) once.

    python benchmarks/bench_gpu.py --out $OUT                     # on the H200 (bench_gpu.sh)
    python benchmarks/bench_gpu.py --out /tmp/b --quick           # the same path on CPU, tiny

Writes one bench.json per pass, in this order (each as soon as it is done, so a run stopped at
its time limit keeps what it finished), as OUT/gpu-<pass>.json:
  instruction-sweep                     shared-instructions at 500..12,000 instruction tokens,
                                        [prompt, response] vs all three slots, concurrency 1,
                                        48 requests a length (the first of each of the 4
                                        system prompts is a cold prefill in both settings);
  shared-instructions-c{C}              shared-instructions, all four settings, concurrency C;
  workloads-c{C}                        the other four workloads, all four settings.
Redraw the report and plots with `hybrid-serve-bench report <bench.json>` (benchmarks/results/
bench/gpu-*/ hold them). The tokenizer is the tiny model's, and the checkpoint's vocabulary is
cut to its 2,048 ids (roofline/model.py shrink_vocab: a random model over 49,152 ids samples ids the tokenizer
cannot decode, so its replies would have no text); the weights are random, so only the token
counts matter. Even so, its greedy replies were all ids with no text (on the H200, 2026-12-04:
every warm-up request "no content in the stream"; the end-of-text id, most likely), so the GPU
passes take TTFT at the first generated token (EngineChat.ttft_at_first_token), and say so in
each bench.json's command (--ttft-at-first-token).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from hybrid_serve_bench.cli import (  # noqa: E402
    in_process_config, measure_engines, parse_args, prepare, write_result)
from hybrid_serve_bench.engine_target import engine_targets, warm_up  # noqa: E402
from hybrid_serve_bench.policies import POLICIES, policy_label  # noqa: E402
from hybrid_serve_bench.runner import Target  # noqa: E402

SWEEP_POLICIES = (("prompt", "response"), ("prompt", "response", "instruction"))


def engine_args(model_dir: Path, quick: bool) -> list[str]:
    """The engine flags of every pass: 16,384 tokens of context, 64 sequences, 8,192 tokens a
    step; budgets so that four engines fit on one H200 together."""
    if quick:
        return ["--model-dir", str(model_dir), "--max-model-len", "2048", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "512"]
    return ["--model-dir", str(model_dir), "--device", "cuda", "--dtype", "bfloat16",
            "--max-model-len", "16384", "--max-num-seqs", "64", "--max-num-batched-tokens", "8192",
            "--kv-cache-mib", "6144", "--state-cache-mib", "3072", "--checkpoint-cache-mib", "8192"]


def passes(quick: bool, concurrency: list[int]) -> list[tuple[str, list[tuple[str, ...]], list[str]]]:
    """(name, policies, workload flags) of every pass, the acceptance's first."""
    if quick:
        lengths, si, other = ["100", "300"], ["--requests", "6", "--instruction-tokens", "300"], [
            "--requests", "4", "--conversations", "2", "--turns", "2", "--agents", "2",
            "--agent-turns", "2", "--developer-tokens", "100", "--examples", "2",
            "--instruction-tokens", "300"]
        common = ["--user-tokens", "20-40", "--max-tokens", "4", "--rounds", "2", "--systems", "2"]
    else:
        lengths, si, other = ["500", "1000", "2000", "4000", "8000", "12000"], ["--requests", "{r}"], [
            "--requests", "{r}", "--conversations", "{c4}", "--agents", "{c4}"]
        common = ["--max-tokens", "16", "--rounds", "4"]
    out = [("instruction-sweep", list(SWEEP_POLICIES),
            ["--workload", "shared-instructions", "--instruction-tokens", *lengths,
             "--requests", "48" if not quick else "4", "--concurrency", "1", *common])]
    for c in concurrency:
        sizes = {"r": str(max(48, 2 * c)), "c4": str(max(8, c // 2))}
        out.append((f"shared-instructions-c{c}", list(POLICIES),
                    ["--workload", "shared-instructions", *[a.format(**sizes) for a in si],
                     "--concurrency", str(c), *common]))
    for c in concurrency:
        sizes = {"r": str(max(48, 2 * c)), "c4": str(max(8, c // 2))}
        out.append((f"workloads-c{c}", list(POLICIES),
                    ["--workload", "multi-turn", "agent-loop", "few-shot", "no-sharing",
                     *[a.format(**sizes) for a in other], "--concurrency", str(c), *common]))
    return out


def model_dir_of(args: argparse.Namespace, tmp: Path) -> Path:
    """The tiny model (--quick), or the 1.5B random checkpoint written under tmp with the tiny
    model's tokenizer beside it (roofline/model.py write_serving_checkpoint)."""
    from engine.engine_config import DEFAULT_MODEL_DIR

    if args.quick:
        return DEFAULT_MODEL_DIR
    from roofline.model import write_serving_checkpoint

    model_dir = tmp / "granite-hybrid-1p5b-random"
    write_serving_checkpoint(model_dir)
    return model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the gpu-<pass>.json files go")
    parser.add_argument("--quick", action="store_true", help="the tiny model on CPU, tiny sizes")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 8])
    parser.add_argument("--only", nargs="+", default=None, help="pass names to run (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir_of(args, Path(tmp))
        flags = engine_args(model_dir, args.quick)
        print(f"model ready ({time.perf_counter() - t0:.0f}s)", flush=True)
        base = parse_args(["compare-policies", "--in-process", *flags])
        chosen_passes = [p for p in passes(args.quick, args.concurrency) if not args.only or p[0] in args.only]
        needed = [p for p in POLICIES if any(p in policies for _, policies, _ in chosen_passes)]
        with engine_targets(needed, in_process_config(base),
                            ttft_at_first_token=not args.quick) as (targets, configs):
            by_label = dict(zip((t.label for t in targets), zip(targets, configs)))
            print(f"engines started ({time.perf_counter() - t0:.0f}s)", flush=True)
            for name, policies, workload_flags in chosen_passes:
                argv = ["compare-policies", "--in-process", *flags,
                        *([] if args.quick else ["--ttft-at-first-token"]), "--policies",
                        *[",".join(p) or "none" for p in policies], *workload_flags]
                chosen = [by_label[t.label] for t in targets
                          if t.label in {policy_label(p) for p in policies}]
                try:  # a pass that fails is reported; the next one still runs
                    run_pass(name, argv, chosen, Path(tmp) / name, args.out / f"gpu-{name}.json")
                except Exception:
                    traceback.print_exc()
                print(f"{name} done ({time.perf_counter() - t0:.0f}s)", flush=True)


def run_pass(name: str, argv: list[str], chosen: list[tuple[Target, dict]], out_dir: Path,
             json_path: Path) -> None:
    """One pass: warm the engines up on its shapes, measure, write the report under out_dir and
    copy its bench.json to json_path; print its table."""
    run = parse_args(argv)
    counter, workloads = prepare(run)
    targets, configs = [t for t, _ in chosen], [c for _, c in chosen]
    # each workload's first `concurrency` first turns, at once, per engine, then the next
    # `concurrency` (which restore what the first left): the kernels compile and autotune for
    # this pass's shapes unmeasured (the Triton kernels specialize on the step's composition:
    # on the H200 a burst of 64 spent seconds a step compiling, benchmarks/ttft_anatomy.py)
    c = run.concurrency
    asyncio.run(warm_up(targets, [x.turns[0].new_messages for w in workloads for x in w.conversations[:c]],
                        then=[x.turns[0].new_messages for w in workloads for x in w.conversations[c:2 * c]]))
    target_dicts, rows, records = measure_engines(run, targets, configs, workloads, counter)
    run.out_dir = out_dir
    paths = write_result(run, argv, target_dicts, rows, records, workloads, counter)
    shutil.copy(paths["json"], json_path)
    errors = sum(1 for r in records if r["error"])
    print(f"{name}: {len(records)} requests, {errors} errors", flush=True)
    for row in rows:
        print(f"  {row['target']:34s} {row['workload']:28s} TTFT p50 {row['ttft_p50_ms']} "
              f"p95 {row['ttft_p95_ms']} hit {row['token_hit_rate']}", flush=True)


if __name__ == "__main__":
    main()
