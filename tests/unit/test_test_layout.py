"""The test tree has no `__init__.py` outside tests/gpu, so pytest imports each test file by its
basename (rootdir-relative "prepend" import mode): two test files with one basename in different
folders make collection fail with "import file mismatch" on a clean clone. This keeps every
basename unique and names the clashing files when one is not."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_basename_is_unique():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if "__pycache__" not in path.parts:
            by_name[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"test files sharing a basename (rename one): {clashes}"
