"""Every repository path the documentation names exists, and every relative link resolves (its
file, and its #anchor to a heading there): README.md, docs/*.md, benchmarks/README.md and the
notes beside the benchmark results. A path is a word that starts with one of the
repository's top-level directories (engine/..., tests/..., benchmarks/...), or, in a file under
benchmarks/, with results/ or roofline/ (read relative to benchmarks/); `path::test` names a file.
Placeholders (<name>, *, {a,b}) are not checked."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOP_LEVEL = ("engine", "deployments", "cache", "tests", "benchmarks", "hybrid_serve_bench",
             "scripts", "k8s", "models", "dashboards", "docs")
PATH = re.compile(r"(?<![\w./:-])((?:%s|results|roofline)/[\w./-]*)" % "|".join(TOP_LEVEL))
PLACEHOLDER = re.compile(r"[<>*{}]")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def documents() -> list[Path]:
    docs = [REPO / "README.md", REPO / "benchmarks" / "README.md",
            REPO / "benchmarks" / "gpu_roofline_notes.md"]
    docs += sorted((REPO / "docs").glob("*.md"))
    docs += sorted((REPO / "benchmarks" / "results").rglob("*.md"))
    return [doc for doc in docs if doc.exists()]


def named_paths(text: str) -> set[str]:
    """The repository paths a document's text names (placeholders left out)."""
    found = set()
    for match in PATH.finditer(text):
        start, end = match.span(1)
        if end < len(text) and PLACEHOLDER.match(text[end]):
            continue  # e.g. results/<name>.json, gpu-*/
        path = match.group(1).rstrip(".-")
        if path.count("/") == 0 or PLACEHOLDER.search(path):
            continue
        found.add(path)
    return found


def missing_paths(doc: Path, text: str) -> list[str]:
    """The paths `text` names that exist neither from the repository root nor from `doc`'s folder
    (a bare results/ or roofline/ path only from benchmarks/)."""
    missing = []
    for path in sorted(named_paths(text)):
        bases = [REPO, doc.parent]
        if path.startswith(("results/", "roofline/")):
            bases = [REPO / "benchmarks"]
        if not any((base / path).exists() for base in bases):
            missing.append(path)
    return missing


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for a markdown text's headings: lower case, punctuation dropped, spaces
    to hyphens."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", text, re.M)}


def broken_links(doc: Path, text: str) -> list[str]:
    """The relative links of `text` whose file does not exist (from `doc`'s folder) or whose
    #anchor names no heading of that file."""
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text()):
            broken.append(target)
    return broken


def test_every_path_a_document_names_exists():
    problems = {str(doc.relative_to(REPO)): missing
                for doc in documents() if (missing := missing_paths(doc, doc.read_text()))}
    assert not problems, f"documents name paths that do not exist: {problems}"


def test_every_relative_link_resolves():
    problems = {str(doc.relative_to(REPO)): broken
                for doc in documents() if (broken := broken_links(doc, doc.read_text()))}
    assert not problems, f"documents link to missing files or headings: {problems}"


def test_the_check_finds_a_missing_path():
    text = ("The worker (`engine/execution/worker.py`) and `engine/no_such_module.py`; "
            "see tests/unit/test_doc_paths.py::test_the_check_finds_a_missing_path and "
            "[the index](benchmarks/README.md); results/<name>.json is a placeholder.")
    assert named_paths(text) == {"engine/execution/worker.py", "engine/no_such_module.py",
                                 "tests/unit/test_doc_paths.py", "benchmarks/README.md"}
    assert missing_paths(REPO / "README.md", text) == ["engine/no_such_module.py"]


def test_the_check_finds_a_broken_link():
    text = ("[design](docs/design.md#8-layout), [gone](docs/gone.md), "
            "[no heading](docs/design.md#no-such-heading), [web](https://example.com/x#y)")
    assert broken_links(REPO / "README.md", text) == ["docs/gone.md", "docs/design.md#no-such-heading"]
