"""Checkpoint eviction by value (prefill compute saved per byte, with recency) against LRU, on
one mixed workload at several checkpoint budgets.

    .venv/bin/python benchmarks/eviction_value.py                       # CPU, the embedded model
    .venv/bin/python benchmarks/eviction_value.py --out /tmp/e.json

The workload (the same sequence for every run, one request at a time, one output token): each
round asks every long instruction once with a new user message, and between two of them every
short prompt twice in a row (the same words in every round). Long instructions save the most
per byte and come back only once a round; the short prompts come back at once but save little.
With the checkpoint budget holding `--budget-bundles` bundles (state, attention tail and hidden
row each), it counts per policy the prompt tokens restored and computed, the prefill FLOPs
saved (engine/checkpoints/prefill_cost.py's estimate), the checkpoints evicted and the wall time.
Prints a table and writes JSON (--out, default benchmarks/results/eviction_value.json).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from engine.checkpoints.prefill_cost import prefill_cost  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig  # noqa: E402
from engine.interfaces.generation_request import GenerationRequest  # noqa: E402
from engine.interfaces.sampling_params import SamplingParams  # noqa: E402
from engine.models.registry import load_model_config  # noqa: E402
from harness import add_out_argument, markdown_table, write_result  # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
POLICIES = ("lru", "value")


def mixed_workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int | None]]:
    """(prompt, instruction boundary or None) in arrival order (see the module doc)."""
    rng = random.Random(args.seed)
    tokens = lambda n: [rng.randrange(2, vocab_size) for _ in range(n)]  # noqa: E731
    instructions = [tokens(args.instruction_tokens) for _ in range(args.instructions)]
    shorts = [tokens(args.short_tokens) for _ in range(args.shorts)]
    requests: list[tuple[list[int], int | None]] = []
    for _ in range(args.rounds):
        for instruction in instructions:
            requests.append((instruction + tokens(args.user_tokens), args.instruction_tokens))
            requests += [(short, None) for short in shorts for _ in range(2)]
    return requests


def run(args: argparse.Namespace, policy: str, budget: int, workload, cost) -> dict:
    engine = LLMEngine(EngineConfig(
        model_dir=args.model_dir, device=args.device, dtype=args.dtype,
        checkpoint_slots=("prompt", "instruction"), checkpoint_cache_bytes=budget,
        checkpoint_eviction=policy, checkpoint_value_half_life=args.half_life))
    started = time.perf_counter()
    flops_saved = 0.0
    for i, (prompt, boundary) in enumerate(workload):
        engine.add_request(GenerationRequest(f"r{i}", prompt, ONE_TOKEN, instruction_boundary=boundary))
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    flops_saved += cost.flops(output.num_cached_tokens)
    seconds = time.perf_counter() - started
    stats = engine.stats()
    engine.shutdown()
    return {
        "restored": stats.scheduler.prompt_tokens_restored,
        "computed": stats.scheduler.prompt_tokens_computed,
        "evicted": sum(c.evicted for c in stats.checkpoints.values()),
        "hits": sum(c.hit for c in stats.checkpoints.values()),
        "prefill_flops_saved": flops_saved,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--instructions", type=int, default=3)
    parser.add_argument("--instruction-tokens", type=int, default=800)
    parser.add_argument("--user-tokens", type=int, default=16)
    parser.add_argument("--shorts", type=int, default=8)
    parser.add_argument("--short-tokens", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-bundles", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--half-life", type=float, default=128.0)
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser, "eviction_value")
    args = parser.parse_args()

    model_config = load_model_config(args.model_dir)
    cost = prefill_cost(model_config)
    workload = mixed_workload(args, model_config.vocab_size)
    probe = LLMEngine(EngineConfig(model_dir=args.model_dir, device=args.device, dtype=args.dtype))
    capacity = probe.executor.cache_capacity()
    bundle_bytes = capacity.bundle_sizing.bundle_bytes(capacity.block_size - 1)
    probe.shutdown()

    rows, results = [], []
    for bundles in args.budget_bundles:
        for policy in POLICIES:
            result = {"budget_bundles": bundles, "budget_bytes": bundles * bundle_bytes, "policy": policy,
                      **run(args, policy, bundles * bundle_bytes, workload, cost)}
            total = result["restored"] + result["computed"]
            result["restored_fraction"] = result["restored"] / total
            results.append(result)
            rows.append([str(bundles), policy, f"{result['restored']:,}", f"{result['computed']:,}",
                         f"{result['restored_fraction']:.1%}", f"{result['prefill_flops_saved']:.3g}", str(result["hits"]), str(result["evicted"]),
                         f"{result['seconds']:.1f}"])
    print(markdown_table(["budget (bundles)", "eviction", "prompt tokens restored", "computed", "restored",
                          "FLOPs saved", "hits", "evicted", "wall s"], rows))
    out = write_result(args.out, "eviction_value", {
        "workload": {"requests": len(workload), "instructions": args.instructions,
                     "instruction_tokens": args.instruction_tokens, "user_tokens": args.user_tokens,
                     "shorts": args.shorts, "short_tokens": args.short_tokens, "rounds": args.rounds,
                     "seed": args.seed},
        "model_dir": args.model_dir, "device": args.device, "dtype": args.dtype,
        "half_life": args.half_life, "bundle_bytes": bundle_bytes,
        "prefill_cost": {"flops_per_token": cost.flops_per_token, "flops_per_token_pair": cost.flops_per_token_pair},
        "results": results,
    })
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
