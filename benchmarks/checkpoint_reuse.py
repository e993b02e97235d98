"""Checkpoint reuse: shared system prompts, with each checkpoint_slots setting, in process.

    .venv/bin/python benchmarks/checkpoint_reuse.py
    .venv/bin/python benchmarks/checkpoint_reuse.py --requests 16 --system-tokens 1000

Workload: --systems system prompts of about --system-tokens tokens each, shared by --requests
chat requests (system prompt i % systems, so every system prompt is first seen once and then
reused), each with its own distinct user message of 100-300 tokens. Prompts are rendered the way
the Serve renderer renders them (deployments.prompts.rendering.PromptRenderer: chat template plus
the verified instruction boundary). Requests run one at a time (closed loop, concurrency 1) on an in-process
LLMEngine, greedy with ignore_eos and --max-tokens output tokens, so TTFT is prefill cost and
nothing else.

The same workload runs once per checkpoint_slots setting ([], [prompt], [prompt, response], all
three) in one process, each on a fresh engine after one warm-up request. Per setting:
  TTFT p50/p95      add_request to the first output token;
  prompt computed   prompt tokens prefilled (not restored);
  token hit rate    restored / shareable, where shareable = the instruction-boundary tokens of
                    requests whose system prompt was seen before (what a perfect instruction
                    cache could restore).
Greedy outputs must be identical across settings (checked; a mismatch fails the run).
Prints a table and writes JSON (--out, default benchmarks/results/checkpoint_reuse.json).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from deployments.prompts.rendering import PromptRenderer, RenderedPrompt
from engine.core.llm_engine import LLMEngine
from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.sampling_params import SamplingParams
from harness import add_out_argument, write_result

SETTINGS: list[tuple[str, ...]] = [(), ("prompt",), ("prompt", "response"),
                                   ("prompt", "response", "instruction")]
WORDS = ("model state token layer cache prefix request answer system user policy rule tool data "
         "query budget latency memory block chunk stream batch order review audit account "
         "customer invoice refund shipping warranty product store region language format "
         "always never briefly politely exactly only when unless before after because").split()


@dataclass
class SettingResult:
    checkpoint_slots: list[str]
    num_requests: int
    ttft_ms_p50: float
    ttft_ms_p95: float
    ttft_ms_mean: float
    prompt_tokens: int
    prompt_tokens_computed: int
    prompt_tokens_restored: int
    shareable_tokens: int
    token_hit_rate: float
    wall_s: float


def text_of_tokens(tokenizer, rng: random.Random, target_tokens: int, lead: str) -> str:
    """Pseudo-English of about target_tokens tokens (grown word by word, then measured)."""
    words = [lead]
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < target_tokens:
        words.extend(rng.choice(WORDS) for _ in range(max(1, (target_tokens // 8))))
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) > target_tokens:
        words.pop()
    return " ".join(words)


def build_workload(tokenizer, args) -> list[tuple[int, RenderedPrompt]]:
    """(system index, rendered prompt) per request, in arrival order."""
    rng = random.Random(args.seed)
    systems = [text_of_tokens(tokenizer, rng, args.system_tokens, f"System policy {i}:")
               for i in range(args.systems)]
    workload, renderer = [], PromptRenderer(tokenizer)
    for r in range(args.requests):
        s = r % args.systems
        user = text_of_tokens(tokenizer, rng, rng.randint(100, 300), f"Question {r}:")
        prompt = renderer.render_chat([{"role": "system", "content": systems[s]},
                                       {"role": "user", "content": user}])
        if prompt.instruction_boundary is None:
            raise SystemExit(f"request {r}: no instruction boundary ({prompt.boundary_rejection})")
        workload.append((s, prompt))
    return workload


def run_setting(slots: tuple[str, ...], workload, args) -> tuple[SettingResult, list[list[int]]]:
    engine = LLMEngine(EngineConfig(
        model_dir=args.model_dir, max_model_len=args.max_model_len, block_size=16,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=4,
        kv_cache_bytes=args.kv_cache_bytes, state_cache_bytes=64 * 1024 * 1024,
        checkpoint_slots=slots, checkpoint_cache_bytes=args.checkpoint_cache_bytes))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    warmup = workload[0][1]
    engine.add_request(GenerationRequest("warmup", warmup.token_ids, params, cache_salt="warmup",
                                         instruction_boundary=warmup.instruction_boundary))
    while engine.has_unfinished_requests():
        engine.step()
    before = engine.stats().scheduler

    ttfts, outputs, seen, shareable, restored = [], [], set(), 0, 0
    start = time.perf_counter()
    for r, (s, prompt) in enumerate(workload):
        if s in seen:
            shareable += prompt.instruction_boundary
        seen.add(s)
        t0 = time.perf_counter()
        engine.add_request(GenerationRequest(f"r{r}", prompt.token_ids, params,
                                             instruction_boundary=prompt.instruction_boundary))
        tokens, first = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter() - t0
                tokens += out.new_token_ids
                if out.finished:
                    restored += out.num_cached_tokens
        ttfts.append(first * 1000)
        outputs.append(tokens)
    wall = time.perf_counter() - start
    after = engine.stats().scheduler
    computed = after.prompt_tokens_computed - before.prompt_tokens_computed
    assert after.prompt_tokens_restored - before.prompt_tokens_restored == restored
    result = SettingResult(
        checkpoint_slots=list(slots), num_requests=len(workload),
        ttft_ms_p50=statistics.median(ttfts), ttft_ms_p95=percentile(ttfts, 95),
        ttft_ms_mean=statistics.fmean(ttfts),
        prompt_tokens=sum(len(p.token_ids) for _, p in workload),
        prompt_tokens_computed=computed, prompt_tokens_restored=restored,
        shareable_tokens=shareable, token_hit_rate=restored / shareable if shareable else 0.0,
        wall_s=wall)
    del engine
    gc.collect()
    return result, outputs


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def table(results: list[SettingResult]) -> str:
    head = (f"{'checkpoint_slots':<32} {'TTFT p50 ms':>11} {'TTFT p95 ms':>11} "
            f"{'prompt computed':>15} {'restored':>9} {'shareable':>9} {'hit rate':>8} {'wall s':>7}")
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(f"{'[' + ', '.join(r.checkpoint_slots) + ']':<32} {r.ttft_ms_p50:>11.1f} "
                    f"{r.ttft_ms_p95:>11.1f} {r.prompt_tokens_computed:>15} "
                    f"{r.prompt_tokens_restored:>9} {r.shareable_tokens:>9} "
                    f"{r.token_hit_rate:>8.1%} {r.wall_s:>7.1f}")
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--systems", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-bytes", type=int, default=256 * 1024 * 1024)
    p.add_argument("--checkpoint-cache-bytes", type=int, default=64 * 1024 * 1024)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p, "checkpoint_reuse")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    workload = build_workload(tokenizer, args)
    boundaries = [p.instruction_boundary for _, p in workload]
    lengths = [len(p.token_ids) for _, p in workload]
    print(f"{len(workload)} requests, {args.systems} system prompts, instruction boundaries "
          f"{min(boundaries)}-{max(boundaries)} tokens, prompts {min(lengths)}-{max(lengths)} tokens, "
          f"torch threads {torch.get_num_threads()}")

    results, reference = [], None
    for slots in SETTINGS:
        result, outputs = run_setting(slots, workload, args)
        if reference is None:
            reference = outputs
        elif outputs != reference:
            bad = [i for i, (a, b) in enumerate(zip(outputs, reference)) if a != b]
            raise SystemExit(f"checkpoint_slots {list(slots)}: outputs differ from [] at {bad}")
        results.append(result)
        print(f"  done {list(slots)} in {result.wall_s:.1f}s", flush=True)
    print(table(results))
    print("greedy outputs identical across settings: yes")

    out = write_result(args.out, "checkpoint_reuse",
                       {"args": vars(args), "results": [asdict(r) for r in results]},
                       machine_extra={"torch_threads": torch.get_num_threads()})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
