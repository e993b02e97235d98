"""Every `from <project module> import NAME` in the repository, at module level or inside a
function, names a module that exists and a name it defines (or a submodule). CPU runs never
execute the imports inside the CUDA paths and the device tests, so a moved or renamed name
there would otherwise first fail on a GPU."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("engine", "cache", "deployments", "hybrid_serve_bench", "tests")


def _module_file(root: Path, module: str) -> Path | None:
    path = root.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return path if path.is_dir() else None  # a namespace package: its names are its modules


def _defined_names(path: Path) -> set[str]:
    """Names a module binds anywhere in its body: definitions, assignments and imports."""
    names: set[str] = set()
    if path.is_dir():
        return names
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def unresolved_imports(root: Path, files: list[str]) -> list[str]:
    """'file:line: what is missing' for each project import that names nothing."""
    missing, cache = [], {}
    for name in files:
        tree = ast.parse((root / name).read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    and node.module.split(".")[0] in PROJECT):
                continue
            path = _module_file(root, node.module)
            if path is None:
                missing.append(f"{name}:{node.lineno}: no module {node.module}")
                continue
            defined = cache.setdefault(path, _defined_names(path))
            missing += [f"{name}:{node.lineno}: {node.module} has no {alias.name}" for alias in node.names
                        if alias.name not in defined and _module_file(root, f"{node.module}.{alias.name}") is None]
    return missing


def test_every_project_import_names_something_that_exists():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert len(files) > 100
    assert unresolved_imports(ROOT, files) == []


def test_a_moved_name_is_found(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "kept.py").write_text("def here():\n    pass\n")
    (tmp_path / "user.py").write_text(
        "def gpu_path():\n    from engine.kept import gone, here\n    from engine.moved import x\n")
    assert unresolved_imports(tmp_path, ["user.py"]) == [
        "user.py:2: engine.kept has no gone", "user.py:3: no module engine.moved"]
