"""Where the time to first token goes, on the engine alone (no Ray, no HTTP, no chat template).

    python benchmarks/ttft_anatomy.py --out $OUT          # on the H200 (1.5B random model)
    python benchmarks/ttft_anatomy.py --out /tmp/a --quick  # the same path on CPU, tiny model

One LLMEngine with all three checkpoint slots and bench_gpu.py's engine flags. Prompts are
random token ids (instructions of L tokens, then a user part of U tokens); each request asks for
two tokens and its TTFT is the time from add_request to the step() that returns its first token.

  shapes       cold prompts of T tokens, each T twice and T+1 after: does a new prompt length
               cost more than a repeated one (compilation, autotuning keyed on the length)?
  restores     per instruction length L, one cold request that captures the instruction
               checkpoint, then requests with new user parts of U tokens that restore it;
               per request its steps (wall time, which forward route served them)
  async        the same restores through AsyncLLMEngine (the in-process bench target's path)
  compiles     every Triton kernel variant built (its kernel's name), per burst step and per
               pass: a variant built mid-serving is a step of seconds
  profiles     cProfile of a cold prompt of a new length and of a repeated one (the host's top
               functions), and torch.profiler of one restore (top kernels and host ops)

Writes OUT/ttft_anatomy.json and OUT/ttft_anatomy.txt (the tables and profiles).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_gpu import model_dir_of  # noqa: E402

LOW_ID, HIGH_ID = 10, 2000  # token ids the tiny tokenizer knows


def engine_config(model_dir: Path, quick: bool):
    from engine.engine_config import EngineConfig

    mib = 1024 * 1024
    if quick:
        return EngineConfig(model_dir=str(model_dir), max_model_len=4096, max_num_seqs=8,
                            max_num_batched_tokens=512)
    return EngineConfig(model_dir=str(model_dir), device="cuda", dtype="bfloat16",
                        max_model_len=16384, max_num_seqs=64, max_num_batched_tokens=8192,
                        kv_cache_bytes=6144 * mib, state_cache_bytes=3072 * mib,
                        checkpoint_cache_bytes=8192 * mib)


def ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(LOW_ID, HIGH_ID) for _ in range(n))


def request(prompt: tuple[int, ...], boundary: int | None, salt: str | None = None):
    from engine.interfaces.generation_request import GenerationRequest
    from engine.interfaces.sampling_params import SamplingParams

    return GenerationRequest(uuid.uuid4().hex, prompt, SamplingParams(max_tokens=2, temperature=0.0,
                                                                      ignore_eos=True),
                             instruction_boundary=boundary, cache_salt=salt)


def route_counts(engine) -> dict[str, int]:
    worker = engine.executor
    return {"prefill_graph": getattr(worker.prefill_graphs, "replays", 0) if worker.prefill_graphs else 0,
            "decode_graph": getattr(worker.decode_graphs, "replays", 0) if worker.decode_graphs else 0}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def ttft(engine, req) -> dict:
    """Run `req` to its end; its TTFT and the steps up to its first token."""
    sync(engine.config.device)
    before = route_counts(engine)
    start = time.perf_counter()
    engine.add_request(req)
    steps, first = [], None
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - t0
        trace = engine.last_step
        chunks = [len(c.token_ids) for c in trace.scheduler_output.chunks] if trace else []
        if first is None:
            steps.append({"wall_ms": round(wall * 1e3, 3), "chunks": chunks,
                          "restores": len(trace.scheduler_output.restores) if trace else 0})
        for out in outputs:
            if first is None and out.new_token_ids:
                first = time.perf_counter() - start
    after = route_counts(engine)
    return {"ttft_ms": round(first * 1e3, 3), "steps": steps,
            "routes": {k: after[k] - before[k] for k in after}}


def shapes_pass(engine, rng, quick: bool) -> list[dict]:
    lengths = [300, 301, 700] if quick else [1000, 2000, 4000]
    rows = []
    for base in lengths:
        for t in (base, base, base + 1, base + 1, base + 37):
            r = ttft(engine, request(ids(rng, t), None, salt=uuid.uuid4().hex))
            rows.append({"tokens": t, "ttft_ms": r["ttft_ms"], "steps": len(r["steps"]),
                         "routes": r["routes"]})
    return rows


def restores_pass(engine, rng, quick: bool) -> list[dict]:
    lengths = [200, 1000] if quick else [500, 2000, 8000]
    users = [50, 120, 250, 400, 500, 64, 128, 256] if not quick else [20, 40, 64]
    rows = []
    for length in lengths:
        instructions = ids(rng, length)
        salt = uuid.uuid4().hex
        cold = ttft(engine, request(instructions + ids(rng, 200), length, salt))
        rows.append({"instruction_tokens": length, "user_tokens": 200, "kind": "cold", **cold})
        for u in users:
            warm = ttft(engine, request(instructions + ids(rng, u), length, salt))
            rows.append({"instruction_tokens": length, "user_tokens": u, "kind": "restore", **warm})
    return rows


class HandOffClock:
    """Timestamps on an AsyncLLMEngine's step thread: when each request's add_request ran
    (`added`) and when its first token was handed to the event loop (`delivered`), by wrapping
    the engine's add_request and the async engine's _deliver; `stop()` unwraps them and stops
    the step thread, keeping the engine (AsyncLLMEngine.shutdown would close it)."""

    def __init__(self, engine, aengine) -> None:
        self.engine, self.aengine = engine, aengine
        self.added: dict[str, float] = {}
        self.delivered: dict[str, float] = {}
        self._add_request, self._deliver = engine.add_request, aengine._deliver
        engine.add_request, aengine._deliver = self._timed_add, self._timed_deliver

    def _timed_add(self, req) -> None:
        self.added[req.request_id] = time.perf_counter()
        self._add_request(req)

    def _timed_deliver(self, outputs) -> None:
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                self.delivered.setdefault(out.request_id, now)
        self._deliver(outputs)

    def stop(self) -> None:
        self.engine.add_request = self._add_request
        self.aengine._stopped = True
        self.aengine._wakeup.set()
        self.aengine._thread.join(timeout=10)


def async_pass(engine, rng, quick: bool, switch_interval_s: float | None = None) -> list[dict]:
    """Restores through AsyncLLMEngine; each request's TTFT split into: the hand-off in (until
    the step thread ran add_request), the engine (until the step thread handed the first token
    to the event loop) and the hand-off out (until the caller saw it). switch_interval_s: the
    interpreter's thread switch interval during the pass (sys.setswitchinterval; None: as is)."""
    from engine.core.async_engine import AsyncLLMEngine

    aengine = AsyncLLMEngine(engine)
    clock = HandOffClock(engine, aengine)
    added, delivered = clock.added, clock.delivered
    lengths = [200, 1000] if quick else [500, 8000]
    rows = []

    async def one(req) -> dict:
        start = time.perf_counter()
        async for out in aengine.generate(req):
            if out.new_token_ids:
                seen = time.perf_counter()
                break
        rid = req.request_id
        return {"ttft_ms": round((seen - start) * 1e3, 3), "in_ms": round((added[rid] - start) * 1e3, 3),
                "engine_ms": round((delivered[rid] - added[rid]) * 1e3, 3),
                "out_ms": round((seen - delivered[rid]) * 1e3, 3)}

    async def main() -> None:
        for length in lengths:
            instructions, salt = ids(rng, length), uuid.uuid4().hex
            await one(request(instructions + ids(rng, 200), length, salt))
            for u in (50, 250, 500, 50, 250, 500):
                row = await one(request(instructions + ids(rng, u), length, salt))
                rows.append({"instruction_tokens": length, "user_tokens": u, **row})
                await asyncio.sleep(0.01)

    previous = sys.getswitchinterval()
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)
    try:
        asyncio.run(main())
    finally:
        sys.setswitchinterval(previous)
        clock.stop()
    return rows


def bench_path_pass(engine, quick: bool) -> list[dict]:
    """The in-process bench target's own path (hybrid_serve_bench.engine_target.EngineChat over
    AsyncLLMEngine), with the bench's shared-instructions requests at 8,000 instruction tokens
    (quick: 300), back to back (the next request the moment the last one ends, as the bench's
    closed loop at concurrency 1), 16 tokens each: per request TTFT as the bench takes it, its
    split as async_pass splits it, and every step() between its add_request and the delivery of
    its first token (wall ms, tokens per chunk, restores, captures, start relative to the add).
    Then the same prompts again, in the same order, in a namespace of their own (so each
    system's first request captures and the others restore, as in the pass), on the engine
    alone (ttft(): no AsyncLLMEngine, no event loop): sync_ttft_ms, the same request's TTFT
    without the async face, from the same run."""
    from engine.core.async_engine import AsyncLLMEngine
    from hybrid_serve_bench.client import ChatRequest
    from hybrid_serve_bench.engine_target import EngineChat
    from hybrid_serve_bench.tokens import TokenizerCounter
    from hybrid_serve_bench.workloads import Sizes, shared_instructions

    aengine = AsyncLLMEngine(engine)
    chat = EngineChat(aengine, ttft_at_first_token=True)
    clock = HandOffClock(engine, aengine)
    added, delivered = clock.added, clock.delivered
    steps: list[dict] = []
    step = engine.step

    def timed_step():
        t0 = time.perf_counter()
        outputs = step()
        trace = engine.last_step
        steps.append({"t0": t0, "wall_ms": round((time.perf_counter() - t0) * 1e3, 3),
                      "collected_chunks": [len(c.token_ids) for c in trace.scheduler_output.chunks] if trace else [],
                      "restores": len(trace.scheduler_output.restores) if trace else 0,
                      "captures": len(trace.scheduler_output.captures) if trace else 0})
        return outputs

    engine.step = timed_step
    counter = TokenizerCounter(engine.config.model_dir)
    workload = shared_instructions(Sizes(instruction_tokens=300 if quick else 8000, requests=8 if quick else 24,
                                         systems=2), counter)
    rows, salt = [], uuid.uuid4().hex  # nothing an earlier pass left is restored
    rendered = [chat.renderer.render_chat(list(c.turns[0].new_messages)) for c in workload.conversations]

    async def main() -> None:
        for conversation in workload.conversations:
            messages = list(conversation.turns[0].new_messages)
            result = await chat(ChatRequest("m", messages, 16, extra_body={"ignore_eos": True, "cache_salt": salt}))
            rid = next(reversed(added))
            t_add, t_out = added[rid], delivered[rid]
            rows.append({"ttft_ms": round(result.ttft_s * 1e3, 3), "cached": result.cached_tokens,
                         "prompt": result.prompt_tokens,
                         "engine_ms": round((t_out - t_add) * 1e3, 3),
                         "steps": [{**{k: v for k, v in st.items() if k != "t0"},
                                    "at_ms": round((st["t0"] - t_add) * 1e3, 3)}
                                   for st in steps if t_add - 0.05 <= st["t0"] <= t_out]})

    try:
        asyncio.run(main())
    finally:
        engine.step = step
        clock.stop()
    replay_salt = uuid.uuid4().hex  # as the pass did: each system's first request captures, the others restore
    for row, prompt in zip(rows, rendered):
        row["sync_ttft_ms"] = ttft(engine, request(prompt.token_ids, prompt.instruction_boundary,
                                                   replay_salt))["ttft_ms"]
    return rows


class CompileLog:
    """The names of the Triton kernels built since the last `take()` (Triton's
    jit_post_compile_hook, called once per new variant; absent on CPU or an older Triton)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.active = False
        try:
            from triton import knobs

            knobs.runtime.jit_post_compile_hook = self._hook
            self.active = True
        except (ImportError, AttributeError):
            pass

    def _hook(self, *args, **kwargs) -> bool:
        fn = kwargs.get("fn")
        self.names.append(getattr(fn, "name", None) or repr(fn))
        return False

    def take(self) -> list[str]:
        names, self.names = self.names, []
        return names


def burst_pass(engine, rng, quick: bool, restore: bool, num: int, compiles: CompileLog) -> dict:
    """`num` requests added at once, each 16 tokens: 2,000-token instructions (their checkpoint
    captured first when `restore`, else a fresh namespace each) and 50-500 user tokens. Every
    step until the last first token: wall time, chunks, tokens, restores, captures, Triton
    kernels built; the TTFTs."""
    length = 300 if quick else 2000
    instructions, salt = ids(rng, length), uuid.uuid4().hex
    if restore:
        ttft(engine, request(instructions + ids(rng, 100), length, salt))
    from engine.interfaces.generation_request import GenerationRequest
    from engine.interfaces.sampling_params import SamplingParams

    reqs = [GenerationRequest(uuid.uuid4().hex, instructions + ids(rng, rng.randint(50, 500)),
                              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                              instruction_boundary=length, cache_salt=salt if restore else uuid.uuid4().hex)
            for _ in range(num)]
    sync(engine.config.device)
    compiles.take()
    start = time.perf_counter()
    for req in reqs:
        engine.add_request(req)
    first: dict[str, float] = {}
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - t0
        trace = engine.last_step
        for out in outputs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
        if len(first) < num and trace is not None:
            so = trace.scheduler_output
            steps.append({"wall_ms": round(wall * 1e3, 2), "chunks": len(so.chunks),
                          "tokens": sum(len(c.token_ids) for c in so.chunks),
                          "restores": len(so.restores), "captures": len(so.captures),
                          "compiled": compiles.take()})
    ttfts = sorted(first.values())
    return {"restore": restore, "requests": num, "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1),
            "ttft_max_ms": round(ttfts[-1] * 1e3, 1), "steps": steps}


def host_profile(engine, req) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    ttft(engine, req)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def device_profile(engine, req) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        ttft(engine, req)
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    return (prof.key_averages().table(sort_by=sort, row_limit=25) + "\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only-bench-path", action="store_true",
                        help="run only the bench-path pass (after the warm-up)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from engine.core.llm_engine import LLMEngine

    t0 = time.perf_counter()
    result: dict = {"command": " ".join(sys.argv)}
    text: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        engine = LLMEngine(engine_config(model_dir_of(args, Path(tmp)), args.quick))
        compiles = CompileLog()
        print(f"engine started ({time.perf_counter() - t0:.0f}s)", flush=True)
        rng = random.Random(0)
        for i in range(3):  # first compiles, autotunes
            ttft(engine, request(ids(rng, 600 + i), None, salt=uuid.uuid4().hex))
        result["compiled_at_start"] = len(compiles.take())
        if args.only_bench_path:
            run_bench_path(engine, args, result, text)
            engine.shutdown()
            return
        result["shapes"] = shapes_pass(engine, rng, args.quick)
        result["compiled_in_shapes"] = compiles.take()
        text.append("shapes: tokens ttft_ms steps routes")
        text += [f"  {r['tokens']:6d} {r['ttft_ms']:9.2f} {r['steps']} {r['routes']}" for r in result["shapes"]]
        print("\n".join(text), flush=True)
        result["restores"] = restores_pass(engine, rng, args.quick)
        text.append("restores: L U kind ttft_ms routes steps")
        for r in result["restores"]:
            text.append(f"  {r['instruction_tokens']:6d} {r['user_tokens']:4d} {r['kind']:8s} "
                        f"{r['ttft_ms']:9.2f} {r['routes']} {r['steps']}")
        by_length: dict[int, list[float]] = {}
        for r in result["restores"]:
            if r["kind"] == "restore":
                by_length.setdefault(r["instruction_tokens"], []).append(r["ttft_ms"])
        result["restore_p50_ms"] = {k: statistics.median(v) for k, v in by_length.items()}
        result["compiled_in_restores"] = compiles.take()
        text.append(f"restore TTFT p50 by L: {result['restore_p50_ms']}")
        print("\n".join(text[-len(result['restores']) - 2:]), flush=True)
        for restore in (False, True):
            burst = burst_pass(engine, rng, args.quick, restore, 8 if args.quick else 64, compiles)
            result[f"burst_restore_{restore}"] = burst
            built = sum(len(st["compiled"]) for st in burst["steps"])
            text.append(f"burst, restore={restore}: TTFT p50 {burst['ttft_p50_ms']} ms, max {burst['ttft_max_ms']} ms, "
                        f"{built} kernel variants built")
            text += [f"  {st}" for st in burst["steps"]]
            print("\n".join(text[-len(burst['steps']) - 1:]), flush=True)
        new_length = 3001 if not args.quick else 333
        text.append(f"cProfile, cold prompt of a new length ({new_length}):")
        text.append(host_profile(engine, request(ids(rng, new_length), None, uuid.uuid4().hex)))
        text.append(f"cProfile, cold prompt of the same length again ({new_length}):")
        text.append(host_profile(engine, request(ids(rng, new_length), None, uuid.uuid4().hex)))
        length = 8000 if not args.quick else 1000
        instructions, salt = ids(rng, length), uuid.uuid4().hex
        ttft(engine, request(instructions + ids(rng, 100), length, salt))
        text.append(f"cProfile, restore of {length} + 300 user tokens:")
        text.append(host_profile(engine, request(instructions + ids(rng, 300), length, salt)))
        text.append(f"torch.profiler, restore of {length} + 300 user tokens:")
        text.append(device_profile(engine, request(instructions + ids(rng, 300), length, salt)))
        text.append(f"torch.profiler, cold prompt of a new length ({new_length + 2}):")
        text.append(device_profile(engine, request(ids(rng, new_length + 2), None, uuid.uuid4().hex)))
        (args.out / "ttft_anatomy.txt").write_text("\n".join(text))
        for name, interval in (("async", None), ("async_switch_200us", 0.0002)):
            result[name] = async_pass(engine, rng, args.quick, interval)
            text.append(f"{name}: L U ttft_ms in_ms engine_ms out_ms")
            text += [f"  {r['instruction_tokens']:6d} {r['user_tokens']:4d} {r['ttft_ms']:8.3f} {r['in_ms']:7.3f} "
                     f"{r['engine_ms']:8.3f} {r['out_ms']:7.3f}" for r in result[name]]
            print("\n".join(text[-len(result[name]) - 1:]), flush=True)
        run_bench_path(engine, args, result, text)
        result["wall_seconds"] = round(time.perf_counter() - t0, 1)
        (args.out / "ttft_anatomy.json").write_text(json.dumps(result, indent=1))
        engine.shutdown()
    print(f"done ({time.perf_counter() - t0:.0f}s)", flush=True)


def run_bench_path(engine, args, result: dict, text: list[str]) -> None:
    """bench_path_pass twice (the first warms its shapes), its table in text; writes both files."""
    for name in ("bench_path_warm_up", "bench_path"):
        result[name] = bench_path_pass(engine, args.quick)
    text.append("bench_path: ttft_ms engine_ms sync_ttft_ms cached/prompt steps (at_ms wall_ms collected_chunks "
                "restores captures)")
    for r in result["bench_path"]:
        text.append(f"  {r['ttft_ms']:8.3f} {r['engine_ms']:8.3f} {r['sync_ttft_ms']:8.3f} {r['cached']}/{r['prompt']} "
                    + " ".join(f"[{s['at_ms']} {s['wall_ms']} {s['collected_chunks']} {s['restores']} {s['captures']}]"
                               for s in r["steps"]))
    print("\n".join(text[-len(result['bench_path']) - 1:]), flush=True)
    (args.out / "ttft_anatomy.txt").write_text("\n".join(text))
    (args.out / "ttft_anatomy.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
