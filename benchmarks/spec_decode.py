"""Speculative decoding on the GPU (issue 25): n-gram and MTP drafting against plain decoding on
the 1.5B random-weight configuration (benchmarks/roofline/model.py, bf16, the tiny model's
tokenizer, vocabulary cut as bench_gpu.py cuts it), in one process (no Ray).

  * decode tokens/s at batch 1 and 16, speculation off, with the n-gram drafter (also with
    drafting capped at --cap running requests, speculative_max_batch_size) and with the
    MTP drafter (a random head, random_mtp_head_seed: it drafts at chance, so its rows show
    what drafting and verifying cost), K drafts a step, through LLMEngine, on a workload that
    copies spans of its prompt: each prompt is P + C + P, P a random span and C the spec-off
    engine's greedy continuation of P, so after the second P the model may say C again, which
    the n-gram drafter proposes. Decode tokens/s counts the
    tokens emitted after every request of the batch has its first token, over the time since
    then; acceptance is the drafts accepted per draft proposed in that run, with the histogram
    of accepted drafts per verification chunk (the weights are random: how often the model
    repeats itself is what it is, and the acceptance is reported, not assumed);
  * the cost of one verification step (B chunks of K + 1 tokens) against one plain decode step
    (B chunks of one token) at --context tokens of context, through engine.worker.Worker, each
    through its CUDA graph (engine/speculative/verify_graphs.py, engine/routes/decode_graphs.py) and
    eagerly (graphs detached; engine/speculative/verify_gpu.py), each the median wall time of
    worker.execute (which waits for the step's tokens) over --repeats steps after warm-up; the
    same steps again with the MTP drafter (the random head), each chunk asking for drafts, which
    prices the head's passes a step (the n-gram drafter's run in the scheduler, outside them).

Prints a table and writes JSON to --out (rewritten after each row, "partial": true until the
end, so a run cut short keeps its rows).

    python benchmarks/spec_decode.py --out $OUT/spec_decode.json            # on the H200
    python benchmarks/spec_decode.py --out /tmp/spec.json --quick           # tiny model, CPU
    python benchmarks/spec_decode.py --out $OUT/mtp_cost.json --stages mtp_cost   # one part
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from engine.execution.worker import Worker  # noqa: E402
from engine.interfaces.generation_request import GenerationRequest  # noqa: E402
from engine.interfaces.sampling_params import SamplingParams  # noqa: E402
from engine.interfaces.step_io import CommitOp, SchedulerOutput  # noqa: E402
from harness import markdown_table, write_result  # noqa: E402

BATCHES = (1, 16)
STAGES = ("decode", "ngram_cost", "mtp_cost")
MTP_HEAD_SEED = 7  # random_mtp_head_seed of the MTP rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON path")
    parser.add_argument("--quick", action="store_true", help="the tiny model on the CPU (a smoke run)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--span", type=int, default=64, help="tokens of P")
    parser.add_argument("--output-tokens", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--context", type=int, default=1024, help="context of the step-cost rows")
    parser.add_argument("--repeats", type=int, default=30, help="timed steps of each step-cost row")
    parser.add_argument("--cap", type=int, default=8,
                        help="speculative_max_batch_size of the capped n-gram rows")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES),
                        help="the parts to run (default: all): decode tokens/s, the step costs with each drafter")
    return parser.parse_args()


def engine_config(model_dir: Path, quick: bool) -> EngineConfig:
    """16 sequences of up to 2,048 tokens (the quick run: the CPU defaults)."""
    if quick:
        return EngineConfig(model_dir=str(model_dir), max_model_len=1024, max_num_seqs=16)
    return EngineConfig(model_dir=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=2048,
                        max_num_seqs=16, max_num_batched_tokens=4096, kv_cache_bytes=4 << 30,
                        state_cache_bytes=2 << 30, checkpoint_cache_bytes=1 << 30)


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, salt: str) -> dict:
    """Run the prompts together to completion: their outputs, and the decode rate after every
    request has its first token."""
    before = engine.stats().speculation.copy()
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"{salt}-{i}", prompt, params, cache_salt=salt))
    tokens: dict[str, list[int]] = {f"{salt}-{i}": [] for i in range(len(prompts))}
    started = None
    at_start = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if started is None and all(tokens.values()):
            started, at_start = time.perf_counter(), sum(map(len, tokens.values()))
    if started is None:
        empty = sorted(rid for rid, got in tokens.items() if not got)
        raise RuntimeError(f"requests {empty} finished without a token: no decode rate to take")
    seconds = time.perf_counter() - started
    after = engine.stats().speculation
    proposed = after.draft_tokens_proposed - before.draft_tokens_proposed
    accepted = after.draft_tokens_accepted - before.draft_tokens_accepted
    decoded = sum(map(len, tokens.values())) - at_start
    return {
        "tokens": tokens, "decode_tokens": decoded, "decode_seconds": seconds,
        "tokens_per_s": decoded / seconds, "drafts_proposed": proposed, "drafts_accepted": accepted,
        "acceptance": accepted / proposed if proposed else 0.0,
        "acceptance_lengths": [a - b for a, b in zip(after.acceptance_lengths, before.acceptance_lengths)],
    }


def span_copying_prompts(engine: LLMEngine, count: int, span: int, vocab: int, params: SamplingParams) -> list[list[int]]:
    """P + C + P for `count` random spans P (ids 100..vocab-1), C the engine's greedy
    continuation of P."""
    rng = random.Random(25)
    spans = [[rng.randrange(100, vocab) for _ in range(span)] for _ in range(count)]
    continued = run_batch(engine, spans, params, "spans")["tokens"]
    return [p + continued[f"spans-{i}"] + p for i, p in enumerate(spans)]


def engine_rows(model_dir: Path, args: argparse.Namespace, save) -> list[dict]:
    """Decode tokens/s at each batch, speculation off, with n-gram drafts (also with drafting
    capped at --cap running requests, speculative_max_batch_size) and with MTP drafts (the
    random head: drafts at chance, so its rows price the drafting), on span-copying prompts."""
    config = engine_config(model_dir, args.quick)
    off = LLMEngine(config)
    ngram = replace(config, num_speculative_tokens=args.k)
    engines = {"off": off, "ngram": LLMEngine(ngram),
               f"ngram, cap {args.cap}": LLMEngine(replace(ngram, speculative_max_batch_size=args.cap)),
               "mtp": LLMEngine(replace(config, num_speculative_tokens=args.k, speculative_drafter="mtp",
                                        random_mtp_head_seed=MTP_HEAD_SEED))}
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    prompts = span_copying_prompts(off, max(BATCHES), args.span, off.vocab_size, params)
    rows = []
    for batch in BATCHES:
        for label, engine in engines.items():
            run_batch(engine, prompts[:batch], replace(params, max_tokens=16), f"warm-{label}-{batch}")
            result = run_batch(engine, prompts[:batch], params, f"{label}-{batch}")
            outputs = result.pop("tokens")
            rows.append({"kind": "decode", "batch": batch, "speculation": label, **result,
                         "outputs": [outputs[f"{label}-{batch}-{i}"] for i in range(batch)]})
            print(f"batch {batch} {label}: {result['tokens_per_s']:.1f} tok/s, acceptance "
                  f"{result['acceptance']:.2f} {result['acceptance_lengths']}", flush=True)
            save(rows)
        off_row, *speculating = rows[-len(engines):]
        for row in speculating:
            row["same_outputs_as_off"] = row["outputs"] == off_row["outputs"]
    for engine in engines.values():
        engine.shutdown()
    return rows


def step_cost_rows(model_dir: Path, args: argparse.Namespace, drafter: str) -> list[dict]:
    """The wall time of a verification step against a plain decode step, at each batch. With
    drafter "mtp" the worker drafts with the random head and every chunk asks for drafts
    (propose_drafts), so each step also runs the head over its positions and k draft depths:
    against the "ngram" rows (whose drafts come from the scheduler, not the worker) that is
    what MTP drafting adds to a step."""
    from roofline.model import BLOCK_SIZE, chunk, sized_config

    k = args.k
    blocks_per_seq = -(-(args.context + k + 2) // BLOCK_SIZE)
    config = replace(engine_config(model_dir, args.quick), num_speculative_tokens=k)
    proposing = {}
    if drafter == "mtp":
        config = replace(config, speculative_drafter="mtp", random_mtp_head_seed=MTP_HEAD_SEED)
        proposing = {"propose_drafts": k, "sample": True}
    if not args.quick:
        config = sized_config(config, max(BATCHES), blocks_per_seq)
    worker = Worker(config)
    graphs, verify_graphs = worker.decode_graphs, getattr(worker, "verify_graphs", None)
    vocab = worker.model.config.vocab_size
    rng = random.Random(3)
    rows = []
    for batch in BATCHES:
        requests = range(batch)
        prompts = {r: [rng.randrange(100, vocab) for _ in range(args.context)] for r in requests}
        worker.execute(SchedulerOutput(tuple(chunk(r, prompts[r], 0, blocks_per_seq, True) for r in requests)))
        drafts = {r: [rng.randrange(100, vocab) for _ in range(k)] for r in requests}
        last = {r: prompts[r][-1] for r in requests}
        steps = {
            "decode_graph": SchedulerOutput(tuple(replace(chunk(r, [last[r]], args.context, blocks_per_seq, False),
                                                          **proposing) for r in requests)),
            "verify_graph": SchedulerOutput(tuple(replace(chunk(r, [last[r], *drafts[r]], args.context, blocks_per_seq, False),
                                                          num_draft_tokens=k, **proposing) for r in requests)),
        }
        steps["decode_eager"], steps["verify_eager"] = steps["decode_graph"], steps["verify_graph"]
        row = {"kind": "step_cost", "drafter": drafter, "batch": batch, "k": k, "context": args.context}
        for name, step in steps.items():
            worker.decode_graphs = None if name == "decode_eager" else graphs
            worker.verify_graphs = None if name == "verify_eager" else verify_graphs
            seconds = []
            for i in range(args.repeats + 3):
                started = time.perf_counter()
                worker.execute(step)
                if i >= 3:
                    seconds.append(time.perf_counter() - started)
                if name.startswith("verify"):  # settle it: commit the first position, as a rejection would
                    worker.execute(SchedulerOutput((), commits=tuple(CommitOp(f"r{r}", r, 0) for r in requests)))
            row[f"{name}_ms"] = 1e3 * statistics.median(seconds)
        worker.decode_graphs, worker.verify_graphs = graphs, verify_graphs
        for verify in ("verify_graph", "verify_eager"):
            for decode in ("decode_graph", "decode_eager"):
                row[f"{verify}_over_{decode}"] = row[f"{verify}_ms"] / row[f"{decode}_ms"]
        print(f"{drafter} batch {batch}: verify graph {row['verify_graph_ms']:.2f} ms, eager {row['verify_eager_ms']:.2f} ms; "
              f"decode graph {row['decode_graph_ms']:.2f} ms, eager {row['decode_eager_ms']:.2f} ms", flush=True)
        rows.append(row)
    del worker
    return rows


def print_table(rows: list[dict], k: int) -> None:
    decode = [r for r in rows if r["kind"] == "decode"]
    print(markdown_table(
        ["batch", "speculation", "decode tok/s", "acceptance", f"accepted per chunk (0..{k})", "same outputs"],
        [[str(r["batch"]), r["speculation"], f"{r['tokens_per_s']:.1f}", f"{r['acceptance']:.2f}",
          str(r["acceptance_lengths"]), str(r.get("same_outputs_as_off", ""))] for r in decode]))
    cost = [r for r in rows if r["kind"] == "step_cost"]
    if cost:
        print()
        print(markdown_table(
            ["drafter", "batch", "verify ms (graph)", "verify ms (eager)", "decode ms (graph)", "decode ms (eager)",
             "verify / decode (graphs)", "verify / decode (eager)"],
            [[r.get("drafter", "ngram"), str(r["batch"]), f"{r['verify_graph_ms']:.3f}", f"{r['verify_eager_ms']:.3f}",
              f"{r['decode_graph_ms']:.3f}", f"{r['decode_eager_ms']:.3f}",
              f"{r['verify_graph_over_decode_graph']:.2f}", f"{r['verify_eager_over_decode_eager']:.2f}"]
             for r in cost]))


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    report: dict = {"k": args.k, "span": args.span, "output_tokens": args.output_tokens,
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__}
    rows: list[dict] = []

    def save(current: list[dict], partial: bool = True) -> None:
        write_result(args.out, "spec_decode", {**report, "rows": current, "partial": partial})

    with tempfile.TemporaryDirectory() as tmp:
        from bench_gpu import model_dir_of

        model_dir = model_dir_of(argparse.Namespace(quick=args.quick), Path(tmp))
        print(f"model {model_dir} ({time.perf_counter() - t_start:.0f}s)", flush=True)
        stages = {"decode": lambda: engine_rows(model_dir, args, lambda r: save(rows + r)),
                  "ngram_cost": lambda: step_cost_rows(model_dir, args, "ngram"),
                  "mtp_cost": lambda: step_cost_rows(model_dir, args, "mtp")}
        for name in args.stages:
            try:
                rows += stages[name]()
            except Exception:  # keep the rows of the stages that ran
                report.setdefault("errors", []).append(traceback.format_exc())
                traceback.print_exc()
            save(rows)
    report["wall_seconds"] = time.perf_counter() - t_start
    print_table(rows, args.k)
    save(rows, partial=False)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
