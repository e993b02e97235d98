"""What the benchmark scripts share: where a result goes, the record it is written in (with the
command that produced it and the machine it ran on), and small formatting helpers.

The scripts run as `python benchmarks/<name>.py` from the repository root, so this folder is
on sys.path and they import this module as `harness`. It imports no torch:
tp_step_overhead.py sets OMP_NUM_THREADS before torch loads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def default_out(benchmark: str) -> Path:
    """results/<benchmark>.json: the latest result of each benchmark, under a stable name."""
    return RESULTS_DIR / f"{benchmark}.json"


def add_out_argument(parser: argparse.ArgumentParser, benchmark: str) -> None:
    """--out PATH, by default results/<benchmark>.json (smoke runs pass a path under /tmp so
    they do not replace the committed result)."""
    parser.add_argument("--out", type=Path, default=default_out(benchmark),
                        help=f"JSON path (default: {default_out(benchmark)})")


def command() -> str:
    """The command line that started this process, as a shell would take it."""
    return shlex.join([Path(sys.executable).name, *sys.argv])


def machine(**extra) -> dict:
    """The host: platform, CPU count, Python version, plus `extra` (torch version, threads)."""
    return {"platform": platform.platform(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), **extra}


def write_result(out: str | Path, benchmark: str, fields: dict, machine_extra: dict | None = None) -> Path:
    """Write {"benchmark", "command", "machine", **fields} as indented JSON to `out` (parent
    folders created; values JSON cannot encode are written as str). Returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": benchmark, "command": command(), "machine": machine(**(machine_extra or {})),
              **fields}
    out.write_text(json.dumps(record, indent=2, default=str))
    return out


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table: the header, a `---` rule, one line a row (cells already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def middle(values: Sequence[float]) -> float:
    """The value at index len // 2 of the sorted values: the median of an odd count, the upper
    of the two middle values of an even one (no averaging)."""
    return sorted(values)[len(values) // 2]


def process_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by every process of this host, summed by role:
    a Ray worker by its actor class ("ray::ServeReplica:app:OpenAIIngress", "ray::RankActor"),
    any other process by its program name ("raylet", "gcs_server", "python"). Linux only
    (reads /proc). Take two snapshots and subtract (cpu_seconds_between) to see where a run's
    CPU went."""
    ticks = os.sysconf("SC_CLK_TCK")

    def cpu_seconds(proc: Path) -> float:
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks

    return _sum_by_role(cpu_seconds)


def process_rss_bytes() -> dict[str, int]:
    """Resident memory of every process of this host, summed by role (as process_cpu_seconds
    names them). Linux only (reads /proc/<pid>/statm)."""
    page = os.sysconf("SC_PAGE_SIZE")
    return _sum_by_role(lambda proc: int((proc / "statm").read_text().split()[1]) * page)


def _sum_by_role(measure):
    """measure(/proc/<pid>) summed over this host's processes by role (_process_role); a
    process that ends meanwhile, or a kernel thread without the fields, is left out."""
    usage = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            program = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            value = measure(proc)
        except (OSError, IndexError, ValueError):
            continue
        role = _process_role(program)
        usage[role] = usage.get(role, 0) + value
    return usage


def cpu_seconds_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per role, the CPU seconds spent between two process_cpu_seconds snapshots (roles that
    used none are left out; a process that ended between them is not counted)."""
    spent = {role: after[role] - before.get(role, 0.0) for role in after}
    return {role: seconds for role, seconds in sorted(spent.items()) if seconds > 0}


def _process_role(program: str) -> str:
    if program.startswith("ray::"):  # "ray::RankActor.execute_in_order" while a task runs
        return program.split(".", 1)[0].split(" ", 1)[0]
    return Path(program.split(" ", 1)[0]).name or "?"

