"""Checkpoint tiers (device, host, object store) and eviction by value on many long
instructions: the acceptance workload of issue 46.

    # one H200 (or H100), the 1.5B random-weight model written on the fly:
    python benchmarks/checkpoint_tiers.py --device cuda
    # the CPU version: the embedded model, smaller sizes
    .venv/bin/python benchmarks/checkpoint_tiers.py --cpu
    # a smoke run (CPU, tiny sizes, about a minute; writes under /tmp unless --out is given)
    .venv/bin/python benchmarks/checkpoint_tiers.py --quick

Workload: --instructions distinct instructions of --instruction-tokens tokens, each asked by
--users users (the instruction plus a user message of --user-tokens tokens, one output token),
all shuffled (--seed), --concurrency requests in flight. Only instruction checkpoints are taken
(checkpoint_slots [instruction]) and the device checkpoint budget holds --device-bundles of
them (checkpoint_cache_bytes; the KV budget holds their full blocks and the running requests').
Three configurations:

    (a) device, lru            no host tier, LRU eviction
    (b) tiers, lru             a host tier holding every instruction checkpoint, LRU in both tiers
    (c) tiers, value           the same, evicting by prefill compute saved per byte with recency
    (d) tiers + store, value   a host tier of --host-bundles checkpoints only, and below it a
                               stand-in for the object-store tier (benchmarks/in_process_store.py:
                               what the host tier evicts is checksummed and pickled on a worker
                               thread, a hit is unpickled there and imported checked in full;
                               Ray's own copy and transfer are left out, so it runs where Ray
                               is not installed)

For each: the instruction hit rate (follow-ups, i.e. requests after their instruction's first,
that restored at least the instruction), time to first token p50 / p95 (from add_request to the
first token, queueing included), promotions and demotions, and for (d) the copies stored and
fetched and the median time from a store lookup to the copy's import. Then the promotion time of one
instruction checkpoint from the host tier: from the lookup that starts its copy to the device
until it is published there (the copy, then the import), median of --promotions, with the
copy alone and the bytes moved. Each configuration first serves one request of its own in
another namespace, so compilation and CUDA graph capture are not timed. --parts runs some of
them (a b c d promotion, default all; e.g. `--parts d promotion` to fit a device call). Prints a
table and writes JSON (--out, default benchmarks/results/checkpoint_tiers[_cpu].json).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

from cache.cache_manager import BundleSizing  # noqa: E402
from engine.checkpoints.import_checks import expected_shard_layout  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig  # noqa: E402
from engine.interfaces.generation_request import GenerationRequest  # noqa: E402
from engine.interfaces.sampling_params import SamplingParams  # noqa: E402
from engine.models.registry import load_model_config  # noqa: E402
from engine.parallel.cache_capacity import kv_bytes_per_block, state_bytes_per_slot  # noqa: E402
from engine.parallel.shard_layout import rank_shard_layout  # noqa: E402
from engine.parallel.tensor_parallel import TensorParallel  # noqa: E402
from harness import default_out, markdown_table, middle, write_result  # noqa: E402
from in_process_store import InProcessStore  # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
# (label, eviction, tiers: None (device only), "host" (host tier for all), "store" (a small
# host tier over the stand-in store))
CONFIGURATIONS = (("(a) device, lru", "lru", None), ("(b) tiers, lru", "lru", "host"),
                  ("(c) tiers, value", "value", "host"), ("(d) tiers + store, value", "value", "store"))
PARTS = ("a", "b", "c", "d", "promotion")  # --parts: the configurations in order, then the promotion time
SIZES = {  # the acceptance sizes, --cpu and --quick
    "acceptance": dict(instructions=64, instruction_tokens=8000, users=4, user_tokens=64, device_bundles=8,
                       host_bundles=16, concurrency=4, batch_tokens=8192, promotions=20),
    "cpu": dict(instructions=16, instruction_tokens=500, users=4, user_tokens=24, device_bundles=4,
                host_bundles=4, concurrency=2, batch_tokens=512, promotions=20),
    "quick": dict(instructions=6, instruction_tokens=160, users=3, user_tokens=8, device_bundles=2,
                  host_bundles=2, concurrency=2, batch_tokens=256, promotions=5),
}


def workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt, instruction index) of every request, shuffled."""
    rng = random.Random(args.seed)
    tokens = lambda n: [rng.randrange(2, vocab_size) for _ in range(n)]  # noqa: E731
    instructions = [tokens(args.instruction_tokens) for _ in range(args.instructions)]
    requests = [(instructions[i] + tokens(args.user_tokens), i)
                for i in range(args.instructions) for _ in range(args.users)]
    rng.shuffle(requests)
    return requests


def engine_config(args: argparse.Namespace, model_dir: str, eviction: str, host_bytes: int) -> EngineConfig:
    """The device budgets: --device-bundles instruction checkpoints, KV blocks for their full
    blocks and the running requests'."""
    model_config = load_model_config(model_dir)
    layout = rank_shard_layout(model_config, TensorParallel.single())
    dtype = getattr(torch, args.dtype)
    block = EngineConfig().block_size
    block_bytes = kv_bytes_per_block(model_config, layout, dtype, block)
    slot_bytes = state_bytes_per_slot(model_config, layout, dtype)
    sizing = BundleSizing(slot_bytes, block_bytes // block, model_config.hidden_size * dtype.itemsize)
    request_tokens = args.instruction_tokens + args.user_tokens + 2
    blocks = -(-request_tokens // block)
    return EngineConfig(
        model_dir=model_dir, device=args.device, dtype=args.dtype, max_model_len=request_tokens + 16,
        max_num_seqs=args.concurrency, max_num_batched_tokens=args.batch_tokens,
        checkpoint_slots=("instruction",), checkpoint_eviction=eviction,
        checkpoint_cache_bytes=args.device_bundles * sizing.bundle_bytes(block - 1),
        kv_cache_bytes=(args.device_bundles + args.concurrency + 1) * blocks * block_bytes,
        state_cache_bytes=slot_bytes * (args.concurrency + 1), host_checkpoint_bytes=host_bytes)


def host_bytes_for(args: argparse.Namespace, model_dir: str, bundles: int) -> int:
    """A host tier holding `bundles` instruction checkpoints (the K/V of all their tokens), and
    the warm-up's."""
    layout = expected_shard_layout(load_model_config(model_dir), TensorParallel.single(), args.dtype)
    return (bundles + 1) * layout.nbytes(args.instruction_tokens)


def serve(engine: LLMEngine, requests, args: argparse.Namespace, salt: str) -> dict:
    """Run `requests` (prompt, instruction) with --concurrency in flight; TTFT and hits."""
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    pending = list(enumerate(requests))
    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    cached: dict[str, int] = {}
    while pending or engine.has_unfinished_requests():
        while pending and len(added) - len(cached) < args.concurrency:
            i, (prompt, _) = pending.pop(0)
            request_id = f"{salt}-{i}"
            engine.add_request(GenerationRequest(request_id, prompt, ONE_TOKEN, cache_salt=salt,
                                                 instruction_boundary=args.instruction_tokens))
            added[request_id] = time.perf_counter()
        for output in engine.step():
            if output.new_token_ids and output.request_id not in ttft:
                ttft[output.request_id] = time.perf_counter() - added[output.request_id]
            if output.finished:
                cached[output.request_id] = output.num_cached_tokens
    sync()
    seen: set[int] = set()
    follow_ups = hits = 0
    for i, (_, instruction) in enumerate(requests):
        if instruction in seen:
            follow_ups += 1
            hits += cached[f"{salt}-{i}"] >= args.instruction_tokens
        seen.add(instruction)
    times = sorted(ttft.values())
    return {"follow_ups": follow_ups, "hits": hits, "hit_rate": hits / max(follow_ups, 1),
            "ttft_p50_ms": 1e3 * middle(times), "ttft_p95_ms": 1e3 * times[int(0.95 * (len(times) - 1))]}


def run_configuration(args, model_dir: str, label: str, eviction: str, tiers: str | None, requests) -> dict:
    host_bytes = {None: 0, "host": host_bytes_for(args, model_dir, args.instructions),
                  "store": host_bytes_for(args, model_dir, args.host_bundles)}[tiers]
    engine = LLMEngine(engine_config(args, model_dir, eviction, host_bytes))
    store = None
    if tiers == "store":
        store = InProcessStore()
        engine.host_tier.on_evict = store.demote
        engine.add_checkpoint_source(store)  # asked after the host tier
    serve(engine, requests[:1], args, "warmup")
    started = time.perf_counter()
    result = serve(engine, requests, args, "run")
    stats = engine.stats()
    engine.shutdown()
    host = stats.host_tier
    row = {"configuration": label, **result, "seconds": time.perf_counter() - started,
           "host_checkpoint_bytes": host_bytes, "evicted_from_device": stats.checkpoints["instruction"].evicted,
           "promoted": host.promoted if host else 0, "demoted": host.demoted if host else 0,
           "host_evicted": host.evicted if host else 0}
    if store is not None:
        store.close()
        row.update(stored=store.stored, stored_pickled_bytes=store.stored_bytes, fetched=store.fetched,
                   store_restore_ms_median=1e3 * statistics.median(store.restore_seconds)
                   if store.restore_seconds else None)
    return row


def promotion_time(args, model_dir: str, requests) -> dict:
    """Promote one instruction checkpoint from the host tier --promotions times (it is evicted
    from the device again in between, which costs no copy: the host tier keeps it)."""
    config = engine_config(args, model_dir, "lru", host_bytes_for(args, model_dir, args.instructions))
    engine = LLMEngine(config)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    by_instruction = {}
    for prompt, instruction in requests:
        by_instruction.setdefault(instruction, prompt)
    first, *others = list(by_instruction.values())[: args.device_bundles + 1]
    serve(engine, [(first, 0)], args, "promote")  # its checkpoint ...
    serve(engine, [(p, i + 1) for i, p in enumerate(others)], args, "promote")  # ... pushed to the host
    namespace = (model_dir, "promote")
    instruction = tuple(first[: args.instruction_tokens])
    host, cache = engine.host_tier, engine.scheduler.cache
    assert host.holds(namespace, instruction), "the first instruction was not demoted"
    copies, totals, nbytes = [], [], 0
    for _ in range(args.promotions):
        sync()
        started = time.perf_counter()
        fetch = host.lookup(namespace, tuple(first), have=0)
        while not fetch.done():
            pass
        copied = time.perf_counter()
        result = engine.transfers.import_checkpoint(fetch.result(), verified=True)
        sync()
        ended = time.perf_counter()
        assert result.accepted and not result.deduplicated, result
        fetch.settle(True, result.num_bytes)
        nbytes = result.num_bytes
        copies.append(copied - started)
        totals.append(ended - started)
        bundle = cache.ledger.published_at(namespace, instruction)
        cache.ledger.evict_until(cache.ledger.budget_bytes)  # out of the device again
        assert cache.ledger.published_at(namespace, instruction) is None and bundle is not None
        while engine.has_unfinished_requests():  # demotes (held already: no copy), frees the worker's tensors
            engine.step()
    engine.shutdown()
    return {"tokens": args.instruction_tokens, "bytes": nbytes, "repeats": args.promotions,
            "promotion_ms_median": 1e3 * statistics.median(totals), "copy_ms_median": 1e3 * statistics.median(copies),
            "promotion_ms_min": 1e3 * min(totals)}


def save_result(out: Path, args: argparse.Namespace, model_dir: str, rows: list[dict], promotion: dict | None,
                partial: bool) -> Path:
    """Write the JSON (write_result): the configurations run so far and the promotion time (None
    until measured); partial until the run ends."""
    sizes = {name: getattr(args, name) for name in SIZES["acceptance"]}
    return write_result(out, "checkpoint_tiers", {
        "model_dir": model_dir, "device": args.device, "dtype": args.dtype, "sizes": sizes, "seed": args.seed,
        "parts": args.parts, "configurations": rows, "promotion": promotion, "partial": partial,
    }, machine_extra={"torch": torch.__version__,
                      "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the embedded model on the CPU, smaller sizes")
    parser.add_argument("--quick", action="store_true", help="a smoke run: the embedded model on the CPU, tiny "
                        "sizes, written under /tmp unless --out is given")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-dir", default=None, help="default: the 1.5B random model (cuda), the embedded one (--cpu)")
    for name, value in SIZES["acceptance"].items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {value}, "
                            f"{SIZES['cpu'][name]} with --cpu, {SIZES['quick'][name]} with --quick")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="which configurations, and whether the promotion time, to run (default all)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sizes_of = "quick" if args.quick else "cpu" if args.cpu else "acceptance"
    for name, value in SIZES[sizes_of].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.cpu or args.quick:
        args.device = "cpu"
    args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.out is not None:
        out = args.out
    elif args.quick:
        out = Path(tempfile.gettempdir()) / "checkpoint_tiers_quick.json"
    else:
        out = default_out("checkpoint_tiers_cpu" if args.cpu else "checkpoint_tiers")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None and args.device == "cpu":
            model_dir = str(DEFAULT_MODEL_DIR)
        elif model_dir is None:
            from bench_gpu import model_dir_of

            model_dir = str(model_dir_of(argparse.Namespace(quick=False), Path(tmp)))
        requests = workload(args, load_model_config(model_dir).vocab_size)
        rows, promotion = [], None
        chosen = [c for c, part in zip(CONFIGURATIONS, PARTS) if part in args.parts]
        for label, eviction, tiers in chosen:  # each saved as it ends: a run cut short keeps them
            rows.append(run_configuration(args, model_dir, label, eviction, tiers, requests))
            print(f"{label}: {rows[-1]['hits']}/{rows[-1]['follow_ups']} follow-ups restored, TTFT p50 "
                  f"{rows[-1]['ttft_p50_ms']:.1f} ms ({rows[-1]['seconds']:.0f} s)", flush=True)
            save_result(out, args, model_dir, rows, promotion, partial=True)
        if "promotion" in args.parts:
            promotion = promotion_time(args, model_dir, requests)

    print(markdown_table(
        ["configuration", "instruction hit rate", "TTFT p50 ms", "TTFT p95 ms", "promoted", "demoted",
         "device evictions", "wall s"],
        [[r["configuration"], f"{r['hits']}/{r['follow_ups']} = {r['hit_rate']:.1%}", f"{r['ttft_p50_ms']:.1f}",
          f"{r['ttft_p95_ms']:.1f}", str(r["promoted"]), str(r["demoted"]), str(r["evicted_from_device"]),
          f"{r['seconds']:.1f}"] for r in rows]))
    for row in rows:
        if "stored" in row:
            restore = row["store_restore_ms_median"]
            print(f"{row['configuration']}: host tier of {args.host_bundles} checkpoints; the stand-in store kept "
                  f"{row['stored']} ({row['stored_pickled_bytes'] / 2**20:.1f} MiB pickled) and served {row['fetched']} "
                  f"hits, lookup to import {'-' if restore is None else f'{restore:.1f}'} ms median")
    if promotion is not None:
        print(f"promotion of a {promotion['tokens']}-token checkpoint ({promotion['bytes'] / 2**20:.1f} MiB) from "
              f"the host tier: {promotion['promotion_ms_median']:.2f} ms median (copy {promotion['copy_ms_median']:.2f} "
              f"ms), min {promotion['promotion_ms_min']:.2f} ms over {promotion['repeats']}")
    path = save_result(out, args, model_dir, rows, promotion, partial=False)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
