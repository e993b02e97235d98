"""Speculative decoding on the GPU (issue 45's acceptance, in one call): the 1.5B random-weight
GraniteMoeHybrid of benchmarks/roofline/model.py (bf16, the tiny model's tokenizer, vocabulary
cut as bench_gpu.py cuts it), with an MTP head trained on its own continuations, in one
process (no Ray). Stages, in this order (--stages picks some):

  * train (with --train-head): benchmarks/train_mtp_head.py trains the model's MTP head and
    writes the model dir every later stage uses (without it the MTP rows draft with a random
    head, random_mtp_head_seed: at chance);
  * cost: one verification step (B chunks of k + 1 tokens) against one plain decode step (B
    chunks of one token) at --context tokens of context, through engine.worker.Worker, each
    through the route the engine takes (CUDA graphs up to 16 chunks:
    engine/speculative/verify_graphs.py, engine/routes/decode_graphs.py; past 16 verification
    runs eagerly) and eagerly (graphs detached; engine/speculative/verify_gpu.py), the median
    wall time of worker.execute (which waits for the step's tokens) over --repeats steps after
    warm-up; the same with the MTP drafter, each chunk asking for drafts (the head's passes a
    step). The figures become the model's entry of the speculation policy's table
    (engine/speculative/policy.py), written to --policy-table with the head's acceptance,
    and the "auto" rows below read it (HYBRID_SERVE_STEP_COSTS);
  * decode: decode tokens/s at batch 1, 16 and 64, speculation off, with the n-gram drafter,
    with the MTP drafter (k drafts a step) and as the policy chooses (num_speculative_tokens
    unset: "auto"), through LLMEngine, on prompts that copy spans of themselves (P + C + P, C
    the spec-off engine's greedy continuation of P); decode tokens/s counts the tokens emitted
    after every request of the batch has its first token, over the time since then; the
    acceptance and its histogram are what the run saw;
  * exactness: multi-turn conversations under a shared system prompt through an MTP engine and
    a plain one (bf16): every output equal to speculation off but at a near-tie of its logits
    (a gap within 4 bf16 steps, counted), each conversation's second turn both restoring the
    first turn's checkpoints and from scratch (another cache_salt): the outputs, and the
    acceptance of the restored run equal to that of the scratch run.

Prints the acceptance items (verification / decode at k = 3, batch 1 and 16; MTP tok/s over
off at batch 1, 16 and 64; exactness) and the tables, and writes JSON to --out (rewritten after
each stage, "partial": true until the end, so a run cut short keeps its rows).

    python benchmarks/spec_decode.py --train-head --out $OUT/spec_decode.json \\
        --policy-table $OUT/step_costs.json                                   # on the H200
    python benchmarks/spec_decode.py --quick --train-head --out /tmp/spec.json   # tiny model, CPU

or in two calls, the trained model dir kept between them (benchmarks/train_mtp_head.py, then
--model-dir DIR).
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
from engine.models.registry import load_model_config  # noqa: E402
from engine.speculative.policy import (  # noqa: E402
    STEP_COSTS_ENV, STEP_COSTS_PATH, model_signature, trained_head_acceptance,
)
from harness import markdown_table, write_result  # noqa: E402

DECODE_BATCHES = (1, 16, 64)
COST_BATCHES = (1, 16, 64)
STAGES = ("train", "cost", "decode", "exactness")
MTP_HEAD_SEED = 7  # random_mtp_head_seed of the MTP rows without a trained head
BF16_NEAR_TIE_STEPS = 4  # a divergence at a top-2 gap within this many bf16 steps is a near-tie
# issue 45's acceptance figures, printed beside what the run measured
TARGETS = {"verify_over_decode": {1: 1.4, 16: 2.0}, "mtp_speedup": {1: 1.8, 16: 1.2, 64: 1.0}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON path")
    parser.add_argument("--quick", action="store_true", help="the tiny model on the CPU (a smoke run)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the model to measure (default: the 1.5B random model, built as bench_gpu.py "
                             "builds it; --quick: the tiny model), e.g. one train_mtp_head.py wrote")
    parser.add_argument("--train-head", action="store_true", help="train the MTP head first (stage train)")
    parser.add_argument("--train-steps", type=int, default=None, help="its steps (train_mtp_head's default)")
    parser.add_argument("--policy-table", type=Path, default=None,
                        help="where the cost stage writes the policy's table (default: beside --out)")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--span", type=int, default=64, help="tokens of P")
    parser.add_argument("--output-tokens", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--context", type=int, default=1024, help="context of the step-cost rows")
    parser.add_argument("--repeats", type=int, default=30, help="timed steps of each step-cost row")
    parser.add_argument("--conversations", type=int, default=8, help="conversations of the exactness stage")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES),
                        help="the parts to run (default: all; train only with --train-head)")
    args = parser.parse_args(argv)
    if args.quick:  # seconds on the CPU
        args.span, args.output_tokens, args.context, args.repeats = 12, 12, 64, 3
        args.conversations = min(args.conversations, 2)
    return args


def engine_config(model_dir: Path, quick: bool, **changes) -> EngineConfig:
    """64 sequences of up to 2,048 tokens (the quick run: the CPU defaults); speculation off
    unless `changes` say otherwise."""
    changes = {"num_speculative_tokens": 0, **changes}
    if quick:
        return EngineConfig(model_dir=str(model_dir), max_model_len=1024, max_num_seqs=64, **changes)
    # 64 state slots of the 1.5B model are 2.7 GB (each speculating engine adds k + 1 scratch
    # slots per slot outside the budget); 64 sequences of 500 tokens about 0.3 GB of KV
    return EngineConfig(model_dir=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=2048,
                        max_num_seqs=64, max_num_batched_tokens=8192, kv_cache_bytes=2 << 30,
                        state_cache_bytes=3 << 30, checkpoint_cache_bytes=1 << 30, **changes)


def mtp_changes(model_dir: Path, k: int) -> dict:
    """The MTP drafter with the model dir's trained head, else a random one."""
    trained = trained_head_acceptance(model_dir) is not None
    return {"num_speculative_tokens": k, "speculative_drafter": "mtp",
            "random_mtp_head_seed": None if trained else MTP_HEAD_SEED}


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
        "acceptance_by_depth": [
            (a - a0) / (p - p0) if p - p0 else 0.0
            for a, a0, p, p0 in zip(after.depth_accepted, before.depth_accepted, after.depth_proposed, before.depth_proposed)],
    }


def span_copying_prompts(engine: LLMEngine, count: int, span: int, vocab: int, params: SamplingParams) -> list[list[int]]:
    """P + C + P for `count` random spans P (ids 100..vocab-1), C the engine's greedy
    continuation of P."""
    rng = random.Random(25)
    spans = [[rng.randrange(100, vocab) for _ in range(span)] for _ in range(count)]
    continued = run_batch(engine, spans, params, "spans")["tokens"]
    return [p + continued[f"spans-{i}"] + p for i, p in enumerate(spans)]


# ----------------------------------------------------------------- stage train


def train_stage(model_dir: Path, args: argparse.Namespace, tmp: Path) -> tuple[Path, dict]:
    """The trained model dir and train_mtp_head's report."""
    import train_mtp_head

    out_dir = tmp / "with-mtp-head"
    argv = ["--out-dir", str(out_dir), "--model-dir", str(model_dir), "--k", str(args.k)]
    argv += ["--cpu"] if args.quick else []
    argv += ["--steps", str(args.train_steps)] if args.train_steps is not None else []
    settings = train_mtp_head.settings_of(train_mtp_head.parse_args(argv))
    report = train_mtp_head.train(model_dir, out_dir, settings)
    return out_dir, {"kind": "train", **{k: v for k, v in report.items() if k != "losses"}}


# ----------------------------------------------------------------- stage cost


def step_cost_rows(model_dir: Path, args: argparse.Namespace, drafter: str) -> list[dict]:
    """The wall time of a verification step against a plain decode step, at each batch. With
    drafter "mtp" the worker drafts with the MTP head and every chunk asks for drafts
    (propose_drafts), so each step also runs the head over its positions and k draft depths:
    against the "ngram" rows (whose drafts come from the scheduler, not the worker) that is
    what MTP drafting adds to a step."""
    from roofline.model import BLOCK_SIZE, chunk, sized_config

    k = args.k
    blocks_per_seq = -(-(args.context + k + 2) // BLOCK_SIZE)
    config = engine_config(model_dir, args.quick, num_speculative_tokens=k)
    proposing = {}
    if drafter == "mtp":
        config = replace(config, **mtp_changes(model_dir, k))
        proposing = {"propose_drafts": k, "sample": True}
    config = sized_config(config, max(COST_BATCHES), blocks_per_seq)
    worker = Worker(config)
    graphs, verify_graphs = worker.decode_graphs, getattr(worker, "verify_graphs", None)
    vocab = worker.model.config.vocab_size
    rng = random.Random(3)
    rows = []
    for batch in COST_BATCHES:
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
        row = {"kind": "step_cost", "drafter": drafter, "batch": batch, "k": k, "context": args.context,
               "verify_route": "graph" if verify_graphs is not None and verify_graphs.accepts(list(steps["verify_graph"].chunks)) else "eager"}
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
        print(f"{drafter} batch {batch}: verify {row['verify_route']} {row['verify_graph_ms']:.2f} ms, eager "
              f"{row['verify_eager_ms']:.2f} ms; decode graph {row['decode_graph_ms']:.2f} ms, eager "
              f"{row['decode_eager_ms']:.2f} ms", flush=True)
        rows.append(row)
    del worker
    return rows


def policy_entry(model_dir: Path, dtype: str, device: str, rows: list[dict], acceptance: list[float] | None) -> dict:
    """The policy table's entry for this model from the cost rows (engine/speculative/policy.py
    StepCosts): plain decode and verification through the routes the engine takes, and what
    MTP drafting adds (its verification row over the n-gram one, which drafts in the scheduler)."""
    ngram = {r["batch"]: r for r in rows if r["kind"] == "step_cost" and r["drafter"] == "ngram"}
    mtp = {r["batch"]: r for r in rows if r["kind"] == "step_cost" and r["drafter"] == "mtp"}
    k = str(next(iter(ngram.values()))["k"])
    entry = {
        "device": device, "model": model_signature(load_model_config(model_dir), dtype),
        "source": "benchmarks/spec_decode.py", "context": next(iter(ngram.values()))["context"],
        "decode_ms": {str(b): round(r["decode_graph_ms"], 4) for b, r in sorted(ngram.items())},
        "verify_ms": {k: {str(b): round(r["verify_graph_ms"], 4) for b, r in sorted(ngram.items())}},
    }
    if mtp:
        entry["draft_ms"] = {"mtp": {k: {str(b): round(max(0.0, mtp[b]["verify_graph_ms"] - ngram[b]["verify_graph_ms"]), 4)
                                         for b in sorted(mtp) if b in ngram}}}
    if acceptance is not None:
        entry["acceptance"] = {"mtp": [round(a, 4) for a in acceptance]}
    return entry


def write_policy_table(path: Path, entry: dict) -> None:
    """The checked-in table (engine/speculative/step_costs.json) with this model's entry
    replaced by `entry` (or added), at `path`."""
    table = json.loads(STEP_COSTS_PATH.read_text())
    table["entries"] = [e for e in table["entries"] if e["model"] != entry["model"]] + [entry]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=2) + "\n")


# ----------------------------------------------------------------- stage decode


def engine_rows(model_dir: Path, args: argparse.Namespace, save) -> list[dict]:
    """Decode tokens/s at each batch, speculation off, with n-gram drafts, with MTP drafts
    and as the policy chooses (auto), on span-copying prompts; one engine at a time (each
    speculating engine's scratch slots are several times its state budget)."""
    config = engine_config(model_dir, args.quick)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    configs = {"off": config, "ngram": replace(config, num_speculative_tokens=args.k),
               "mtp": replace(config, **mtp_changes(model_dir, args.k)),
               "auto": replace(config, num_speculative_tokens=None)}
    rows, prompts = [], None
    for label, changed in configs.items():
        engine = LLMEngine(changed)
        if prompts is None:  # the plain engine's continuations
            prompts = span_copying_prompts(engine, max(DECODE_BATCHES), args.span, engine.vocab_size, params)
        choice = engine.speculation_choice
        if label == "auto":
            print(f"policy: {choice}", flush=True)
        for batch in DECODE_BATCHES:
            run_batch(engine, prompts[:batch], replace(params, max_tokens=8), f"warm-{label}-{batch}")
            result = run_batch(engine, prompts[:batch], params, f"{label}-{batch}")
            outputs = result.pop("tokens")
            rows.append({"kind": "decode", "batch": batch, "speculation": label, **result,
                         "outputs": [outputs[f"{label}-{batch}-{i}"] for i in range(batch)]})
            if label == "auto":
                rows[-1]["policy"] = None if choice is None else {
                    "drafter": choice.drafter, "k": choice.k, "max_batch_size": choice.max_batch_size,
                    "expected_tokens": choice.expected_tokens, "speedup": choice.speedup}
            print(f"batch {batch} {label}: {result['tokens_per_s']:.1f} tok/s, acceptance "
                  f"{result['acceptance']:.2f} by depth {[round(a, 2) for a in result['acceptance_by_depth']]}", flush=True)
            save(rows)
        engine.shutdown()
        del engine
        release_device_memory()
    off = {r["batch"]: r for r in rows if r["speculation"] == "off"}
    for row in rows:
        if row["speculation"] != "off":
            row["same_outputs_as_off"] = row["outputs"] == off[row["batch"]]["outputs"]
            row["speedup_over_off"] = row["tokens_per_s"] / off[row["batch"]]["tokens_per_s"]
    rows.sort(key=lambda r: (r["batch"], list(configs).index(r["speculation"])))
    return rows


def release_device_memory() -> None:
    """Free what a dropped engine held on the GPU (its caches, graphs and weights)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------- stage exactness


def _bf16_step(magnitude: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(magnitude, 1e-30))) - 7)


def first_divergence(got: list[int], want: list[int], logits: list[torch.Tensor], fp32: bool) -> dict | None:
    """None if got == want; else where they first differ and whether it is a near-tie of
    the spec-off logits (fp32: a gap below 1e-4; bf16: within BF16_NEAR_TIE_STEPS steps)."""
    for position, (a, b) in enumerate(zip(got, want)):
        if a != b:
            top2 = torch.topk(logits[position].float(), 2).values
            gap = float(top2[0] - top2[1])
            bound = 1e-4 if fp32 else BF16_NEAR_TIE_STEPS * _bf16_step(float(top2.abs().max()))
            return {"position": position, "gap": gap, "near_tie": gap < bound}
    return None if len(got) == len(want) else {"position": min(len(got), len(want)), "gap": None, "near_tie": False}


def exactness_rows(model_dir: Path, args: argparse.Namespace) -> list[dict]:
    """Two-turn conversations (module docstring): the MTP engine against a plain one, the
    second turn restored and from scratch."""
    config = engine_config(model_dir, args.quick)
    off, on = LLMEngine(config), LLMEngine(replace(config, **mtp_changes(model_dir, args.k)))
    rng = random.Random(45)
    words = "river stone light paper north quiet garden window market winter answer table bridge".split()
    system = "You are a careful assistant. " + " ".join(rng.choice(words) for _ in range(40))
    users = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    with_logits = replace(params, return_logits=True)

    def render(conversation):
        return [int(t) for t in off.tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                                  tokenize=True, return_dict=False)]

    def run(engine, prompts, salt, sampling):
        for i, prompt in enumerate(prompts):
            engine.add_request(GenerationRequest(f"{salt}-{i}", prompt, sampling, cache_salt=salt))
        outs = {f"{salt}-{i}": ([], []) for i in range(len(prompts))}
        before = engine.stats().speculation.copy()
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id][0].extend(out.new_token_ids)
                if out.logits is not None:
                    outs[out.request_id][1].append(out.logits)
        after = engine.stats().speculation
        accepted = [a - b for a, b in zip(after.depth_accepted, before.depth_accepted)]
        proposed = [a - b for a, b in zip(after.depth_proposed, before.depth_proposed)]
        return [outs[f"{salt}-{i}"] for i in range(len(prompts))], (accepted, proposed)

    first = [[{"role": "system", "content": system}, {"role": "user", "content": u}] for u in users]
    turn1_off, _ = run(off, [render(c) for c in first], "conv", with_logits)
    turn1_on, _ = run(on, [render(c) for c in first], "conv", params)
    second = [c + [{"role": "assistant", "content": off.tokenizer.decode(o[0])},
                   {"role": "user", "content": "and then?"}] for c, o in zip(first, turn1_off)]
    prompts2 = [render(c) for c in second]
    turn2_off, _ = run(off, prompts2, "scratch-off", with_logits)
    turn2_restored, restored_counts = run(on, prompts2, "conv", params)  # restores turn 1's checkpoints
    turn2_scratch, scratch_counts = run(on, prompts2, "scratch-on", params)  # nothing to restore
    divergences = []
    for label, got, want in (("turn 1", turn1_on, turn1_off), ("turn 2 restored", turn2_restored, turn2_off),
                             ("turn 2 scratch", turn2_scratch, turn2_off)):
        for i, (g, w) in enumerate(zip(got, want)):
            d = first_divergence(g[0], w[0], w[1], fp32=args.quick)
            if d is not None:
                divergences.append({"run": label, "conversation": i, **d})
    stats = on.stats()
    row = {
        "kind": "exactness", "conversations": len(users), "requests": 3 * len(users),
        "divergences": divergences, "near_ties": sum(d["near_tie"] for d in divergences),
        "exact": all(d["near_tie"] for d in divergences),
        "restored_turn_equals_scratch": [g[0] for g in turn2_restored] == [g[0] for g in turn2_scratch],
        "depth_accepted_restored": restored_counts[0], "depth_proposed_restored": restored_counts[1],
        "depth_accepted_scratch": scratch_counts[0], "depth_proposed_scratch": scratch_counts[1],
        "acceptance_restored_equals_scratch": restored_counts == scratch_counts,
        "checkpoint_hits": {kind: c.hit for kind, c in stats.checkpoints.items()},
    }
    off.shutdown()
    on.shutdown()
    print(f"exactness: {row['requests']} requests, divergences {len(divergences)} (near-ties {row['near_ties']}), "
          f"restored == scratch {row['restored_turn_equals_scratch']}, acceptance equal "
          f"{row['acceptance_restored_equals_scratch']}, hits {row['checkpoint_hits']}", flush=True)
    return [row]


# ----------------------------------------------------------------- report


def acceptance_items(rows: list[dict]) -> dict:
    """The issue's acceptance figures from the rows (None where a stage did not run)."""
    cost = {r["batch"]: r for r in rows if r["kind"] == "step_cost" and r["drafter"] == "ngram"}
    decode = {(r["batch"], r["speculation"]): r for r in rows if r["kind"] == "decode"}
    exact = next((r for r in rows if r["kind"] == "exactness"), None)
    return {
        "verify_over_decode": {b: cost[b]["verify_graph_over_decode_graph"] for b in (1, 16) if b in cost},
        "mtp_speedup": {b: decode[(b, "mtp")]["speedup_over_off"] for b in DECODE_BATCHES if (b, "mtp") in decode},
        "auto_speedup": {b: decode[(b, "auto")]["speedup_over_off"] for b in DECODE_BATCHES if (b, "auto") in decode},
        "outputs_equal_off": all(r.get("same_outputs_as_off", True) for r in rows if r["kind"] == "decode"),
        "exact_with_restores": None if exact is None else exact["exact"],
        "acceptance_after_restore_equals_scratch": None if exact is None else exact["acceptance_restored_equals_scratch"],
    }


def print_report(rows: list[dict], items: dict, k: int) -> None:
    print(markdown_table(
        ["item", "measured", "target"],
        [[f"verify (k = {k}) / decode, batch {b}", f"{v:.2f}x", f"<= {TARGETS['verify_over_decode'][b]}x"]
         for b, v in items["verify_over_decode"].items()]
        + [[f"MTP k = {k} tok/s / off, batch {b}", f"{v:.2f}x", f">= {TARGETS['mtp_speedup'][b]}x"]
           for b, v in items["mtp_speedup"].items()]
        + [[f"policy (auto) tok/s / off, batch {b}", f"{v:.2f}x", ">= 1.0x"] for b, v in items["auto_speedup"].items()]
        + [["outputs equal speculation off (decode rows)", str(items["outputs_equal_off"]), "True"],
           ["exact with restores (near-ties counted)", str(items["exact_with_restores"]), "True"],
           ["acceptance after a restore equals without", str(items["acceptance_after_restore_equals_scratch"]), "True"]]))
    decode = [r for r in rows if r["kind"] == "decode"]
    if decode:
        print()
        print(markdown_table(
            ["batch", "speculation", "decode tok/s", "x off", "acceptance", "by depth", "same outputs"],
            [[str(r["batch"]), r["speculation"], f"{r['tokens_per_s']:.1f}", f"{r.get('speedup_over_off', 1.0):.2f}",
              f"{r['acceptance']:.2f}", str([round(a, 2) for a in r["acceptance_by_depth"]]),
              str(r.get("same_outputs_as_off", ""))] for r in decode]))
    cost = [r for r in rows if r["kind"] == "step_cost"]
    if cost:
        print()
        print(markdown_table(
            ["drafter", "batch", "verify route", "verify ms", "verify ms (eager)", "decode ms (graph)",
             "decode ms (eager)", "verify / decode"],
            [[r["drafter"], str(r["batch"]), r["verify_route"], f"{r['verify_graph_ms']:.3f}",
              f"{r['verify_eager_ms']:.3f}", f"{r['decode_graph_ms']:.3f}", f"{r['decode_eager_ms']:.3f}",
              f"{r['verify_graph_over_decode_graph']:.2f}"] for r in cost]))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.quick else "cpu"
    report: dict = {"k": args.k, "span": args.span, "output_tokens": args.output_tokens, "device": device,
                    "torch": torch.__version__}
    rows: list[dict] = []

    def save(current: list[dict], partial: bool = True) -> None:
        write_result(args.out, "spec_decode", {**report, "rows": current, "partial": partial})

    with tempfile.TemporaryDirectory() as tmp:
        from bench_gpu import model_dir_of

        model_dir = args.model_dir or model_dir_of(argparse.Namespace(quick=args.quick), Path(tmp))
        print(f"model {model_dir} ({time.perf_counter() - t_start:.0f}s)", flush=True)
        table = args.policy_table or args.out.with_name("step_costs.json")
        for name in args.stages:
            try:
                if name == "train" and args.train_head:
                    model_dir, row = train_stage(model_dir, args, Path(tmp))
                    rows.append(row)
                elif name == "cost":
                    rows += step_cost_rows(model_dir, args, "ngram") + step_cost_rows(model_dir, args, "mtp")
                    dtype = engine_config(model_dir, args.quick).dtype
                    acceptance = trained_head_acceptance(model_dir)
                    write_policy_table(table, policy_entry(model_dir, dtype, device, rows, acceptance))
                    os.environ[STEP_COSTS_ENV] = str(table)  # the auto rows' policy reads these figures
                    report["policy_table"] = str(table)
                elif name == "decode":
                    rows += engine_rows(model_dir, args, lambda r: save(rows + r))
                elif name == "exactness":
                    rows += exactness_rows(model_dir, args)
            except Exception:  # keep the rows of the stages that ran
                report.setdefault("errors", []).append(traceback.format_exc())
                traceback.print_exc()
            save(rows)
    report["wall_seconds"] = time.perf_counter() - t_start
    report["acceptance"] = acceptance_items(rows)
    print_report(rows, report["acceptance"], args.k)
    save(rows, partial=False)
    print(f"wrote {args.out} ({report['wall_seconds']:.0f} s)")
    return {**report, "rows": rows}


if __name__ == "__main__":
    main()
