"""hybrid-serve over HTTP (`serve run`, Ray Serve) against the same engine in this process, in one
device call (issue 44). scripts/gpu_serve_check.sh runs the three steps; docs/gpu_serving.md
says what each measurement means and what it gave.

    python benchmarks/gpu_serve.py model --out DIR [--tiny]
    python benchmarks/gpu_serve.py bench-config --config serve_config_gpu.yaml --model-dir DIR \\
        --out FILE [--cpu]
    python benchmarks/gpu_serve.py run --config FILE --out DIR [--quick] [--parts ...]

model         the 1.5B random-weight GraniteMoeHybrid (benchmarks/roofline/model.py) with the tiny
              model's tokenizer, its vocabulary cut to the tokenizer's 2,048 ids
              (roofline/model.py shrink_vocab), and the output rows of ids that decode to no text (the
              special tokens, partial UTF-8 bytes) zeroed, so that a greedy reply always has
              text: an HTTP client takes the time to first token at the first non-empty
              content, and the random model's greedy replies otherwise decode to nothing
              (benchmarks/results/bench/NOTES.md). --tiny: the embedded tiny model (CPU runs).
bench-config  the config `serve run` gets: the GPU config's application unchanged but for
              engine.model_dir, plus a second application "hybrid-serve-pr" at /pr with
              checkpoint_slots [prompt, response] and smaller budgets (the compare-policies
              baseline); both LLM servers ask for 0.5 GPU so that the two share the card.
              --cpu: device cpu, float32 and CPU-sized engines (a dry run on the tiny model).
run           starts the in-process engines (the main application's engine config, and the
              /pr one's), waits for both applications to answer /v1/models, then runs the
              parts, each under its own time limit and within --deadline-s, writing
              OUT/gpu_serve_<part>.json as each ends and OUT/gpu_serve_summary.json last:
  benchy        llama-benchy --pp 256 --tg 32 --depth 0 8192 --enable-prefix-caching over HTTP
                (a subprocess; its corpus is the repository's docs, put in its cache), and the
                same requests to the in-process engine: TTFT at depth 8192 (the context is the
                system message, restored from the instruction checkpoint) over TTFT at depth 0;
  concurrency   a 4,096-token greedy generation over HTTP, and while it runs a second request
                with the same instructions (system message) and another user message: both
                must finish with their full token counts, the second restoring its instructions
                (usage.prompt_tokens_details.cached_tokens) while the first still generates;
  throughput    output tok/s at concurrency 1, 16, 64: streamed /v1/completions over HTTP
                against AsyncLLMEngine.generate in process (benchmarks/serve_latency.py's paths
                and rounds), the same prompt ids, ignore_eos, greedy;
  compare       hybrid-serve-bench's shared-instructions workload at 2,000 and 8,000
                instruction tokens against four targets, interleaved by rounds: the two
                applications over HTTP ([prompt, response, instruction] and [prompt, response])
                and the two in-process engines; one bench.json (compare-policies' comparison,
                made over HTTP by pointing the runner at the two applications).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import hashlib
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

MAIN_APP, PR_APP = "hybrid-serve", "hybrid-serve-pr"
PR_PREFIX = "/pr"
GIB = 1024 ** 3
# llama-benchy reads its corpus from ~/.cache/llama-benchy/<md5 of the URL>.txt when that file
# exists; this URL is never fetched (the device machine has no network): the file is written
# first, from the repository's own prose.
CORPUS_URL = "file:///hybrid-serve/docs-corpus.txt"
CORPUS_FILES = ("README.md", "docs/design.md", "docs/configuration.md", "docs/reliability.md",
                "benchmarks/README.md", "k8s/README.md")


def log(*parts) -> None:
    print(f"[gpu_serve {time.strftime('%H:%M:%S')}]", *parts, flush=True)


# ----- model


def text_only_rows(model_dir: Path) -> dict:
    """Zero the output-projection rows of the ids whose text is empty or not valid UTF-8 on its
    own (special tokens, byte pieces): with every other row random, an id with a zero row
    (logit 0) never wins a greedy argmax (some random row's logit is above 0), so greedy
    replies always decode to text. Tied embeddings: the embedding rows are those rows (the
    prompt's special tokens then embed to zero: the weights are random anyway)."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = set(tokenizer.get_added_tokens_decoder())  # {id: AddedToken}
    dead = sorted(i for i in range(config["vocab_size"])
                  if i in special or not (text := tokenizer.decode([i], skip_special_tokens=True))
                  or "\ufffd" in text)
    tensors = load_file(str(model_dir / "model.safetensors"))
    name = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    weight = tensors[name].clone()
    weight[dead] = 0
    tensors[name] = weight.contiguous()
    save_file(tensors, str(model_dir / "model.safetensors"))
    info = {"zeroed_rows_of": name, "zeroed_ids": dead, "vocab_size": config["vocab_size"]}
    (model_dir / "gpu_serve_model.json").write_text(json.dumps(info))
    return info


def write_model(out: Path, tiny: bool) -> None:
    from engine.engine_config import DEFAULT_MODEL_DIR

    if out.exists():
        shutil.rmtree(out)
    if tiny:
        shutil.copytree(DEFAULT_MODEL_DIR, out)
    else:
        from roofline.model import write_serving_checkpoint

        write_serving_checkpoint(out)
    info = text_only_rows(out)
    log(f"model at {out}: {len(info['zeroed_ids'])} of {info['vocab_size']} output rows zeroed "
        f"({info['zeroed_rows_of']})")


# ----- the config serve run gets


def bench_config(config_path: Path, model_dir: str, cpu: bool) -> dict:
    """The GPU config with engine.model_dir set and the [prompt, response] application added
    (see the module doc)."""
    import yaml

    config = yaml.safe_load(config_path.read_text())
    (main,) = config["applications"]
    args = main["args"]
    args["engine"]["model_dir"] = model_dir
    if cpu:
        args["engine"].update(device="cpu", dtype="float32", max_model_len=4096,
                              max_num_batched_tokens=512, max_num_seqs=64,
                              kv_cache_bytes=256 * 2 ** 20, state_cache_bytes=128 * 2 ** 20,
                              checkpoint_cache_bytes=128 * 2 ** 20)
        args.update(worker_num_cpus=0.5, llm_server_num_cpus=0.1, ingress_num_cpus=0.1,
                    renderer_num_cpus=0.1)
    pr = copy.deepcopy(main)
    pr["name"], pr["route_prefix"] = PR_APP, PR_PREFIX
    pr_engine = pr["args"]["engine"]
    pr_engine["checkpoint_slots"] = ["prompt", "response"]
    if not cpu:  # the comparison runs at concurrency 1: 16 sequences, small budgets
        pr_engine.update(max_num_seqs=16, kv_cache_bytes=2 * GIB, state_cache_bytes=1 * GIB,
                         checkpoint_cache_bytes=1 * GIB)
    for app in (main, pr):
        if app["args"]["engine"]["device"].startswith("cuda"):
            (llm,) = [d for d in app["deployments"] if d["name"] == "LLMServer"]
            # build_app asks for llm_server_num_cpus + worker_num_cpus and 1 GPU; Serve's
            # config replaces ray_actor_options as a whole
            llm["ray_actor_options"] = {
                "num_cpus": app["args"]["llm_server_num_cpus"] + app["args"]["worker_num_cpus"],
                "num_gpus": 0.5}
    for d in pr["deployments"]:
        if d["name"] != "LLMServer":
            d["autoscaling_config"].update(min_replicas=1, max_replicas=1)
    config["applications"] = [main, pr]
    return config


def engine_configs(config: dict):
    """(main app config, main EngineConfig, /pr EngineConfig) from a bench config."""
    from deployments.config import parse_app_config

    apps = {app["name"]: parse_app_config(app["args"]) for app in config["applications"]}
    return apps[MAIN_APP], apps[MAIN_APP].engine, apps[PR_APP].engine


# ----- the in-process engines and the HTTP targets


@contextlib.contextmanager
def in_process_targets(*configs):
    """hybrid_serve_bench in-process targets (engine_target.EngineChat over an AsyncLLMEngine
    each), one per engine config, labelled 'in-process [slots]'."""
    from hybrid_serve_bench.engine_target import engine_targets

    with contextlib.ExitStack() as stack:
        out = []
        for config in configs:
            (target,), _ = stack.enter_context(engine_targets([config.checkpoint_slots], config))
            out.append(dataclasses.replace(target, label=f"in-process {target.label}"))
            log(f"in-process engine started: {target.label}")
        yield out


def wait_ready(url: str, model: str, timeout_s: float) -> float:
    """Poll GET {url}/v1/models until it lists `model`; seconds waited (TimeoutError beyond)."""
    import httpx

    start = time.perf_counter()
    while True:
        try:
            body = httpx.get(f"{url}/v1/models", timeout=5).json()
            if any(m.get("id") == model for m in body.get("data", [])):
                return time.perf_counter() - start
        except Exception:
            pass
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"{url}/v1/models did not list {model} within {timeout_s:.0f} s")
        time.sleep(1.0)


# ----- corpus (llama-benchy's and the in-process copy of its requests)


def corpus_text() -> str:
    return "\n\n".join((ROOT / f).read_text() for f in CORPUS_FILES if (ROOT / f).is_file())


def put_benchy_corpus(text: str) -> Path:
    cache = Path.home() / ".cache" / "llama-benchy"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{hashlib.md5(CORPUS_URL.encode()).hexdigest()}.txt"
    path.write_text(text)
    return path


# ----- part: llama-benchy


def benchy_sizes(quick: bool) -> dict:
    return {"pp": 64, "tg": 8, "depths": [0, 1024], "runs": 2} if quick else \
        {"pp": 256, "tg": 32, "depths": [0, 8192], "runs": 3}


def run_llama_benchy(args, model: str, model_dir: str, sizes: dict, limit_s: float) -> dict:
    out_json = args.out / "llama_benchy_raw.json"
    cmd = [sys.executable, "-m", "llama_benchy", "--base-url", f"{args.base_url}/v1",
           "--model", model, "--served-model-name", model, "--tokenizer", model_dir,
           "--pp", str(sizes["pp"]), "--tg", str(sizes["tg"]),
           "--depth", *map(str, sizes["depths"]), "--enable-prefix-caching", "--exact-tg",
           "--runs", str(sizes["runs"]), "--book-url", CORPUS_URL, "--skip-coherence",
           # greedy: a sampled first token could be one of the zeroed ids (logit 0, no text),
           # which would move the first content a step later on some requests
           "--extra-body", "temperature=0",
           "--format", "json", "--save-result", str(out_json)]
    log("llama-benchy:", " ".join(cmd[1:]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s)
    print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n", flush=True)
    result = {"command": cmd[1:], "returncode": proc.returncode}
    if out_json.is_file():
        result["result"] = json.loads(out_json.read_text())
        out_json.unlink()
    return result


async def in_process_benchy(target, tokenizer_dir: str, text: str, sizes: dict) -> dict:
    """llama-benchy's requests, to the in-process engine: per depth, a warm-up run and `runs`
    runs; at depth D a context load (system = D corpus tokens, user ".") then the inference
    request (the same system, user = pp corpus tokens); at depth 0 the user message alone;
    greedy, as the HTTP requests (--extra-body temperature=0). TTFT at the first token with
    text, from the engine submission (rendering excluded)."""
    from tokenizers import Tokenizer

    from hybrid_serve_bench.client import ChatRequest

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    rng = random.Random(0)
    out = {}
    for depth in sizes["depths"]:
        need = depth + sizes["pp"]
        pool = ids * (need // len(ids) + 2)
        ttfts, loads, cached = [], [], []
        for run in range(sizes["runs"] + 1):
            start = rng.randrange(0, len(pool) - need)
            context = tokenizer.decode(pool[start:start + depth]) if depth else ""
            prompt = tokenizer.decode(pool[start + depth:start + need])
            system = [{"role": "system", "content": context}] if context else []
            body = {"max_tokens": sizes["tg"], "extra_body": {"ignore_eos": True}}
            if depth:
                load = await target.chat(ChatRequest(target.model, system + [{"role": "user", "content": "."}],
                                                     temperature=0.0, **body))
                if run:
                    loads.append(load.ttft_s)
            res = await target.chat(ChatRequest(target.model, system + [{"role": "user", "content": prompt}],
                                                temperature=0.0, **body))
            if res.error:
                raise RuntimeError(f"in-process depth {depth}: {res.error}")
            if run:  # run 0 warms up, as llama-benchy's
                ttfts.append(res.ttft_s)
                cached.append(res.cached_tokens)
        out[f"d{depth}"] = {"ttft_ms_mean": 1000 * statistics.fmean(ttfts),
                            "ttft_ms": [1000 * t for t in ttfts], "cached_tokens": cached,
                            **({"context_load_ttft_ms": [1000 * t for t in loads]} if depth else {})}
    return out


def benchy_ttfts(raw: dict) -> dict:
    """llama-benchy's JSON -> {"pp<P> d<D>" (+ " context load"): its TTFT means in ms}:
    e2e_ttft (send to first content), ttfr (send to first event), est_ppt (ttfr less the
    /v1/models latency it measured first)."""
    rows = {}
    for bench in (raw or {}).get("benchmarks", []):
        name = f"pp{bench.get('prompt_size')} d{bench.get('context_size')}" + (
            " context load" if bench.get("is_context_prefill_phase") else "")
        rows[name] = {key: (bench.get(key) or {}).get("mean") for key in ("e2e_ttft", "ttft", "ttfr", "est_ppt")
                      if isinstance(bench.get(key), dict)}
    return rows


# ----- part: the concurrency test


async def stream_until_done(client, url: str, body: dict, first_text: asyncio.Event | None = None) -> dict:
    """One streamed chat request to its end (hybrid_serve_bench/client.py's rules: TTFT at the
    first non-empty content, usage from the last event, render_s from the Server-Timing
    header); sets first_text at the first content."""
    from hybrid_serve_bench.client import server_render_s

    start = time.perf_counter()
    out = {"ttft_s": None, "render_s": None, "usage": None, "finish_reason": None, "error": None}
    parts = []
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                out["error"] = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return {**out, "e2e_s": time.perf_counter() - start, "reply": ""}
            out["render_s"] = server_render_s(response.headers.get("server-timing"))
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() in ("", "[DONE]"):
                    continue
                event = json.loads(line[5:].strip())
                if event.get("error"):
                    out["error"] = json.dumps(event["error"])[:300]
                out["usage"] = event.get("usage") or out["usage"]
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if out["ttft_s"] is None:
                            out["ttft_s"] = time.perf_counter() - start
                            if first_text is not None:
                                first_text.set()
                        parts.append(content)
                    out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    if first_text is not None:
        first_text.set()
    return {**out, "e2e_s": time.perf_counter() - start, "reply": "".join(parts)}


async def concurrency_test(args, model: str, tokenizer_dir: str, text: str, quick: bool) -> dict:
    """The seed's concurrency test over HTTP (see the module doc). The second request is sent
    once the long one has streamed its first text (its prompt, and so its instruction
    checkpoint, is done). After the pair, the second request again with a fresh salt (computed
    from scratch, nothing restored): its greedy text beside the restored one's (bf16 numerics
    of the two paths may differ; reported, not asserted)."""
    import httpx
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    system = tokenizer.decode(ids[:300 if quick else 2000])
    long_tokens = 256 if quick else 4096
    salt = f"concurrency-{uuid.uuid4().hex[:8]}"
    url = f"{args.base_url}/v1/chat/completions"

    def body(user: str, max_tokens: int, salt: str) -> dict:
        return {"model": model, "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": user}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "cache_salt": salt,
                "stream": True, "stream_options": {"include_usage": True}}

    second_user = "Summarize the instructions in one line."
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        first_text = asyncio.Event()
        long_task = asyncio.create_task(stream_until_done(
            client, url, body("Write a long story about the sea.", long_tokens, salt), first_text))
        await first_text.wait()
        second_start = time.perf_counter() - t0
        second = await stream_until_done(client, url, body(second_user, 32, salt))
        second_end = time.perf_counter() - t0
        first = await long_task
        first_end = time.perf_counter() - t0
        cold = await stream_until_done(client, url, body(second_user, 32, f"cold-{uuid.uuid4().hex[:8]}"))
    # the instructions as the server counts them: the rendered system turn is a few tokens more
    system_tokens = len(tokenizer.encode(system, add_special_tokens=False).ids)

    def view(r: dict) -> dict:
        usage = r["usage"] or {}
        return {"error": r["error"], "ttft_ms": None if r["ttft_s"] is None else 1000 * r["ttft_s"],
                "render_ms": None if r["render_s"] is None else 1000 * r["render_s"],
                "e2e_ms": 1000 * r["e2e_s"], "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                "finish_reason": r["finish_reason"], "reply_chars": len(r["reply"])}

    views = {"long": view(first), "second": view(second), "second_cold": view(cold)}
    checks = {
        "long_complete": first["error"] is None and views["long"]["completion_tokens"] == long_tokens
                         and first["finish_reason"] == "length" and bool(first["reply"]),
        "second_complete": second["error"] is None and views["second"]["completion_tokens"] == 32
                           and second["finish_reason"] == "length" and bool(second["reply"]),
        "second_restored_instructions": (views["second"]["cached_tokens"] or 0) >= system_tokens,
        "second_finished_while_long_ran": second_end < first_end,
        "cold_computed_everything": views["second_cold"]["cached_tokens"] == 0,
    }
    return {"system_tokens": system_tokens, "long_max_tokens": long_tokens,
            "second_sent_at_s": second_start, "second_done_at_s": second_end, "long_done_at_s": first_end,
            **views, "second_text_equals_cold": second["reply"] == cold["reply"],
            "checks": checks, "passed": all(checks.values())}


# ----- part: output tok/s, HTTP against in process


async def throughput(args, model: str, engine, tokenizer_dir: str, quick: bool) -> dict:
    from tokenizers import Tokenizer

    from serve_latency import (PROMPT, ServingPath, http_session, overheads, request_body, run_levels,
                               time_http, time_in_process)

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    prompt_ids = tokenizer.encode(PROMPT * 8, add_special_tokens=False).ids
    levels = [1, 4] if quick else [1, 16, 64]
    max_tokens, rounds = (16, 1) if quick else (256, 2)
    async with http_session(max(levels) + 8) as session:
        paths = [ServingPath("in-process", lambda n: time_in_process(engine, prompt_ids, n)),
                 ServingPath("http", lambda n: time_http(session, args.base_url,
                                                          *request_body("ids", model, prompt_ids, n)))]
        await run_levels("gpu", paths, levels, 1, 8)  # warm-up: every level's batch shapes, unmeasured
        results = await run_levels("gpu", paths, levels, rounds, max_tokens)
    return {"prompt_tokens": len(prompt_ids), "max_tokens": max_tokens, "rounds": rounds,
            "results": [dataclasses.asdict(r) for r in results], "overhead": overheads(results),
            "output_tok_s": {f"{r.path} c{r.concurrency}": r.throughput_tok_s for r in results}}


# ----- part: compare-policies' comparison over HTTP and in process


async def http_warm_up(targets, conversations, salt_prefix="warm-up") -> None:
    """engine_target.warm_up's HTTP twin: each conversation's first turn once, under a throwaway
    salt, then the next ones (restoring what the first left); raises if one fails."""
    import httpx

    from hybrid_serve_bench.client import ChatRequest, stream_chat

    salt = f"{salt_prefix}-{uuid.uuid4().hex[:8]}"
    async with httpx.AsyncClient(timeout=600) as client:
        for target in targets:
            for messages in conversations:
                r = await stream_chat(client, target.chat_url, ChatRequest(
                    target.model, messages, 4, extra_body={"cache_salt": salt, "ignore_eos": True}))
                if r.error:
                    raise RuntimeError(f"warm-up request to {target.label} failed: {r.error}")


def compare(args, model: str, model_dir: str, inproc_targets, quick: bool, limit_s: float) -> dict:
    """hybrid_serve_bench's measure() (cli.py) over the four targets, its workload run under
    limit_s (less the warm-up's time); the bench.json it writes, and a short table."""
    from hybrid_serve_bench.cli import parse_args, prepare, write_result
    from hybrid_serve_bench.engine_target import warm_up
    from hybrid_serve_bench.runner import RunSettings, Target, run_workloads, server_identity
    from hybrid_serve_bench.stats import summarize

    start = time.perf_counter()
    lengths = ["300", "1000"] if quick else ["2000", "8000"]
    argv = ["compare-servers", "--base-url", args.base_url, "--base-url", args.base_url + PR_PREFIX,
            "--label", "http [prompt, response, instruction]", "--label", "http [prompt, response]",
            "--model", model, "--tokenizer", model_dir, "--workload", "shared-instructions",
            "--instruction-tokens", *lengths, "--requests", "8" if quick else "16",
            "--concurrency", "1", "--max-tokens", "16", "--rounds", "2",
            "--user-tokens", "50-500"]
    if getattr(args, "no_pr_app", False):
        argv = argv[:3] + argv[5:7] + argv[9:]
    run = parse_args(argv)
    counter, workloads = prepare(run)
    http = [Target(label, url, model) for label, url in zip(run.label, run.base_url)]
    firsts = [w.conversations[0].turns[0].new_messages for w in workloads]
    seconds = [w.conversations[1].turns[0].new_messages for w in workloads]
    asyncio.run(http_warm_up(http, firsts + seconds))
    asyncio.run(warm_up(inproc_targets, firsts, then=seconds))
    targets = http + list(inproc_targets)

    async def identities():
        import httpx

        async with httpx.AsyncClient(timeout=30) as client:
            return [await server_identity(client, t.base_url) for t in http]

    ids = asyncio.run(identities()) + [{"in_process": True}] * len(inproc_targets)
    settings = RunSettings(concurrency=run.concurrency, max_tokens=run.max_tokens, rounds=run.rounds,
                           timeout_s=run.timeout_s, seed=run.seed, ignore_eos=True,
                           cache_salt=run.cache_salt)
    left = max(5.0, limit_s - (time.perf_counter() - start))
    records, passes = asyncio.run(asyncio.wait_for(
        run_workloads(targets, workloads, run.rate, settings, counter), left))
    rows = summarize(records, passes, run.target_ttft_ms)
    target_dicts = [{"label": t.label, "base_url": t.base_url, "model": t.model, "server_models": i}
                    for t, i in zip(targets, ids)]
    for target, info in zip(targets, target_dicts):
        if target.chat is not None:
            info["render_s_p50"] = target.chat.render_p50_s()
            info["engine_config"] = dataclasses.asdict(target.chat.engine.engine.config) if hasattr(
                target.chat.engine.engine, "config") else None
    run.out_dir = args.out / "compare"
    paths = write_result(run, argv, target_dicts, rows, records, workloads, counter)
    result = json.loads(Path(paths["json"]).read_text())
    shutil.rmtree(run.out_dir, ignore_errors=True)  # the plots stay behind: 8 files come back
    table = {f"{r['target']} | {r['workload']}": {k: r[k] for k in (
        "requests", "errors", "ttft_p50_ms", "ttft_p95_ms", "render_p50_ms", "token_hit_rate",
        "output_tok_s")} for r in rows}
    return {"note": "hybrid-serve-bench compare-servers against the two applications of the running "
                    "Serve (the two checkpoint_slots settings compare-policies compares), plus the "
                    "same two settings in process (benchmarks/gpu_serve.py compare)",
            "bench": result, "table": table}


# ----- run


def device_name(device: str) -> str:
    from hybrid_serve_bench.engine_target import device_name as name

    return name(device)


def run(args) -> None:
    import yaml

    t0 = time.perf_counter()
    deadline = t0 + args.deadline_s
    config = yaml.safe_load(args.config.read_text())
    app, main_engine, pr_engine = engine_configs(config)
    model, model_dir = app.served_model_name, main_engine.model_dir
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"device": device_name(main_engine.device), "config": str(args.config),
               "engine": dataclasses.asdict(main_engine), "parts": {}, "timeline_s": {}}
    text = corpus_text()
    put_benchy_corpus(text)
    import torch

    torch.set_num_threads(max(1, int(app.worker_num_cpus)))  # as many as the replica's
    from serve_latency import match_replica_interpreter

    match_replica_interpreter()  # the in-process engines share the GIL as the replica's do

    def mark(name: str) -> None:
        summary["timeline_s"][name] = round(time.perf_counter() - t0, 1)
        log(f"{name} ({summary['timeline_s'][name]} s)")

    def write_summary() -> None:
        from harness import write_result

        write_result(args.out / "gpu_serve_summary.json", "gpu_serve", summary,
                     {"torch": torch.__version__, "device_name": summary["device"]})

    configs = (main_engine,) if args.no_in_process_pr else (main_engine, pr_engine)
    with in_process_targets(*configs) as inproc:
        mark("in-process engines started")
        try:
            waited = wait_ready(args.base_url, model, max(10.0, min(args.ready_timeout_s, deadline - time.perf_counter())))
            mark(f"serve answered /v1/models (waited {waited:.0f} s)")
        except TimeoutError as exc:
            summary["error"] = str(exc)
            log(exc)
            write_summary()
            return
        try:  # the /pr application only serves the comparison: the rest runs without it
            wait_ready(args.base_url + PR_PREFIX, model, 60)
            mark(f"{PR_PREFIX} answered /v1/models")
        except TimeoutError as exc:
            summary["pr_app_error"] = str(exc)
            log(exc, "- the comparison runs without it")
            args.no_pr_app = True
        parts = {
            "benchy": lambda limit: benchy_part(args, model, model_dir, inproc[0], text, limit),
            "concurrency": lambda limit: asyncio.run(asyncio.wait_for(
                concurrency_test(args, model, model_dir, text, args.quick), limit)),
            "throughput": lambda limit: asyncio.run(asyncio.wait_for(
                throughput(args, model, inproc[0].chat.engine, model_dir, args.quick), limit)),
            "compare": lambda limit: compare(args, model, model_dir, inproc, args.quick, limit),
        }
        for name in args.parts:
            limit = min(args.part_limit_s.get(name, 120), deadline - time.perf_counter())
            if limit < 10:
                summary["parts"][name] = {"skipped": "no time left before the deadline"}
                log(f"{name}: skipped, no time left")
                continue
            log(f"{name}: start (limit {limit:.0f} s)")
            start = time.perf_counter()
            try:
                result = parts[name](limit)
                status = "ok"
            except Exception as exc:  # one part's failure is reported; the next part still runs
                traceback.print_exc()
                result, status = {"error": f"{type(exc).__name__}: {exc}"}, "failed"
            result["seconds"] = round(time.perf_counter() - start, 1)
            from harness import write_result

            write_result(args.out / f"gpu_serve_{name}.json", f"gpu_serve_{name}", result,
                         {"device_name": summary["device"]})
            summary["parts"][name] = {"status": status, **headline(name, result)}
            mark(f"{name}: {status}")
            write_summary()
    write_summary()
    print(json.dumps(summary["parts"], indent=1, default=str), flush=True)


def benchy_part(args, model, model_dir, target, text, limit) -> dict:
    sizes = benchy_sizes(args.quick)
    start = time.perf_counter()
    http = run_llama_benchy(args, model, model_dir, sizes, max(10, limit - 40))
    left = limit - (time.perf_counter() - start)
    in_process = asyncio.run(asyncio.wait_for(in_process_benchy(target, model_dir, text, sizes), max(5, left)))
    return {"sizes": sizes, "http": http, "http_ttft_ms": benchy_ttfts(http.get("result")),
            "in_process": in_process}


def headline(name: str, result: dict) -> dict:
    """The few figures of a part that the summary keeps (None where the part gave none)."""
    if "error" in result:
        return {"error": result["error"]}
    try:
        if name == "benchy":
            return {"http_ttft_ms": result["http_ttft_ms"],
                    "in_process_ttft_ms": {k: v["ttft_ms_mean"] for k, v in result["in_process"].items()},
                    "llama_benchy_returncode": result["http"]["returncode"]}
        if name == "concurrency":
            return {"passed": result["passed"], "checks": result["checks"],
                    "second_cached_tokens": result["second"]["cached_tokens"],
                    "system_tokens": result["system_tokens"]}
        if name == "throughput":
            return {"output_tok_s": result["output_tok_s"],
                    "overhead": [{k: o[k] for k in ("concurrency", "ttft_ms_above", "throughput_ratio")}
                                 for o in result["overhead"]]}
        if name == "compare":
            return {"table": result["table"]}
    except (KeyError, TypeError) as exc:
        return {"headline_error": repr(exc)}
    return {}


def report(results: Path) -> str:
    """The headline figures of the gpu_serve_*.json under `results`, as text (gpu_serve.txt)."""
    def load(name):
        path = results / f"gpu_serve_{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    summary = load("summary") or {}
    lines = [f"hybrid-serve over HTTP (serve run) vs in process on {summary.get('device')}, "
             f"{summary.get('machine', {}).get('platform', '')}", ""]
    benchy = load("benchy")
    if benchy and "http_ttft_ms" in benchy:
        lines.append("llama-benchy " + " ".join(benchy["http"]["command"][benchy["http"]["command"].index("--pp"):])
                     if "--pp" in benchy["http"]["command"] else "llama-benchy")
        lines.append(f"  {'test':<22} {'e2e_ttft ms':>12} {'est_ppt ms':>11}   (HTTP, llama-benchy means)")
        for name, row in benchy["http_ttft_ms"].items():
            lines.append(f"  {name:<22} {row.get('e2e_ttft') or float('nan'):>12.1f} {row.get('est_ppt') or float('nan'):>11.1f}")
        http = {k: v.get("e2e_ttft") for k, v in benchy["http_ttft_ms"].items() if "context load" not in k}
        keys = sorted(http, key=lambda k: int(k.split(" d")[1]))
        if len(keys) == 2 and all(http[k] for k in keys):
            lines.append(f"  HTTP: deep / d0 = {http[keys[1]] / http[keys[0]]:.2f}x (acceptance: within 1.2x)")
        inp = benchy["in_process"]
        lines.append("  in process (same requests, from the engine submission): " + ", ".join(
            f"{k} {v['ttft_ms_mean']:.1f} ms" for k, v in inp.items()))
    elif benchy:
        lines.append(f"llama-benchy: {benchy.get('error')}")
    conc = load("concurrency")
    if conc and "checks" in conc:
        lines += ["", f"concurrency test: {'PASSED' if conc['passed'] else 'FAILED'} "
                      f"(long {conc['long']['completion_tokens']} tokens, {conc['long']['finish_reason']}; "
                      f"second sent at {conc['second_sent_at_s']:.2f} s, done at {conc['second_done_at_s']:.2f} s, "
                      f"long done at {conc['long_done_at_s']:.2f} s; second cached_tokens "
                      f"{conc['second']['cached_tokens']} of {conc['second']['prompt_tokens']} prompt tokens, "
                      f"system {conc['system_tokens']} tokens; TTFT restored {conc['second']['ttft_ms']:.1f} ms "
                      f"(render {conc['second'].get('render_ms') or float('nan'):.2f} ms), "
                      f"cold {conc['second_cold']['ttft_ms']:.1f} ms; restored text == cold text: "
                      f"{conc['second_text_equals_cold']})"]
        lines += [f"  {k}: {v}" for k, v in conc["checks"].items()]
    elif conc:
        lines += ["", f"concurrency test: {conc.get('error')}"]
    thr = load("throughput")
    if thr and "results" in thr:
        lines += ["", f"output tok/s ({thr['max_tokens']} tokens a request, prompt {thr['prompt_tokens']} "
                      f"tokens, {thr['rounds']} rounds)",
                  f"  {'path':<11} {'conc':>4} {'tok/s':>9} {'TTFT mean ms':>13} {'decode tok/s/req':>17}"]
        for r in thr["results"]:
            lines.append(f"  {r['path']:<11} {r['concurrency']:>4} {r['throughput_tok_s']:>9.1f} "
                         f"{r['ttft_ms_mean']:>13.2f} {r['decode_tok_s']:>17.1f}")
        for o in thr["overhead"]:
            lines.append(f"  concurrency {o['concurrency']:>2}: HTTP output tok/s = {100 / o['throughput_ratio']:.1f}% "
                         f"of in process; TTFT {o['ttft_ms_above']:+.2f} ms")
    elif thr:
        lines += ["", f"throughput: {thr.get('error')}"]
    comp = load("compare")
    if comp and "table" in comp:
        lines += ["", "shared-instructions, concurrency 1 (hybrid-serve-bench; TTFT p50 / p95 ms, render p50 ms "
                      "(HTTP: the replica's Server-Timing, inside TTFT; in process: before the engine "
                      "submission, outside TTFT), token hit rate)"]
        for name, row in comp["table"].items():
            hit, render = row["token_hit_rate"], row.get("render_p50_ms")
            lines.append(f"  {name:<62} {row['ttft_p50_ms'] or float('nan'):>8.1f} {row['ttft_p95_ms'] or float('nan'):>8.1f}"
                         f"  render {'-' if render is None else f'{render:.2f}'}"
                         f"  hit {'-' if hit is None else f'{hit:.0%}'}  errors {row['errors']}/{row['requests']}")
        for length in sorted({n.split('@')[-1] for n in comp["table"]}):
            def p50(label):
                return (comp["table"].get(f"{label} | shared-instructions@{length}") or {}).get("ttft_p50_ms")
            for path in ("http", "in-process"):
                a, b = p50(f"{path} [prompt, response]"), p50(f"{path} [prompt, response, instruction]")
                if a and b:
                    lines.append(f"  {length} instruction tokens, {path}: [prompt, response] / all three = {a / b:.1f}x")
    elif comp:
        lines += ["", f"compare: {comp.get('error')}"]
    lines += ["", f"timeline (s from the driver's start): {summary.get('timeline_s')}"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--tiny", action="store_true")
    c = sub.add_parser("bench-config")
    c.add_argument("--config", type=Path, required=True)
    c.add_argument("--model-dir", required=True)
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--cpu", action="store_true")
    r = sub.add_parser("run")
    r.add_argument("--config", type=Path, required=True, help="the bench config serve run got")
    r.add_argument("--base-url", default="http://127.0.0.1:8000")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--quick", action="store_true", help="CPU sizes (the tiny model)")
    r.add_argument("--parts", nargs="+", default=["benchy", "concurrency", "throughput", "compare"],
                   choices=["benchy", "concurrency", "throughput", "compare"])
    r.add_argument("--no-in-process-pr", action="store_true",
                   help="start no in-process [prompt, response] engine (the comparison then has "
                        "three targets; the driver is ready sooner)")
    r.add_argument("--deadline-s", type=float, default=480.0, help="from this process's start")
    r.add_argument("--ready-timeout-s", type=float, default=300.0)
    r.add_argument("--part-limit-s", type=json.loads,
                   default={"benchy": 60, "concurrency": 50, "throughput": 60, "compare": 90},
                   help="JSON {part: seconds}")
    rep = sub.add_parser("report", help="gpu_serve.txt from the gpu_serve_*.json of a folder")
    rep.add_argument("results", type=Path)
    args = p.parse_args()
    if args.cmd == "report":
        print(report(args.results))
    elif args.cmd == "model":
        write_model(args.out, args.tiny)
    elif args.cmd == "bench-config":
        import yaml

        args.out.write_text(yaml.safe_dump(bench_config(args.config, args.model_dir, args.cpu), sort_keys=False))
        log(f"wrote {args.out}")
    else:
        run(args)


if __name__ == "__main__":
    main()
