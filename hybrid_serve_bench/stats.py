"""Pure summary math: percentiles and one summary row per pass (target, workload, rate).

Row fields (SUMMARY_FIELDS; None means "not reported" or "not defined", never 0):
  requests, errors          requests sent, and those that failed (not in the latencies)
  ttft_p50/p95/p99_ms       time to first content token, nearest-rank percentiles
  itl_p50_ms, e2e_p50_ms    inter-token latency and end-to-end time, medians
  render_p50_ms             the prompt's render time as the server reported it (records'
                            render_s; part of an HTTP TTFT, outside an in-process one), median;
                            None when no request reported it
  prompt_tokens             sum of usage.prompt_tokens (None if the server reported no usage)
  cached_tokens             sum of usage.prompt_tokens_details.cached_tokens: the tokens restored
                            (None when no request of the pass reported it)
  prompt_tokens_computed    prompt_tokens - cached_tokens (None when either is not reported)
  shareable_tokens          sum of each request's shareable tokens (accounting.py)
  token_hit_rate            cached_tokens / shareable_tokens (None when not reported, or
                            nothing was shareable); at most 1 by the definition of shareable,
                            and checked: a pass whose server restored more than was shareable
                            raises RestoredBeyondShareable rather than report a rate above 100%
  output_tok_s              completion tokens of the pass / its wall time
  requests_s                requests finished / wall time
  goodput_rps               requests/s at the target latency: successful requests with
                            TTFT <= target_ttft_ms, per second of the pass's wall time
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SUMMARY_FIELDS = ("target", "workload", "rate", "requests", "errors", "ttft_p50_ms", "ttft_p95_ms",
                  "ttft_p99_ms", "itl_p50_ms", "e2e_p50_ms", "render_p50_ms", "prompt_tokens", "cached_tokens",
                  "prompt_tokens_computed", "shareable_tokens", "token_hit_rate", "output_tok_s",
                  "requests_s", "goodput_rps", "target_ttft_ms", "wall_s")


class RestoredBeyondShareable(ValueError):
    """A pass's server reported more cached tokens than its prompts could share (accounting.py):
    the token counter is not the served model's tokenizer, or the server over-reports."""


def check_restored_within_shareable(target: str, workload: str, rate: float | None,
                                    records: list[dict], cached: int | None, shareable: int) -> None:
    """Raise RestoredBeyondShareable when `cached` > `shareable` (the pass's sums), naming the
    pass, both sums and how many requests' prompt token counts differ from the server's."""
    if cached is None or cached <= shareable:
        return
    differ = [r for r in records if r["prompt_tokens"] is not None
              and r.get("counted_prompt_tokens") not in (None, r["prompt_tokens"])]
    example = (f"; {len(differ)} of {len(records)} prompts count differently, e.g. the server "
               f"{differ[0]['prompt_tokens']} tokens, the bench's tokenizer "
               f"{differ[0]['counted_prompt_tokens']}: pass --tokenizer with the served model's "
               "directory" if differ else
               "; every prompt counts the same as the server's: it restored tokens no earlier "
               "request of the pass sent (a cache left by an earlier run without a cache salt?)")
    raise RestoredBeyondShareable(
        f"{target} / {workload} / rate {rate}: the server reported {cached:,} cached tokens but "
        f"only {shareable:,} of its prompt tokens were shareable{example}")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least q% of the values at or below
    it (q in (0, 100]); None for no values."""
    if not values:
        return None
    if not 0 < q <= 100:
        raise ValueError(f"q must be in (0, 100], got {q}")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def _sum_reported(values: list[int | None]) -> int | None:
    reported = [v for v in values if v is not None]
    return sum(reported) if reported else None


def summarize_pass(target: str, workload: str, rate: float | None, records: list[dict],
                   wall_s: float, target_ttft_ms: float) -> dict:
    """The summary row of one pass's records (all of the same target, workload and rate)."""
    ok = [r for r in records if r["error"] is None]
    ttfts = [r["ttft_s"] for r in ok]
    renders = [r["render_s"] for r in ok if r.get("render_s") is not None]
    prompt = _sum_reported([r["prompt_tokens"] for r in ok])
    cached = _sum_reported([r["cached_tokens"] for r in ok])
    shareable = sum(r["shareable_tokens"] or 0 for r in ok)
    completion = _sum_reported([r["completion_tokens"] for r in ok])
    check_restored_within_shareable(target, workload, rate, ok, cached, shareable)
    wall = wall_s if wall_s > 0 else float("nan")
    row = {
        "target": target, "workload": workload, "rate": rate,
        "requests": len(records), "errors": len(records) - len(ok),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)), "ttft_p95_ms": _ms(percentile(ttfts, 95)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "itl_p50_ms": _ms(percentile([r["itl_s"] for r in ok if r["itl_s"] is not None], 50)),
        "e2e_p50_ms": _ms(percentile([r["e2e_s"] for r in ok], 50)),
        "render_p50_ms": _ms(percentile(renders, 50)),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "prompt_tokens_computed": None if prompt is None or cached is None else prompt - cached,
        "shareable_tokens": shareable,
        "token_hit_rate": cached / shareable if cached is not None and shareable else None,
        "output_tok_s": None if completion is None else completion / wall,
        "requests_s": len(ok) / wall,
        "goodput_rps": sum(1 for t in ttfts if t * 1000 <= target_ttft_ms) / wall,
        "target_ttft_ms": target_ttft_ms, "wall_s": wall_s,
    }
    assert tuple(row) == SUMMARY_FIELDS
    return row


def summarize(records: list[dict], passes: list, target_ttft_ms: float) -> list[dict]:
    """One row per pass (runner.Pass: target, workload, rate, wall_s), in the passes' order."""
    return [summarize_pass(p.target, p.workload, p.rate,
                           [r for r in records if (r["target"], r["workload"], r["rate"])
                            == (p.target, p.workload, p.rate)],
                           p.wall_s, target_ttft_ms)
            for p in passes]
