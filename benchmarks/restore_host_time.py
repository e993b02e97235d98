"""Host time of a request that restores a long instruction checkpoint, before its first kernel.

    .venv/bin/python benchmarks/restore_host_time.py                   # CPU only, about a minute
    .venv/bin/python benchmarks/restore_host_time.py --out /tmp/r.json

On the GPU every microsecond the step thread spends between a request's arrival and its first
launch is time to first token: the device is idle. The parts that grow with the prompt are
what this measures, on the CPU with the embedded model (its positions raised to fit the
longest prompt, in a temporary copy; the model's compute is not timed):

  add        LLMEngine.add_request (validation, the request's bookkeeping)
  schedule   Scheduler.schedule of the step that admits it: the checkpoint lookup, the
             restore, the chunk, the prompt checkpoint's reservation over all its blocks
  collect    Scheduler.update_from_output + OutputProcessor.process of that step (its first
             token's way out)

per instruction length L (each request: the L instruction tokens, whose checkpoint the first
request captured, then --user-tokens new ones), the median over --requests requests. The
ratio column is each length's add + schedule over the shortest length's, from the same run.
Prints a table and writes JSON (--out, default benchmarks/results/restore_host_time.json).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig  # noqa: E402
from engine.interfaces.generation_request import GenerationRequest  # noqa: E402
from engine.interfaces.sampling_params import SamplingParams  # noqa: E402
from harness import add_out_argument, markdown_table, write_result  # noqa: E402

LENGTHS = (500, 2000, 8000, 16000)


def long_context_model(tmp: Path, positions: int) -> Path:
    """A copy of the embedded model whose config allows `positions` positions (it has no RoPE:
    nothing else changes)."""
    model_dir = tmp / "long-tiny"
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


class PhaseClock:
    """Wraps the engine's scheduler.schedule, scheduler.update_from_output and
    output_processor.process: the wall time of each call, by phase, since the last take()."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds: dict[str, list[float]] = {"schedule": [], "update": [], "process": []}
        for owner, name, phase in ((engine.scheduler, "schedule", "schedule"),
                                   (engine.scheduler, "update_from_output", "update"),
                                   (engine.output_processor, "process", "process")):
            setattr(owner, name, self._timed(getattr(owner, name), phase))

    def _timed(self, function, phase: str):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[phase].append(time.perf_counter() - started)
        return timed

    def take(self) -> dict[str, list[float]]:
        taken = {phase: list(times) for phase, times in self.seconds.items()}
        for times in self.seconds.values():
            times.clear()
        return taken


def measure(engine: LLMEngine, length: int, user_tokens: int, requests: int, rng: random.Random) -> dict:
    """Median host milliseconds of each phase over `requests` restores of an L-token checkpoint."""
    clock = PhaseClock(engine)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    instructions = tuple(rng.randrange(10, 2000) for _ in range(length))
    salt = uuid.uuid4().hex

    def run(prompt) -> float:
        """add_request's seconds; then the request to its end."""
        request = GenerationRequest(uuid.uuid4().hex, prompt, params, instruction_boundary=length, cache_salt=salt)
        started = time.perf_counter()
        engine.add_request(request)
        add = time.perf_counter() - started
        while engine.has_unfinished_requests():
            engine.step()
        return add

    run(instructions + tuple(rng.randrange(10, 2000) for _ in range(user_tokens)))  # captures it
    hits_before = engine.stats().checkpoints["instruction"].hit
    rows = []
    for _ in range(requests):
        clock.take()
        add = run(instructions + tuple(rng.randrange(10, 2000) for _ in range(user_tokens)))
        phases = clock.take()
        # the admitting step's schedule, and the collect of its first token (the next step's)
        rows.append({"add": add, "schedule": phases["schedule"][0],
                     "collect": phases["update"][0] + phases["process"][0]})
    assert engine.stats().checkpoints["instruction"].hit - hits_before == requests, "a request did not restore"
    return {phase: 1e3 * statistics.median(r[phase] for r in rows) for phase in ("add", "schedule", "collect")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=15)
    parser.add_argument("--user-tokens", type=int, default=250)
    add_out_argument(parser, "restore_host_time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    longest = max(LENGTHS) + args.user_tokens + 8
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = long_context_model(Path(tmp), longest)
        engine = LLMEngine(EngineConfig(model_dir=str(model_dir), max_model_len=longest, max_num_seqs=4,
                                        max_num_batched_tokens=longest))
        rng = random.Random(0)
        for length in LENGTHS:
            rows.append({"instruction_tokens": length, **measure(engine, length, args.user_tokens, args.requests, rng)})
        engine.shutdown()
    base = rows[0]["add"] + rows[0]["schedule"]
    for row in rows:
        row["add_schedule_over_shortest"] = (row["add"] + row["schedule"]) / base
    print(markdown_table(
        ["instruction tokens", "add ms", "schedule ms", "collect ms", f"add + schedule / L={LENGTHS[0]}"],
        [[str(r["instruction_tokens"]), f"{r['add']:.3f}", f"{r['schedule']:.3f}", f"{r['collect']:.3f}",
          f"{r['add_schedule_over_shortest']:.2f}"] for r in rows]))
    write_result(args.out, "restore_host_time", {"user_tokens": args.user_tokens, "requests": args.requests,
                                                 "device": "cpu", "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
