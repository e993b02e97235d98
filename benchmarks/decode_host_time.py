"""Where the host's time goes in a decode step: a batch-1 step replayed from a CUDA graph
(--device cuda, the default), or the in-process engine's CPU step at concurrency 16 on the
embedded tiny model (--device cpu, below).

On the ~1.5B config of benchmarks/roofline/model.py (random bf16 weights), one worker with
decode graphs for batch 1, request 0 decoding on from position 0. Rows (medians over STEPS):

  * step: Worker.execute, synchronised before and after (gpu_roofline's sync_seconds),
    and its parts on the host, from wrappers around the runner's forward and the sampler:
    before the forward, the forward, between it and sampling, sampling (which waits for the
    GPU: argmax and the read-back), after sampling;
  * runner: staging, the staged inputs' host-to-device copy, graph.replay() and a
    synchronisation, and the host time of the first three;
  * GPU alone: the runner's forward queued behind a GPU sleep, timed by events around it;
  * GPU from idle: the same events without the sleep: the GPU's view of a step that starts
    when the host does.

Each step is collected before the next is staged (no async scheduling), so the host's work
shows in the step's wall time; gpu_roofline.py's decode rows time the async step, which hides
it behind the GPU.

    python benchmarks/decode_host_time.py --out benchmarks/results/decode_host_time.json

--device cpu: the in-process path of benchmarks/serve_latency.py (AsyncLLMEngine on this event
loop, torch on --threads threads), --concurrency streams of --max-tokens greedy tokens
(ignore_eos) from serve_latency's prompt, every stream started at once; waves of that workload,
timed by wall clock: output tok/s (all tokens of a wave / its wall time) and ms per engine step.
Each engine step is also timed on the step thread (thread CPU time, which a busy shared machine
inflates less than wall time), split into the forward route (EagerPass.run: batch building and
the model), the LM head and sampling, the rest of Worker.submit/collect, and the engine's host
work around the worker (scheduler, output processor). --baseline DIR runs the same workload on
another checkout (its engine/ on PYTHONPATH, say `git archive <commit> | tar -x -C DIR`) in the
same invocation, and --compile this tree with EngineConfig.cpu_compile_decode as well
(engine/routes/cpu_decode.py; its compile at start is not in the timed waves); rounds alternate
between them, and every one must produce the same greedy tokens. Each (tree, round) is a fresh
process.

    python benchmarks/decode_host_time.py --device cpu --baseline /tmp/base \
        --out benchmarks/results/decode_host_time_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from harness import default_out, middle, write_result

STEPS = 40
BLOCKS_PER_SEQ = 1024  # max_model_len 16,384 / 16: the worker refuses a smaller KV budget


class _Steps:
    """Request 0's decode steps, one position further each call."""

    def __init__(self) -> None:
        self.position = 0

    def next(self) -> list:
        from roofline.model import chunk

        step = [chunk(0, (5,), self.position, BLOCKS_PER_SEQ, reset=self.position == 0)]
        self.position += 1
        return step


def _execute_parts(worker, steps: _Steps) -> dict[str, float]:
    """Medians of the host intervals inside Worker.execute, timed by wrappers around the decode
    runner's forward and the sampler's sample (instance attributes, removed afterwards)."""
    import torch

    from engine.interfaces.step_io import SchedulerOutput

    marks: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            marks[name + " in"] = time.perf_counter()
            result = fn(*args, **kwargs)
            marks[name + " out"] = time.perf_counter()
            return result
        return wrapper

    worker.decode_graphs.forward = timed("forward", worker.decode_graphs.forward)
    worker.sampler.sample = timed("sample", worker.sampler.sample)
    parts: dict[str, list[float]] = {
        "execute: before the forward": [], "execute: runner forward (host)": [],
        "execute: forward to sampling": [], "execute: sampling (waits for the GPU)": [],
        "execute: after sampling": [],
    }
    try:
        for _ in range(STEPS):
            out = SchedulerOutput(tuple(steps.next()))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            worker.execute(out)
            t1 = time.perf_counter()
            bounds = (t0, marks["forward in"], marks["forward out"], marks["sample in"], marks["sample out"], t1)
            for values, start, end in zip(parts.values(), bounds, bounds[1:]):
                values.append(end - start)
    finally:
        del worker.decode_graphs.forward, worker.sampler.sample
    return {name: middle(values) for name, values in parts.items()}


def gpu_main(args: argparse.Namespace) -> None:
    """The CUDA graph rows of the module doc."""
    import torch

    from engine.engine_config import EngineConfig
    from engine.execution.worker import Worker
    from engine.interfaces.step_io import SchedulerOutput
    from gpu_timing import keep_gpu_busy
    from roofline.model import sized_config, write_random_checkpoint

    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "granite-hybrid-1p5b-random"
        write_random_checkpoint(model_dir)
        probe = EngineConfig(model_dir=str(model_dir), dtype="bfloat16", device="cuda")
        config = sized_config(probe, 2, BLOCKS_PER_SEQ)
        worker = Worker(replace(config, max_num_batched_tokens=32))  # no prefill graphs
        runner = worker.decode_graphs
        steps = _Steps()
        rows: dict[str, float] = {}

        wall = []
        for _ in range(STEPS):
            out = SchedulerOutput(tuple(steps.next()))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            worker.execute(out)
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - t0)
        rows["step: Worker.execute"] = middle(wall)
        rows.update(_execute_parts(worker, steps))

        graph = runner._graphs[1]
        parts = {"runner: staging + copy + replay + sync": [], "host: staging": [],
                 "host: input copy enqueued": [], "host: graph.replay()": []}
        staging, host = runner._stagings[0], runner._hosts[0]
        used = staging.used_length(1)
        for _ in range(STEPS):
            step = steps.next()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            staging.stage(step, 1)
            t1 = time.perf_counter()
            runner._inputs[:used].copy_(host[:used], non_blocking=True)
            t2 = time.perf_counter()
            graph.replay()
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            for name, value in zip(parts, (t4 - t0, t1 - t0, t2 - t1, t3 - t2)):
                parts[name].append(value)
        rows.update({name: middle(values) for name, values in parts.items()})

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for name, busy in (("GPU alone (behind a sleep)", True), ("GPU from idle", False)):
            times = []
            for _ in range(STEPS):
                step = steps.next()
                torch.cuda.synchronize()
                if busy:
                    keep_gpu_busy()
                start.record()
                runner.forward(step)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            rows[name] = middle(times)

    report["rows_s"] = rows
    width = max(len(n) for n in rows)
    for name, seconds in rows.items():
        print(f"{name:<{width}}  {seconds * 1e3:8.3f} ms")
    out = write_result(args.out or default_out("decode_host_time"), "decode_host_time", report)
    print(f"wrote {out}")


# ----- --device cpu: the in-process engine's CPU step

# The step's parts timed on the step thread (thread CPU seconds), by the methods wrapped: each
# part is the time inside that method; "engine host" is the step less Worker.submit/collect.
# The compiled decode pass computes the LM head inside its route ("forward route"); the eager
# pass's LM head runs in Worker.submit ("LM head + sampling").
CPU_PARTS = ("forward route", "LM head + sampling", "worker other", "engine host")


def cpu_worker(args: argparse.Namespace) -> dict:
    """One process of the CPU benchmark: the engine from whatever `engine` package is on
    sys.path, args.waves waves after a warm-up; returns the waves' figures and the greedy
    tokens of the first stream."""
    import asyncio
    import uuid

    import torch
    from transformers import AutoTokenizer

    from engine.core.async_engine import AsyncLLMEngine
    from engine.core.llm_engine import LLMEngine
    from engine.engine_config import EngineConfig
    from engine.interfaces.generation_request import GenerationRequest
    from engine.interfaces.sampling_params import SamplingParams
    from serve_latency import PROMPT

    torch.set_num_threads(args.threads)
    config = EngineConfig(max_model_len=1024, max_num_seqs=max(16, args.concurrency),
                          max_num_batched_tokens=512, checkpoint_slots=())  # serve_latency's
    if args.model_dir:
        config = replace(config, model_dir=args.model_dir)
    if args.compile:  # a checkout without the field never gets here (cpu_main)
        config = replace(config, cpu_compile_decode=True)
    prompt_ids = AutoTokenizer.from_pretrained(config.model_dir).encode(PROMPT * 2, add_special_tokens=False)
    llm = LLMEngine(config)
    while getattr(llm, "warming_up", lambda: False)():  # the compile runs on a thread of its own:
        time.sleep(0.1)                                  # time the compiled steps, not the eager ones
    steps = _StepClock(llm)
    engine = AsyncLLMEngine(llm)

    async def stream(max_tokens: int, logits: list | None = None) -> list[int]:
        """One stream's greedy tokens; `logits` (a list) collects each token's logits row."""
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                  return_logits=logits is not None)
        tokens: list[int] = []
        async for out in engine.generate(GenerationRequest(uuid.uuid4().hex, prompt_ids, sampling)):
            tokens += out.new_token_ids
            if logits is not None:
                logits.append(out.logits)
        return tokens

    async def waves() -> tuple[list[dict], list[int]]:
        await asyncio.gather(*(stream(4) for _ in range(args.concurrency)))  # warm-up
        results, first = [], []
        for _ in range(args.waves):
            steps.reset()
            start = time.perf_counter()
            logits.clear()  # the last wave's first stream: compared across trees
            outputs = await asyncio.gather(stream(args.max_tokens, logits),
                                           *(stream(args.max_tokens) for _ in range(args.concurrency - 1)))
            wall = time.perf_counter() - start
            if any(out != outputs[0] for out in outputs):
                raise AssertionError("streams of the same prompt decoded different greedy tokens")
            first = outputs[0]
            results.append({"output_tok_s": sum(map(len, outputs)) / wall, "num_steps": len(steps.wall),
                            "step_ms": 1e3 * wall / len(steps.wall), **steps.medians_ms()})
        return results, first

    logits: list = []
    try:
        results, tokens = asyncio.run(waves())
    finally:
        engine.shutdown()
    torch.save(torch.stack(logits), args.logits_out)
    return {"waves": results, "tokens": tokens, "prompt_tokens": len(prompt_ids)}


class _StepClock:
    """Wraps LLMEngine.step and the worker's forward routes, LM head and sampler (instance
    attributes) to time each step's parts on the step thread (time.thread_time). The model's
    LM head is wrapped only without the compiled decode pass, whose graphs would see the
    wrapper (an instance attribute of the model they read) and never run."""

    def __init__(self, llm) -> None:
        worker = llm.executor
        self.wall: list[float] = []
        self.parts: dict[str, list[float]] = {name: [] for name in ("step", *CPU_PARTS)}
        self._inside = dict.fromkeys(("forward", "head", "worker"), 0.0)
        llm.step = self._timed(llm.step, None)
        worker.submit = self._timed(worker.submit, "worker")
        worker.collect = self._timed(worker.collect, "worker")
        worker.eager_pass.run = self._timed(worker.eager_pass.run, "forward")
        compiled = getattr(worker, "compiled_decode", None)
        if compiled is not None:
            compiled.run = self._timed(compiled.run, "forward")
        else:
            worker.model.compute_logits = self._timed(worker.model.compute_logits, "head")
        worker.sampler.sample = self._timed(worker.sampler.sample, "head")

    def reset(self) -> None:
        self.wall.clear()
        for values in self.parts.values():
            values.clear()

    def _timed(self, fn, part: str | None):
        def wrapper(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - cpu
                if part is not None:
                    self._inside[part] += spent
                else:  # a whole step: file its parts
                    self.wall.append(time.perf_counter() - start)
                    inside = self._inside
                    self.parts["step"].append(spent)
                    self.parts["forward route"].append(inside["forward"])
                    self.parts["LM head + sampling"].append(inside["head"])
                    self.parts["worker other"].append(inside["worker"] - inside["forward"] - inside["head"])
                    self.parts["engine host"].append(spent - inside["worker"])
                    self._inside = dict.fromkeys(inside, 0.0)
        return wrapper

    def medians_ms(self) -> dict[str, float]:
        return {f"cpu_ms {name}": 1e3 * middle(values) for name, values in self.parts.items()}


def cpu_main(args: argparse.Namespace) -> None:
    """Rounds of one fresh process per tree (this checkout, then --compile's and --baseline's),
    each running args.waves waves; prints a table, checks the trees' greedy tokens agree and
    compares their last wave's first stream's logits, writes JSON."""
    import torch

    here = Path(__file__).resolve().parent.parent
    trees = {"this tree": (here, False)}
    if args.compile:
        trees["compiled"] = (here, True)
    if args.baseline:
        trees["baseline"] = (Path(args.baseline).resolve(), False)
    model_dir = args.model_dir or str(here / "models" / "tiny-granite-hybrid")
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    tokens: dict[str, list[int]] = {}
    logits: dict[str, object] = {}
    scratch = Path(tempfile.mkdtemp(prefix="decode_host_time_"))
    for _ in range(args.rounds):
        for name, (tree, compiled) in trees.items():
            command = [sys.executable, __file__, "--device", "cpu", "--cpu-worker", "--model-dir", model_dir,
                       *(f"--{key}={getattr(args, key.replace('-', '_'))}" for key in
                         ("concurrency", "max-tokens", "waves", "threads")), *(["--compile"] if compiled else []),
                       f"--logits-out={scratch / 'logits.pt'}"]
            env = {**os.environ, "PYTHONPATH": str(tree)}
            done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name] += result["waves"]
            if tokens.setdefault(name, result["tokens"]) != result["tokens"]:
                raise AssertionError(f"{name}: greedy tokens differ between rounds")
            logits.setdefault(name, torch.load(scratch / "logits.pt"))
    summary = {name: {key: middle([wave[key] for wave in waves]) for key in waves[0]}
               for name, waves in runs.items()}
    same_tokens = len({tuple(t) for t in tokens.values()}) == 1
    first = next(iter(logits.values()))  # this tree's
    logits_rel = {name: float((other - first).abs().max() / first.abs().max()) for name, other in logits.items()}
    lines = [f"{args.concurrency} streams x {args.max_tokens} tokens, {args.threads} torch thread(s), "
             f"{args.rounds} rounds x {args.waves} waves per tree (medians over waves)", ""]
    keys = ["output_tok_s", "step_ms", *(f"cpu_ms {p}" for p in ("step", *CPU_PARTS))]
    lines.append(f"{'':<28}" + "".join(f"{name:>14}" for name in trees))
    for key in keys:
        lines.append(f"{key:<28}" + "".join(f"{summary[name][key]:>14.2f}" for name in trees))
    lines.append("")
    if args.baseline:
        for name in (n for n in trees if n != "baseline"):
            ratio = summary[name]["output_tok_s"] / summary["baseline"]["output_tok_s"]
            lines.append(f"output tok/s, {name} / baseline: {ratio:.2f}x")
    lines.append(f"greedy tokens identical across {', '.join(trees)}: {same_tokens}")
    lines.append("first stream's logits, max|x - this tree| / max|this tree|: "
                 + ", ".join(f"{name} {error:.1e}" for name, error in logits_rel.items() if name != "this tree"))
    print("\n".join(lines))
    out = write_result(args.out or default_out("decode_host_time_cpu"), "decode_host_time_cpu", {
        "args": {key: value for key, value in vars(args).items() if key != "out"},
        "trees": {name: {"path": str(tree), "cpu_compile_decode": compiled} for name, (tree, compiled) in trees.items()},
        "summary": summary, "waves": runs, "greedy_tokens_identical": same_tokens,
        "logits_max_rel_diff_to_this_tree": logits_rel,
        "table": "\n".join(lines),
    })
    print(f"wrote {out}")
    if not same_tokens:
        raise SystemExit("the trees decoded different greedy tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: results/decode_host_time.json, or "
                             "results/decode_host_time_cpu.json with --device cpu)")
    parser.add_argument("--baseline", default=None, help="cpu: another checkout to run the same workload on")
    parser.add_argument("--model-dir", default=None, help="cpu: default the embedded tiny model of this tree")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="cpu: fresh processes per tree")
    parser.add_argument("--waves", type=int, default=3, help="cpu: timed waves per process")
    parser.add_argument("--threads", type=int, default=1, help="cpu: torch threads (serve_latency's worker_num_cpus)")
    parser.add_argument("--compile", action="store_true",
                        help="cpu: also run this tree with EngineConfig.cpu_compile_decode (compiles at each start)")
    parser.add_argument("--cpu-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--logits-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu_worker:
        print(json.dumps(cpu_worker(args)))
    elif args.device == "cpu":
        cpu_main(args)
    else:
        gpu_main(args)


if __name__ == "__main__":
    main()
