"""The report's PNG plots, drawn from summary rows (stats.SUMMARY_FIELDS) with matplotlib's Agg
backend (no display). Every function writes its file and returns the path; a plot whose data
the run does not have (one instruction length, no Poisson rate) is still written, with a line
saying which flags produce it, so a report always has the same four files.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

PLOT_FILES = {"ttft_by_workload": "ttft_by_workload.png", "hit_rate": "hit_rate_by_policy.png",
              "ttft_vs_length": "ttft_vs_instruction_length.png", "ttft_vs_rate": "ttft_vs_rate.png"}


def _unique(values):
    return list(dict.fromkeys(values))


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _no_data(path: Path, title: str, hint: str) -> Path:
    fig, ax = plt.subplots(figsize=(6, 2.5))
    ax.set_axis_off()
    ax.set_title(title)
    ax.text(0.5, 0.5, f"no data in this run\n{hint}", ha="center", va="center")
    return _save(fig, path)


def _closed_loop(rows: list[dict]) -> list[dict]:
    """The rows of the closed-loop passes (rate None), or of the lowest rate when none is."""
    rates = _unique(r["rate"] for r in rows)
    keep = None if None in rates else min(rates)
    return [r for r in rows if r["rate"] == keep]


def _grouped_bars(ax, groups: list[str], series: list[str], value, label_missing: str) -> None:
    """Bars: one group per x label, one bar per series; value(group, series) -> (height, whisker
    top) or None (drawn as a `label_missing` note instead of a bar)."""
    width = 0.8 / max(1, len(series))
    for i, name in enumerate(series):
        for g, group in enumerate(groups):
            x = g - 0.4 + width * (i + 0.5)
            got = value(group, name)
            if got is None:
                ax.text(x, 0, label_missing, rotation=90, ha="center", va="bottom", fontsize=7)
                continue
            height, top = got
            ax.bar(x, height, width, color=f"C{i}")
            if top is not None and top > height:
                ax.plot([x, x], [height, top], color="black", linewidth=1)
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(len(series))]
    ax.legend(handles, series, fontsize=7, ncol=2, loc="upper center")


def ttft_by_workload(rows: list[dict], path: Path) -> Path:
    rows = _closed_loop(rows)
    workloads, targets = _unique(r["workload"] for r in rows), _unique(r["target"] for r in rows)
    by = {(r["workload"], r["target"]): r for r in rows}

    def value(workload, target):
        r = by.get((workload, target))
        return None if r is None or r["ttft_p50_ms"] is None else (r["ttft_p50_ms"], r["ttft_p95_ms"])

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(workloads)), 4))
    _grouped_bars(ax, workloads, targets, value, "failed")
    ax.set_ylabel("TTFT ms (bar p50, line to p95)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the legend
    ax.set_title("Time to first token by workload")
    return _save(fig, path)


def hit_rate_by_policy(rows: list[dict], path: Path) -> Path:
    rows = [r for r in _closed_loop(rows) if r["shareable_tokens"]]
    if not rows:
        return _no_data(path, "Token hit rate", "no workload with shareable tokens")
    workloads, targets = _unique(r["workload"] for r in rows), _unique(r["target"] for r in rows)
    by = {(r["workload"], r["target"]): r for r in rows}

    def value(workload, target):
        r = by.get((workload, target))
        return None if r is None or r["token_hit_rate"] is None else (100 * r["token_hit_rate"], None)

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(workloads)), 4))
    _grouped_bars(ax, workloads, targets, value, "not reported")
    ax.set_ylabel("restored / shareable tokens, %")
    ax.set_ylim(0, 135)  # room for the legend above 100%
    ax.set_title("Token hit rate by policy / server")
    return _save(fig, path)


def ttft_vs_instruction_length(rows: list[dict], lengths: dict[str, int], path: Path) -> Path:
    """lengths: workload name -> instruction tokens, for the shared-instructions workloads."""
    rows = [r for r in _closed_loop(rows) if r["workload"] in lengths and r["ttft_p50_ms"] is not None]
    if len({lengths[r["workload"]] for r in rows}) < 2:
        return _no_data(path, "TTFT against instruction length",
                        "give --instruction-tokens two or more lengths")
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, target in enumerate(_unique(r["target"] for r in rows)):
        points = sorted((lengths[r["workload"]], r["ttft_p50_ms"]) for r in rows if r["target"] == target)
        ax.plot(*zip(*points), marker="o", color=f"C{i}", label=target)
    ax.set_xlabel("instruction (system prompt) tokens")
    ax.set_ylabel("TTFT p50 ms")
    ax.set_title("TTFT against instruction length (shared-instructions)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def ttft_vs_rate(rows: list[dict], path: Path) -> Path:
    rows = [r for r in rows if r["rate"] is not None and r["ttft_p50_ms"] is not None]
    if len({r["rate"] for r in rows}) < 2:
        return _no_data(path, "TTFT against request rate", "give --rate two or more rates")
    workloads = _unique(r["workload"] for r in rows)
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 3.8), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for i, target in enumerate(_unique(r["target"] for r in rows)):
            points = sorted((r["rate"], r["ttft_p50_ms"]) for r in rows
                            if r["workload"] == workload and r["target"] == target)
            if points:
                ax.plot(*zip(*points), marker="o", color=f"C{i}", label=target)
        ax.set_title(workload, fontsize=9)
        ax.set_xlabel("conversations / s (Poisson)")
        ax.set_ylabel("TTFT p50 ms")
        ax.legend(fontsize=7)
    return _save(fig, path)


def draw_all(rows: list[dict], lengths: dict[str, int], out_dir: Path) -> dict[str, Path]:
    """All four plots under out_dir; returns {plot name: path}."""
    return {
        "ttft_by_workload": ttft_by_workload(rows, out_dir / PLOT_FILES["ttft_by_workload"]),
        "hit_rate": hit_rate_by_policy(rows, out_dir / PLOT_FILES["hit_rate"]),
        "ttft_vs_length": ttft_vs_instruction_length(rows, lengths, out_dir / PLOT_FILES["ttft_vs_length"]),
        "ttft_vs_rate": ttft_vs_rate(rows, out_dir / PLOT_FILES["ttft_vs_rate"]),
    }
