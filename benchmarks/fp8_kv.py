"""FP8 KV cache against bf16 KV on one GPU (issue 46's FP8 acceptance, in one call, no Ray): the
1.5B random-weight GraniteMoeHybrid of benchmarks/roofline/model.py in bf16 with the tiny model's
tokenizer (write_serving_checkpoint), in one process. Stages, in this order (--stages picks some):

  * attention: the paged attention kernels alone at --attention-context keys (8,192), bf16 K/V
    against FP8 K/V (the same random values, quantized with per-head scales), the 1.5B model's
    attention shape (16 query heads, 4 KV heads of 128, blocks of 16): decode (one query per
    sequence) at batch 1 and 64, and a 256-token prefill chunk after the context (the user
    message after a restored checkpoint); the median of CUDA-graph replays of 20 back-to-back
    calls (benchmarks/gpu_timing.py), with the K/V bytes each reads over that time;
  * engines: one LLMEngine with kv_cache_dtype auto (bf16 K/V), then one with fp8_e4m3 (scales
    1.0: the model dir has no kv_cache_scales.json), the same budgets, each in turn:
      decode: decode tokens/s at batch 64 (speculation off) for prompts of each --contexts
        length, --decode-tokens each: the tokens emitted while all 64 decode (from the step
        after which every request has its first token to the first that finishes one), over
        that time;
      chat: --requests chat requests (--systems system prompts, one user message each,
        greedy, --output-tokens), with logits: on the bf16 engine the reference, on the FP8
        engine compared with it (greedy agreement: reported, not required equal);
      exactness (FP8 engine only): the same requests in a shared namespace after one warm-up
        request per system prompt (so each restores its system prompt's instruction
        checkpoint), then their second turns (each restoring its first turn's checkpoints),
        against the same prompts each under a cache_salt of its own (from scratch):
        mismatches must be 0, near-ties counted (a divergence where the from-scratch top-2
        gap is within BF16_NEAR_TIE_STEPS bf16 steps of the logit, or within twice the
        largest logit difference the run saw where the tokens agreed).

Prints a table and writes JSON to --out (rewritten after each stage, "partial": true until the
end, so a run cut short keeps its rows).

    python benchmarks/fp8_kv.py --out $OUT/fp8_kv.json      # on the GPU, about 5 minutes
"""

from __future__ import annotations

import argparse
import math
import random
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
from engine.interfaces.generation_request import GenerationRequest  # noqa: E402
from engine.interfaces.sampling_params import SamplingParams  # noqa: E402
from harness import markdown_table, write_result  # noqa: E402

STAGES = ("attention", "engines")
FORMATS = ("auto", "fp8_e4m3")
BF16_NEAR_TIE_STEPS = 4  # a divergence at a top-2 gap within this many bf16 steps is a near-tie
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 4, 128, 16  # the 1.5B model's attention
CALLS = 20  # back-to-back kernel calls in each timed graph
WORDS = ("river stone light paper north quiet garden window market winter answer table bridge "
         "lantern orchard copper meadow harbor signal thread canyon ember glacier").split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON path")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the model (default: the 1.5B random model, written under a temporary dir)")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--attention-context", type=int, default=8192, help="keys of the attention rows")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192],
                        help="prompt tokens of the batch-64 decode rows")
    parser.add_argument("--batch", type=int, default=64, help="sequences of the decode rows")
    parser.add_argument("--decode-tokens", type=int, default=256,
                        help="max_tokens of the decode rows (the rate is taken while all of them decode: "
                             "it must exceed the steps their prefills spread over)")
    parser.add_argument("--output-tokens", type=int, default=64, help="max_tokens of the chat requests")
    parser.add_argument("--requests", type=int, default=32, help="chat requests of the agreement and exactness rows")
    parser.add_argument("--systems", type=int, default=4, help="system prompts they share")
    parser.add_argument("--repeats", type=int, default=15, help="graph replays of each attention row")
    return parser.parse_args(argv)


# ----------------------------------------------------------------- stage attention


def attention_rows(args: argparse.Namespace) -> list[dict]:
    """Decode at batch 1 and 64 and a 256-token prefill chunk, each over args.attention_context
    keys, with bf16 and with FP8 blocks holding the same values."""
    from engine.kernels.attention_reference import quantize_kv
    from engine.kernels.gpu.paged_attention import paged_attention_decode, paged_attention_prefill
    from gpu_timing import graph_seconds

    context = args.attention_context
    blocks_per_seq = -(-(context + 256) // BLOCK_SIZE)
    g = torch.Generator(device="cuda").manual_seed(0)
    kv_scale = torch.stack([torch.full((KV_HEADS,), 0.5), torch.full((KV_HEADS,), 0.25)]).cuda()
    scale = HEAD_DIM**-0.5
    rows = []
    for batch in (1, 64):
        shape = (batch * blocks_per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        keys = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)
        values = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)
        caches = {"bf16": (keys, values, None),
                  "fp8_e4m3": (quantize_kv(keys, kv_scale[0]), quantize_kv(values, kv_scale[1]), kv_scale)}
        table = torch.randperm(batch * blocks_per_seq, device="cuda", generator=g).view(batch, blocks_per_seq)
        query = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16)
        out = torch.empty_like(query)
        decode_rows_t = torch.arange(batch, device="cuda")
        lens = torch.full((batch,), context, device="cuda")
        chunk = torch.randn(256, Q_HEADS, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16)
        chunk_out = torch.empty_like(chunk)
        zero, length = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.full((1,), 256, device="cuda")
        start = torch.full((1,), context, device="cuda")
        for name, (key_cache, value_cache, kv) in caches.items():
            element = key_cache.element_size()
            decode = graph_seconds(lambda _: paged_attention_decode(
                query, key_cache, value_cache, out, decode_rows_t, lens, table, scale, kv_scale=kv),
                calls=CALLS, repeats=args.repeats)
            read = 2 * batch * context * KV_HEADS * HEAD_DIM * element
            rows.append({"kind": "attention", "kernel": "decode", "kv": name, "batch": batch, "context": context,
                         "seconds": decode, "kv_bytes": read, "kv_bytes_per_s": read / decode})
            if batch == 1:
                prefill = graph_seconds(lambda _: paged_attention_prefill(
                    chunk, key_cache, value_cache, chunk_out, zero, length, start, table[:1], 256, scale,
                    kv_scale=kv), calls=CALLS, repeats=args.repeats)
                read = 2 * (context + 256) * KV_HEADS * HEAD_DIM * element
                rows.append({"kind": "attention", "kernel": "prefill 256 after context", "kv": name, "batch": 1,
                             "context": context, "seconds": prefill, "kv_bytes": read, "kv_bytes_per_s": read / prefill})
        del caches, keys, values
        torch.cuda.empty_cache()
    for row in rows:
        if row["kv"] == "fp8_e4m3":
            bf16 = next(r for r in rows if r["kv"] == "bf16" and r["kernel"] == row["kernel"] and r["batch"] == row["batch"])
            row["speedup_over_bf16"] = bf16["seconds"] / row["seconds"]
    for row in rows:
        print(f"attention {row['kernel']} batch {row['batch']} {row['kv']}: {row['seconds'] * 1e6:.1f} us "
              f"({row['kv_bytes_per_s'] / 1e12:.2f} TB/s of K/V)", flush=True)
    return rows


# ----------------------------------------------------------------- stage engines


def engine_config(model_dir: Path, args: argparse.Namespace, kv_cache_dtype: str) -> EngineConfig:
    """64 sequences of up to the longest context + the output; the same byte budgets for both
    KV formats (FP8 then holds twice the blocks)."""
    longest = max(args.contexts) + args.decode_tokens + 2 * args.output_tokens + 512
    kv_bytes = args.batch * longest * 8 * 1024  # bf16: 8 KiB a token (4 layers x K, V x 4 heads x 128)
    return EngineConfig(
        model_dir=str(model_dir), device="cuda", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
        max_model_len=longest, max_num_seqs=args.batch, max_num_batched_tokens=8192,
        kv_cache_bytes=kv_bytes + (256 << 20), state_cache_bytes=3 << 30, checkpoint_cache_bytes=4 << 30,
        num_speculative_tokens=0,
    )


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, salts: list[str],
              boundaries: list[int | None] | None = None) -> dict:
    """Run the prompts together (request i in namespace salts[i]) to completion: tokens, logits
    (when asked), cached tokens per request, and the decode rate while all of them decode: the
    tokens emitted from the step after which every request has its first token to the first
    step in which one finishes, over that time."""
    ids = [f"{salts[i]}-{i}" for i in range(len(prompts))]
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(ids[i], prompt, params, cache_salt=salts[i],
                                             instruction_boundary=None if boundaries is None else boundaries[i]))
    tokens = {rid: [] for rid in ids}
    logits = {rid: [] for rid in ids}
    cached = dict.fromkeys(ids, 0)
    started = stopped = None
    at_start = at_stop = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
            if out.logits is not None:
                logits[out.request_id].append(out.logits)
        if started is None and all(tokens.values()):
            started, at_start = time.perf_counter(), sum(map(len, tokens.values()))
        elif started is not None and stopped is None and any(out.finished for out in outputs):
            stopped, at_stop = time.perf_counter(), sum(map(len, tokens.values()))
    seconds = (stopped - started) if stopped is not None else float("nan")
    decoded = at_stop - at_start
    return {"tokens": [tokens[r] for r in ids], "logits": [logits[r] for r in ids], "cached": [cached[r] for r in ids],
            "decode_tokens": decoded, "decode_seconds": seconds,
            "tokens_per_s": decoded / seconds if seconds > 0 else float("nan")}


def chat_requests(engine: LLMEngine, args: argparse.Namespace) -> dict:
    """args.requests first turns (args.systems system prompts, round robin; one user message
    each) and args.systems warm-up requests (one a system prompt, other user messages): their
    prompt ids and instruction boundaries."""
    from deployments.prompts.instruction_boundary import find_instruction_boundary

    rng = random.Random(46)
    text = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    systems = [f"You are assistant {s}, careful and brief. " + text(rng.randint(80, 160)) for s in range(args.systems)]

    def rendered(conversation):
        prompt = [int(t) for t in engine.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False)]
        return prompt, find_instruction_boundary(engine.tokenizer, conversation, prompt).position

    def conversation(s):
        return [{"role": "system", "content": systems[s]}, {"role": "user", "content": text(rng.randint(5, 30))}]

    first = [conversation(i % args.systems) for i in range(args.requests)]
    warm = [conversation(s) for s in range(args.systems)]
    return {"first": first, "warm": warm, "rendered": rendered}


def decode_rows(engine: LLMEngine, kv: str, args: argparse.Namespace) -> list[dict]:
    """Decode tokens/s at batch args.batch for each context, on random prompts (each its own
    namespace: nothing restored)."""
    rng = random.Random(7)
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    rows = []
    for context in args.contexts:
        prompts = [[rng.randrange(100, vocab) for _ in range(context)] for _ in range(args.batch)]
        run_batch(engine, prompts[:8], replace(params, max_tokens=4), [f"warm-{kv}-{context}-{i}" for i in range(8)])
        result = run_batch(engine, prompts, params, [f"decode-{kv}-{context}-{i}" for i in range(args.batch)])
        rows.append({"kind": "decode", "kv": kv, "batch": args.batch, "context": context,
                     "max_tokens": args.decode_tokens, "tokens_per_s": result["tokens_per_s"],
                     "decode_tokens": result["decode_tokens"], "decode_seconds": result["decode_seconds"]})
        print(f"decode {kv} batch {args.batch} context {context}: {result['tokens_per_s']:.0f} tok/s", flush=True)
    return rows


def _bf16_step(magnitude: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(magnitude, 1e-30))) - 7)


def divergences(got: list[list[int]], want: list[list[int]], want_logits: list[list[torch.Tensor]],
                got_logits: list[list[torch.Tensor]] | None = None) -> tuple[list[dict], float]:
    """Each request's first divergence of `got` from `want` (position, the reference's top-2
    gap, in bf16 steps), and the largest relative logits difference where the tokens agreed
    (when got_logits is given; else 0)."""
    found, noise = [], 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        for position, (a, b) in enumerate(zip(g, w)):
            row = want_logits[i][position].float()
            if a != b:
                top2 = torch.topk(row, 2).values
                gap = float(top2[0] - top2[1])
                found.append({"request": i, "position": position, "gap": gap,
                              "gap_bf16_steps": gap / _bf16_step(float(top2.abs().max())),
                              "relative_gap": gap / float(row.abs().max())})
                break
            if got_logits is not None:
                noise = max(noise, float((got_logits[i][position].float() - row).abs().max() / row.abs().max()))
        else:
            if len(g) != len(w):
                found.append({"request": i, "position": min(len(g), len(w)), "gap": None,
                              "gap_bf16_steps": None, "relative_gap": None})
    return found, noise


def count_near_ties(found: list[dict], noise: float) -> tuple[int, int]:
    """(near-ties, mismatches) among the divergences: a near-tie's gap is within
    BF16_NEAR_TIE_STEPS bf16 steps, or within twice the logits noise (relative)."""
    near = sum(1 for d in found if d["gap"] is not None and (
        d["gap_bf16_steps"] <= BF16_NEAR_TIE_STEPS or d["relative_gap"] <= 2 * noise))
    return near, len(found) - near


def engine_rows(model_dir: Path, args: argparse.Namespace, rows: list[dict], save) -> None:
    """Append the decode, chat and (FP8) exactness rows of each KV format to rows, one engine
    at a time, saving after each part."""
    reference = None
    for kv in FORMATS:
        started = time.perf_counter()
        engine = LLMEngine(engine_config(model_dir, args, kv))
        capacity = engine.executor.cache_capacity()
        rows.append({"kind": "engine", "kv": kv, "start_seconds": time.perf_counter() - started,
                     "num_blocks": capacity.num_blocks, "kv_bytes_per_token": capacity.bundle_sizing.kv_bytes_per_token})
        print(f"engine {kv}: started in {rows[-1]['start_seconds']:.0f} s, {capacity.num_blocks} KV blocks", flush=True)
        rows += decode_rows(engine, kv, args)
        save(rows)
        chats = chat_requests(engine, args)
        prompts, boundaries = zip(*(chats["rendered"](c) for c in chats["first"]))
        params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True, return_logits=True)
        alone = run_batch(engine, list(prompts), params, [f"alone-{kv}-{i}" for i in range(len(prompts))], list(boundaries))
        if reference is None:
            reference = alone
        else:
            found, _ = divergences(alone["tokens"], reference["tokens"], reference["logits"])
            near, _ = count_near_ties(found, 0.0)
            agreeing = sum(a == b for a, b in zip(alone["tokens"], reference["tokens"]))
            rows.append({"kind": "agreement", "kv": kv, "against": FORMATS[0], "requests": len(prompts),
                         "identical": agreeing, "divergences": found, "at_bf16_near_ties": near,
                         "mean_first_divergence": (sum(d["position"] for d in found) / len(found)) if found else None,
                         "output_tokens": args.output_tokens})
            print(f"greedy agreement {kv} vs {FORMATS[0]}: {agreeing} of {len(prompts)} identical", flush=True)
        if kv == "fp8_e4m3":
            rows.append(exactness_row(engine, chats, prompts, boundaries, params))
        save(rows)
        engine.shutdown()
        del engine
        release_device_memory()


def exactness_row(engine: LLMEngine, chats: dict, prompts, boundaries, params: SamplingParams) -> dict:
    """The first turns restored (each its system prompt's instruction checkpoint, captured by a
    warm-up request) and their second turns restored (their first turn's checkpoints), against
    the same prompts from scratch (a cache_salt each)."""
    n = len(prompts)
    warm_prompts, warm_boundaries = zip(*(chats["rendered"](c) for c in chats["warm"]))
    run_batch(engine, list(warm_prompts), params, ["shared"] * len(warm_prompts), list(warm_boundaries))
    cached_first = run_batch(engine, list(prompts), params, ["shared"] * n, list(boundaries))
    second = []
    for conversation, reply in zip(chats["first"], cached_first["tokens"]):
        turn = conversation + [{"role": "assistant", "content": engine.tokenizer.decode(reply)},
                               {"role": "user", "content": "And then? Say more."}]
        second.append(chats["rendered"](turn))
    prompts2, boundaries2 = zip(*second)
    cached_second = run_batch(engine, list(prompts2), params, ["shared"] * n, list(boundaries2))
    # from scratch after both cached turns, so that their checkpoints evict none of the shared ones
    scratch_first = run_batch(engine, list(prompts), params, [f"scratch1-{i}" for i in range(n)], list(boundaries))
    scratch_second = run_batch(engine, list(prompts2), params, [f"scratch2-{i}" for i in range(n)], list(boundaries2))
    found, noise = [], 0.0
    for turn, cached, scratch in (("first", cached_first, scratch_first), ("second", cached_second, scratch_second)):
        got, turn_noise = divergences(cached["tokens"], scratch["tokens"], scratch["logits"], cached["logits"])
        found += [{"turn": turn, **d} for d in got]
        noise = max(noise, turn_noise)
    near, mismatches = count_near_ties(found, noise)
    restored = [sum(1 for c in run["cached"] if c > 0) for run in (cached_first, cached_second)]
    row = {"kind": "exactness", "kv": "fp8_e4m3", "requests": 2 * n, "restored": sum(restored),
           "restored_first_turn": restored[0], "restored_second_turn": restored[1],
           "scratch_cached_tokens": sum(scratch_first["cached"]) + sum(scratch_second["cached"]),
           "divergences": found, "near_ties": near, "mismatches": mismatches,
           "max_logits_difference_where_equal": noise}
    print(f"exactness fp8: {2 * n} requests ({sum(restored)} restored), {len(found)} divergences: "
          f"{near} near-ties, {mismatches} mismatches; logits differ by at most {noise:.2e} where the tokens agree",
          flush=True)
    return row


def release_device_memory() -> None:
    import gc

    gc.collect()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------- report


def print_report(rows: list[dict]) -> None:
    attention = [r for r in rows if r["kind"] == "attention"]
    if attention:
        print(markdown_table(
            ["kernel", "batch", "context", "KV", "us", "K/V TB/s", "x bf16"],
            [[r["kernel"], str(r["batch"]), str(r["context"]), r["kv"], f"{r['seconds'] * 1e6:.1f}",
              f"{r['kv_bytes_per_s'] / 1e12:.2f}", f"{r.get('speedup_over_bf16', 1.0):.2f}"] for r in attention]))
        print()
    decode = [r for r in rows if r["kind"] == "decode"]
    if decode:
        auto = {r["context"]: r["tokens_per_s"] for r in decode if r["kv"] == "auto"}
        print(markdown_table(
            ["batch", "context", "KV", "decode tok/s", "x bf16"],
            [[str(r["batch"]), str(r["context"]), r["kv"], f"{r['tokens_per_s']:.0f}",
              f"{r['tokens_per_s'] / auto[r['context']]:.2f}" if r["context"] in auto else "-"] for r in decode]))
        print()
    items = []
    for r in rows:
        if r["kind"] == "engine":
            items.append([f"engine {r['kv']}: KV blocks (same budget)", str(r["num_blocks"])])
        elif r["kind"] == "agreement":
            items.append([f"greedy agreement with bf16 KV ({r['requests']} chats, {r['output_tokens']} tokens)",
                          f"{r['identical']} identical; {len(r['divergences'])} diverge "
                          f"({r['at_bf16_near_ties']} at bf16 near-ties)"])
        elif r["kind"] == "exactness":
            items.append([f"FP8: restored vs scratch ({r['requests']} requests, {r['restored']} restored)",
                          f"{r['mismatches']} mismatches, {r['near_ties']} near-ties"])
    if items:
        print(markdown_table(["item", "measured"], items))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_kv.py needs a CUDA device")
    t_start = time.perf_counter()
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch,
                    "contexts": args.contexts, "decode_tokens": args.decode_tokens,
                    "output_tokens": args.output_tokens, "requests": args.requests}
    rows: list[dict] = []

    def save(current: list[dict], partial: bool = True) -> None:
        write_result(args.out, "fp8_kv", {**report, "rows": current, "partial": partial})

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None and "engines" in args.stages:
            from roofline.model import write_serving_checkpoint

            model_dir = Path(tmp) / "granite-hybrid-1p5b-random"
            write_serving_checkpoint(model_dir)
            print(f"model {model_dir} ({time.perf_counter() - t_start:.0f} s)", flush=True)
        for stage in args.stages:
            try:
                if stage == "attention":
                    rows += attention_rows(args)
                elif stage == "engines":
                    engine_rows(model_dir, args, rows, save)
            except Exception:  # keep the rows of the stages that ran
                report.setdefault("errors", []).append(traceback.format_exc())
                traceback.print_exc()
            save(rows)
    report["wall_seconds"] = time.perf_counter() - t_start
    print_report(rows)
    save(rows, partial=False)
    print(f"wrote {args.out} ({report['wall_seconds']:.0f} s)")
    return {**report, "rows": rows}


if __name__ == "__main__":
    main()
