"""The result of a run, written under one folder: bench.json (RESULT_FIELDS: the command, the
servers' identities, the settings, the workloads, the summary rows and every request's record),
report.md (the table, the shared-instructions comparison, the plots, the definitions) and the
four PNG plots (plots.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from hybrid_serve_bench.plots import draw_all

RESULT_FIELDS = ("benchmark", "mode", "command", "machine", "targets", "settings", "token_counter",
                 "workloads", "summary", "records")
NOT_REPORTED = "not reported"
ALL_SLOTS = "[prompt, response, instruction]"
PROMPT_ONLY = "[prompt]"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _hit_rate(row: dict) -> str:
    if row["cached_tokens"] is None:
        return NOT_REPORTED
    if not row["shareable_tokens"]:
        return "n/a (nothing shareable)"
    return f"{100 * row['token_hit_rate']:.1f}%"


def summary_table(rows: list[dict]) -> str:
    """The Markdown table: one line per (target, workload, rate)."""
    target_ms = rows[0]["target_ttft_ms"] if rows else 0
    header = ["target", "workload", "rate/s", "requests (errors)", "TTFT p50 ms", "p95 ms", "p99 ms",
              "ITL p50 ms", "prompt tokens", "computed (prompt - cached)", "token hit rate",
              "output tok/s", f"req/s at TTFT <= {target_ms:g} ms"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r["target"], r["workload"], "closed loop" if r["rate"] is None else f"{r['rate']:g}",
                 f"{r['requests']} ({r['errors']})", _num(r["ttft_p50_ms"]), _num(r["ttft_p95_ms"]),
                 _num(r["ttft_p99_ms"]), _num(r["itl_p50_ms"]),
                 NOT_REPORTED if r["prompt_tokens"] is None else f"{r['prompt_tokens']:,}",
                 NOT_REPORTED if r["prompt_tokens_computed"] is None else f"{r['prompt_tokens_computed']:,}",
                 _hit_rate(r), _num(r["output_tok_s"]), _num(r["goodput_rps"], 2)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def shared_instructions_comparison(rows: list[dict]) -> list[str]:
    """Issue 24's acceptance figures, per shared-instructions workload and rate: the hit rate
    with all three slots and with [prompt] only, and their TTFT p50 ratio. Empty when the run
    has no such pair of targets (compare-policies names its targets by their slots)."""
    lines = []
    by = {(r["target"], r["workload"], r["rate"]): r for r in rows}
    for (target, workload, rate), full in by.items():
        prompt_only = by.get((PROMPT_ONLY, workload, rate))
        if target != ALL_SLOTS or not workload.startswith("shared-instructions") or prompt_only is None:
            continue
        ratio = (prompt_only["ttft_p50_ms"] / full["ttft_p50_ms"]
                 if prompt_only["ttft_p50_ms"] and full["ttft_p50_ms"] else None)
        lines.append(f"- {workload} ({'closed loop' if rate is None else f'rate {rate:g}/s'}): token hit "
                     f"rate {_hit_rate(full)} with all three slots, {_hit_rate(prompt_only)} with "
                     f"[prompt] only; TTFT p50 {_num(full['ttft_p50_ms'])} ms vs "
                     f"{_num(prompt_only['ttft_p50_ms'])} ms: [prompt] / all three = "
                     f"{_num(ratio, 2)}x")
    return lines


DEFINITIONS = """\
- TTFT: from sending the request to the first streamed chunk with non-empty content (a chunk
  carrying only the role does not count). ITL: (last content chunk - first) / (completion
  tokens - 1). Percentiles are nearest-rank.
- computed = prompt tokens - cached tokens, where cached tokens is the server's
  `usage.prompt_tokens_details.cached_tokens` (restored from a cache); "not reported" when the
  server sent none (it is not counted as 0).
- token hit rate = cached / shareable, at most 100% (a pass whose server reports more is
  refused). A request's shareable tokens are the longest prefix of its prompt token ids (the
  served model's tokenizer and chat template) that an earlier request of the same pass already
  sent (or sent and got a reply to): what a perfect prefix cache could restore. On
  shared-instructions that is the system prompt and the template tokens that open the next
  message, for every request but the first of each system prompt; on no-sharing only a few
  template tokens. See hybrid_serve_bench/accounting.py.
- req/s at TTFT <= target: requests that succeeded with TTFT at most the target, per second of
  the pass's wall time (goodput).
- With several targets the workload runs in rounds, each round against every target in
  turn (order rotated), so drift on a shared machine hits every target alike."""


def markdown(result: dict, plot_paths: dict[str, Path], out_dir: Path) -> str:
    rows = result["summary"]
    targets = "\n".join(
        f"- **{t['label']}**: {t['base_url']}, model `{t['model']}`"
        + (f", checkpoint_slots {t['checkpoint_slots']}" if t.get("checkpoint_slots") is not None else "")
        for t in result["targets"])
    settings = ", ".join(f"{k} {v}" for k, v in result["settings"].items())
    comparison = shared_instructions_comparison(rows)
    plots = "\n".join(f"![{name}]({path.relative_to(out_dir)})" for name, path in plot_paths.items())
    parts = [f"# hybrid-serve-bench: {result['mode']}", "", "```", result["command"], "```", "",
             f"Machine: {result['machine']}", "", "Targets:", targets, "",
             f"Settings: {settings}; tokens counted by {result['token_counter']}.", "",
             summary_table(rows), ""]
    if comparison:
        parts += ["Shared instructions, all three slots against [prompt] only:", *comparison, ""]
    parts += ["## Plots", "", plots, "", "## Definitions", "", DEFINITIONS, ""]
    return "\n".join(parts)


def write_report(result: dict, out_dir: Path, workload_lengths: dict[str, int]) -> dict[str, Path]:
    """Write bench.json, report.md and the plots under out_dir (created). `result` has exactly
    RESULT_FIELDS. workload_lengths: shared-instructions workload name -> instruction tokens.
    Returns {"json", "markdown", plot names...: path}."""
    if tuple(result) != RESULT_FIELDS:
        raise ValueError(f"result keys {list(result)} are not {list(RESULT_FIELDS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "bench.json"
    json_path.write_text(json.dumps(result, indent=1, default=str))
    plot_paths = draw_all(result["summary"], workload_lengths, out_dir)
    md_path = out_dir / "report.md"
    md_path.write_text(markdown(result, plot_paths, out_dir))
    return {"json": json_path, "markdown": md_path, **plot_paths}
