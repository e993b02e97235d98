"""Tensor parallelism on GPUs: agreement with tp=1 under three-slot checkpoints, and speed.

    python3 benchmarks/tp_gpu.py --tp 1 2 4 --out $OUT/tp_gpu.json     # one process per GPU

Runs on the GPU machine without Ray: first the reference, tp=1 in this process (engine.worker.
Worker, no torch.distributed) with in_pass_capture off, so it cuts prefill chunks at the
instruction boundary (the split path); then each tensor_parallel_size gets an LLMEngine over a
MultiprocessExecutor (one spawned process per GPU, NCCL for the model's collectives, the same
RankWorker code the Ray actors run; tp=1 also goes through NCCL, at world size 1, and takes
the instruction checkpoint inside the forward pass (in-pass capture, single-rank CUDA). The model
is the ~1.5B GraniteMoeHybrid config of roofline/model.py with random bf16 weights. Sizes that
need more GPUs than the machine has are listed under "not_run".

Agreement: 20 prompts (4 long instructions x 5 user messages, then a second turn on each
instruction's first conversation), greedy, all three checkpoint slots on. The first request of
each instruction captures its instruction checkpoint; the others restore it; second turns
restore the response checkpoint. Each tp's tokens and cached_tokens are compared with the first
tp in --tp. A differing token is a near-tie when the reference's top-2 logit gap at the first
difference is below 4x the largest logit difference between the two runs at that position;
near-ties are counted, other differences fail the run (exit code 1).

Speed, per tp: decode tokens/s at batch 1 and 64 with 1,024 tokens of context; per-step
overhead (step wall - rank 0's Worker.execute); cold 8,192-token prefill; instruction restore +
256-token prefill vs the cold 8,448-token prefill; NCCL all-reduce bus bandwidth (tp > 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.core.llm_engine import LLMEngine
from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig
from engine.execution.multiprocess_executor import MultiprocessExecutor
from engine.execution.worker import Worker
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.sampling_params import SamplingParams
from harness import add_out_argument, markdown_table, write_result
from roofline.model import CONFIG_1P5B, write_random_checkpoint

# NVLink multicast stays off on the shared GPU hosts this runs on (see the device notes); the
# spawned rank processes inherit these.
NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                        "NVSHMEM_DISABLE_NVLS": "1"}

NUM_INSTRUCTIONS = 4
USERS_PER_INSTRUCTION = 5
USER_TOKENS = 40
AGREEMENT_TOKENS = 24
DECODE_BATCHES = (1, 64)


@dataclass(frozen=True)
class Sizes:
    instruction_tokens: int = 600
    decode_context: int = 1024
    long_prefix: int = 8192
    user_message: int = 256


# --smoke: the embedded tiny model on CPU with short prompts, to check the script itself.
SMOKE_SIZES = Sizes(instruction_tokens=40, decode_context=64, long_prefix=192, user_message=32)


def random_ids(generator: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=generator).tolist()  # 0/1: EOS/pad


def run_to_completion(engine: LLMEngine, requests: dict[str, tuple[list[int], int | None]],
                      params: SamplingParams, salt: str | None = None) -> dict[str, dict]:
    """Add all requests, step until done; per request: tokens, cached tokens, logits rows,
    and the time from the first step to its first token."""
    for request_id, (prompt, boundary) in requests.items():
        engine.add_request(GenerationRequest(request_id, prompt, params, cache_salt=salt,
                                             instruction_boundary=boundary))
    results = {rid: {"tokens": [], "logits": [], "cached": 0, "ttft_s": None} for rid in requests}
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in results:
                continue
            result = results[out.request_id]
            if out.new_token_ids and result["ttft_s"] is None:
                result["ttft_s"] = time.perf_counter() - started
            result["tokens"] += list(out.new_token_ids)
            if out.logits is not None:
                result["logits"].append(out.logits)
            result["cached"] = out.num_cached_tokens
    return results


def agreement_workload(engine: LLMEngine, vocab: int, sizes: Sizes) -> dict[str, dict]:
    """Instruction reuse then second turns (see module doc); results by request id."""
    generator = torch.Generator().manual_seed(7)
    params = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0, ignore_eos=True,
                            return_logits=True)
    results: dict[str, dict] = {}
    first_turns = {}
    for i in range(NUM_INSTRUCTIONS):
        instruction = random_ids(generator, sizes.instruction_tokens, vocab)
        prompts = {f"i{i}u{u}": instruction + random_ids(generator, USER_TOKENS, vocab)
                   for u in range(USERS_PER_INSTRUCTION)}
        first = f"i{i}u0"
        results |= run_to_completion(engine, {first: (prompts[first], sizes.instruction_tokens)}, params)
        rest = {rid: (p, sizes.instruction_tokens) for rid, p in prompts.items() if rid != first}
        results |= run_to_completion(engine, rest, params)
        first_turns[first] = prompts[first] + results[first]["tokens"]
    second = {f"{rid}t2": (history + random_ids(generator, USER_TOKENS, vocab), sizes.instruction_tokens)
              for rid, history in first_turns.items()}
    results |= run_to_completion(engine, second, params)
    return results


def compare(reference: dict[str, dict], other: dict[str, dict]) -> dict:
    """Token agreement, near-ties at first differences, cached_tokens agreement."""
    identical, near_ties, mismatches, cached_differ = 0, [], [], []
    for rid, ref in reference.items():
        got = other[rid]
        if got["cached"] != ref["cached"]:
            cached_differ.append((rid, ref["cached"], got["cached"]))
        if got["tokens"] == ref["tokens"]:
            identical += 1
            continue
        step = next(i for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"])) if a != b)
        ref_row, got_row = ref["logits"][step].float(), got["logits"][step].float()
        top2 = ref_row.topk(2).values
        gap = float(top2[0] - top2[1])
        noise = float((ref_row - got_row).abs().max())
        (near_ties if gap < 4 * noise else mismatches).append(
            {"request": rid, "position": step, "top2_gap": gap, "max_logit_diff": noise})
    return {"requests": len(reference), "identical": identical, "near_ties": near_ties,
            "mismatches": mismatches, "cached_tokens_differ": cached_differ}


def decode_speed(engine: LLMEngine, batch: int, vocab: int, context: int) -> dict:
    generator = torch.Generator().manual_seed(100 + batch)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(GenerationRequest(f"d{batch}-{i}", random_ids(generator, context, vocab), params))
    walls, models = [], []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - started
        if engine.last_step is None:
            continue  # collected nothing (async scheduling's first call)
        chunks = engine.last_step.scheduler_output.chunks
        if len(chunks) == batch and all(len(c.token_ids) == 1 for c in chunks):
            walls.append(wall)
            models.append(engine.last_step.runner_output.worker_seconds)
    walls, models = walls[3:], models[3:]
    step = statistics.median(walls)
    return {"batch": batch, "context": context, "step_ms": 1e3 * step,
            "tokens_per_s": batch / step,
            "overhead_ms": 1e3 * statistics.median(w - m for w, m in zip(walls, models))}


def prefill_speed(engine: LLMEngine, vocab: int, sizes: Sizes) -> dict:
    """Cold 8,192 TTFT; cold 8,448 with the instruction captured at 8,192; then another user
    message after restoring that instruction checkpoint."""
    generator = torch.Generator().manual_seed(5)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    instruction = random_ids(generator, sizes.long_prefix, vocab)
    cold = run_to_completion(engine, {"cold8k": (random_ids(generator, sizes.long_prefix, vocab), None)},
                             one, salt="cold")["cold8k"]
    cold_full = run_to_completion(
        engine, {"cold8448": (instruction + random_ids(generator, sizes.user_message, vocab), sizes.long_prefix)},
        one)["cold8448"]
    warm = run_to_completion(
        engine, {"warm256": (instruction + random_ids(generator, sizes.user_message, vocab), sizes.long_prefix)},
        one)["warm256"]
    return {"cold_prefill_8192_s": cold["ttft_s"], "cold_prefill_8448_with_capture_s": cold_full["ttft_s"],
            "restore_plus_256_s": warm["ttft_s"], "restored_tokens": warm["cached"],
            "speedup_vs_cold_8448": cold_full["ttft_s"] / warm["ttft_s"]}


def all_reduce_bandwidth(world_size: int) -> float | None:
    """NCCL all-reduce bus bandwidth (bytes/s) over world_size GPUs, 256 MiB bf16 messages."""
    if world_size == 1:
        return None
    import torch.multiprocessing as mp

    from engine.execution.rank_worker import Rendezvous

    rendezvous = Rendezvous.on_free_port("127.0.0.1", world_size)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_all_reduce_rank, args=(rendezvous, queue), nprocs=world_size, join=True)
    return queue.get()


def _all_reduce_rank(rank: int, rendezvous, queue) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://{rendezvous.host}:{rendezvous.port}",
                            rank=rank, world_size=rendezvous.world_size)
    tensor = torch.ones(128 << 20, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        dist.all_reduce(tensor)
    torch.cuda.synchronize()
    repeats = 10
    started = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(tensor)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / repeats
    n = rendezvous.world_size
    if rank == 0:
        queue.put(2 * (n - 1) / n * tensor.numel() * tensor.element_size() / seconds)
    dist.destroy_process_group()


def summary_table(runs: dict[str, dict]) -> str:
    """One markdown row per run: agreement with the reference, decode and prefill speed."""
    rows = []
    for tp, run in runs.items():
        agreement, decode, prefill = run["agreement"], run["decode"], run["prefill"]
        bus = run["all_reduce_bus_bytes_per_s"]
        rows.append([
            tp, f"{agreement['identical']}/{agreement['requests']}", f"{len(agreement['near_ties'])}",
            f"{len(agreement['mismatches'])}", f"{decode[0]['tokens_per_s']:.0f}", f"{decode[1]['tokens_per_s']:.0f}",
            f"{decode[0]['overhead_ms']:.2f}", f"{prefill['cold_prefill_8192_s']:.3f}",
            f"{prefill['restore_plus_256_s']:.4f}", f"{prefill['speedup_vs_cold_8448']:.1f}",
            "-" if bus is None else f"{bus / 1e9:.0f}"])
    return markdown_table(
        ["tp", "identical", "near-ties", "mismatches", "decode b1 tok/s", "decode b64 tok/s", "overhead b1 ms",
         "cold 8K s", "restore+256 s", "speedup vs cold 8,448", "all-reduce GB/s"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    add_out_argument(parser, "tp_gpu")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model on CPU (gloo), short prompts: checks the script, not speed")
    args = parser.parse_args()
    for name, value in NVLINK_MULTICAST_OFF.items():
        os.environ.setdefault(name, value)

    sizes = SMOKE_SIZES if args.smoke else Sizes()
    gpus = 4 if args.smoke else torch.cuda.device_count()
    report: dict = {"device": "cpu" if args.smoke else torch.cuda.get_device_name(), "gpus": gpus,
                    "torch": torch.__version__, "sizes": sizes.__dict__,
                    "not_run": [tp for tp in args.tp if tp > gpus], "runs": {}}
    reference = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            base = EngineConfig(max_model_len=sizes.long_prefix + sizes.user_message + 64,
                                max_num_seqs=80, max_num_batched_tokens=512)
        else:
            model_dir = Path(tmp) / "granite-hybrid-1p5b-random"
            write_random_checkpoint(model_dir)
            # The engine detokenizes: borrow the embedded model's tokenizer (ids past its
            # vocabulary decode to empty text, which the agreement check never reads).
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                shutil.copy(Path(DEFAULT_MODEL_DIR) / name, model_dir / name)
            base = EngineConfig(model_dir=str(model_dir), dtype="bfloat16", device="cuda",
                                max_model_len=sizes.long_prefix + sizes.user_message + 64,
                                max_num_seqs=80,
                                max_num_batched_tokens=sizes.long_prefix + sizes.user_message,
                                kv_cache_bytes=4 << 30, state_cache_bytes=4 << 30,
                                checkpoint_cache_bytes=8 << 30)
        vocab = 200 if args.smoke else CONFIG_1P5B["vocab_size"]
        runs = [("1-inprocess-split", 1)] + [(str(tp), tp) for tp in args.tp if tp <= gpus]
        for label, tp in runs:
            started = time.perf_counter()
            config = replace(base, tensor_parallel_size=tp)
            if label == "1-inprocess-split":
                config = replace(config, in_pass_capture=False)
            executor = Worker(config) if tp == 1 and label.startswith("1-") else MultiprocessExecutor(config)
            engine = LLMEngine(config, executor=executor)
            run: dict = {"start_s": time.perf_counter() - started}
            try:
                results = agreement_workload(engine, vocab, sizes)
                run["cached_tokens"] = {rid: r["cached"] for rid, r in results.items()}
                if reference is None:
                    reference = results
                run["agreement"] = compare(reference, results)
                run["decode"] = [decode_speed(engine, batch, vocab, sizes.decode_context)
                                 for batch in DECODE_BATCHES]
                run["prefill"] = prefill_speed(engine, vocab, sizes)
                run["checkpoints"] = engine.stats().checkpoints
            finally:
                engine.shutdown()
                del engine, executor
                if not args.smoke:
                    torch.cuda.empty_cache()
            run["all_reduce_bus_bytes_per_s"] = (
                None if args.smoke or label.startswith("1-") else all_reduce_bandwidth(tp))
            report["runs"][label] = run
            print(f"tp={label}: {json.dumps({k: v for k, v in run.items() if k != 'cached_tokens'}, default=str)}",
                  flush=True)
    report["table"] = summary_table(report["runs"])
    print(report["table"])
    if report["not_run"]:
        print(f"not run (only {gpus} GPU(s)): tp={report['not_run']}")
    out = write_result(args.out, "tp_gpu", report)
    print(f"wrote {out}")
    bad = [tp for tp, run in report["runs"].items()
           if run["agreement"]["mismatches"] or run["agreement"]["cached_tokens_differ"]]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
