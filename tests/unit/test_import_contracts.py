"""The import contracts of pyproject.toml ([tool.importlinter]): the tree as it is keeps them,
and a copy of it with one bad import added breaks the contract that forbids it, naming the
import. `make test` runs these with the rest of the suite."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hybrid_serve_bench", "deployments", "engine", "cache")
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT), "--config", str(tree / "pyproject.toml"), "--no-cache"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def _copy_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the packages and pyproject.toml with `line` appended to `module` (a path)."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / module, "a") as f:
        f.write("\n" + line + "\n")
    return tmp_path


def test_the_tree_keeps_every_contract():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, line, contract, named",
    [
        # a cycle: the boundary types would import the step loop that imports them
        ("engine/interfaces/request.py", "from engine.core import scheduler",
         "No import cycles", "engine.interfaces.request -> engine.core.scheduler"),
        # the kernel layer reaching up into speculation
        ("engine/kernels/gpu/batch_plan.py", "from engine.speculative import verify_gpu",
         "Kernels import nothing from speculation", "engine.kernels.gpu.batch_plan -> engine.speculative.verify_gpu"),
        ("cache/block_pool.py", "import torch", "no torch", "cache.block_pool -> torch"),
        ("engine/core/scheduler.py", "import ray", "The engine imports no Ray", "engine.core.scheduler -> ray"),
        ("deployments/http/errors.py", "from deployments import llm_server",
         "Serve layer", "deployments.http.errors -> deployments.llm_server"),
        # rendering raising the API's error type again: that module imports Ray and FastAPI
        ("deployments/prompts/rendering.py", "from deployments.http.errors import APIError",
         "Prompt rendering imports no Ray", "deployments.prompts.rendering -> deployments.http.errors"),
    ],
)
def test_a_bad_import_breaks_its_contract(tmp_path, module, line, contract, named):
    result = _lint(_copy_with(tmp_path, module, line))
    assert result.returncode == 1, result.stdout + result.stderr
    broken = result.stdout.split("Broken contracts", 1)[1]
    assert contract in broken and named in broken, result.stdout
