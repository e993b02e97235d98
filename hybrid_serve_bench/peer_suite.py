"""What `compare-servers --launch` measures on each server, and its table.

The passes, run against one server after the other (each started for them and stopped after
them), every one closed-loop, streaming, with ignore_eos and its own cache salt:

  decode-c{N}           N concurrent streams of decode_tokens (128) tokens, short distinct
                        prompts (a no-sharing workload of decode_prompt_tokens): output tok/s
                        and time between tokens, for each N of decode_concurrency (1 and 16);
  shared-instructions   S system prompts of L tokens, distinct user messages (workloads.py);
  multi-turn            C conversations of T turns resending the history;
  cold                  the no-sharing workload: each request its own L-token system prompt.
The last three run at `concurrency` with `max_tokens` per request.

Before the passes each server gets a warm-up: a few requests that no pass repeats (under their
own salt), then one burst at the highest decode concurrency, so that lazy compilation and
first-request costs stay out of the figures.

The table (peer_row), one row per server. Times to first token are taken at the first chunk
of the stream, which both hybrid-serve and vLLM send with the first generated token (its role
chunk), not at the first non-empty text as the per-pass rows of stats.py do: with a random-weight
model vLLM withholds text that ends inside a UTF-8 sequence, at times until the end of the
stream, so text timings there measure the detokenizer, not the server.
  output_tok_s_cN                  completion tokens / wall time of decode-cN
  tbt_p50_ms_cN                    time between tokens: median over the pass's streams of
                                   (end of stream - first chunk) / (completion tokens - 1), streams
                                   delivered in one burst left out (they carry no such time)
  ttft_p50_ms_shared_later         TTFT p50 of the shared-instructions requests whose system
                                   prompt an earlier request sent (shareable tokens above half
                                   of L): what restoring instructions buys
  ttft_p50_ms_multi_turn_later     TTFT p50 of turns after the first
  ttft_p50_ms_cold                 TTFT p50 of the cold pass
  instruction_hit_rate             cached / shareable tokens of the shared-instructions pass
                                   (stats.py); None where the server reports no cached tokens
  burst_streams                    streams of the decode passes whose first chunk came in the
                                   last tenth of the stream's time: the server (or a starved
                                   process of it) delivered them at once
  errors                           failed requests over every pass
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import httpx

from hybrid_serve_bench.client import ChatRequest, stream_chat
from hybrid_serve_bench.runner import Pass, RunSettings, Target, run_workloads, salted
from hybrid_serve_bench.stats import percentile
from hybrid_serve_bench.tokens import TokenCounter
from hybrid_serve_bench.workloads import Sizes, Workload, multi_turn, no_sharing, shared_instructions

SHARED = "shared-instructions"
MULTI_TURN = "multi-turn"
COLD = "cold"


def decode_name(concurrency: int) -> str:
    return f"decode-c{concurrency}"


@dataclass(frozen=True)
class SuiteSizes:
    """The suite's knobs. sizes: the workload sizes (seed, systems, instruction_tokens,
    requests, user_tokens, conversations, turns) of the three TTFT passes."""

    sizes: Sizes
    concurrency: int = 4
    max_tokens: int = 16
    decode_concurrency: tuple[int, ...] = (1, 16)
    decode_tokens: int = 128
    decode_prompt_tokens: int = 32
    cold_requests: int = 12

    def __post_init__(self) -> None:
        if not self.decode_concurrency or min(self.decode_concurrency) < 1:
            raise ValueError(f"decode_concurrency must be positive integers, got {self.decode_concurrency}")
        if min(self.concurrency, self.max_tokens, self.decode_tokens, self.cold_requests) < 1:
            raise ValueError("concurrency, max_tokens, decode_tokens and cold_requests must be at least 1")

    def decode_streams(self, concurrency: int) -> int:
        """Streams of a decode pass: three waves of `concurrency`, at least 8."""
        return max(8, 3 * concurrency)


@dataclass(frozen=True)
class SuitePass:
    name: str
    workload: Workload
    concurrency: int
    max_tokens: int


def _renamed(workload: Workload, name: str) -> Workload:
    conversations = tuple(dataclasses.replace(c, key=c.key.replace(workload.name, name, 1))
                          for c in workload.conversations)
    return dataclasses.replace(workload, name=name, conversations=conversations)


def build_suite(suite: SuiteSizes, counter: TokenCounter) -> list[SuitePass]:
    """The passes, in the order they run (module doc)."""
    passes = []
    for c in suite.decode_concurrency:
        short = dataclasses.replace(suite.sizes, instruction_tokens=suite.decode_prompt_tokens,
                                    user_tokens=(16, 32), requests=suite.decode_streams(c),
                                    seed=suite.sizes.seed + c)
        passes.append(SuitePass(decode_name(c), _renamed(no_sharing(short, counter), decode_name(c)),
                                c, suite.decode_tokens))
    cold = dataclasses.replace(suite.sizes, requests=suite.cold_requests)
    for workload in (shared_instructions(suite.sizes, counter), multi_turn(suite.sizes, counter),
                     _renamed(no_sharing(cold, counter), COLD)):
        passes.append(SuitePass(workload.name, workload, suite.concurrency, suite.max_tokens))
    return passes


def warm_up_prompts(suite: SuiteSizes, counter: TokenCounter) -> list[list[dict]]:
    """Prompts no pass sends (another seed): two of the TTFT passes' length, one short."""
    other = dataclasses.replace(suite.sizes, seed=suite.sizes.seed + 10_000, requests=2)
    short = dataclasses.replace(other, instruction_tokens=suite.decode_prompt_tokens, user_tokens=(16, 32),
                                requests=1)
    return [list(c.turns[0].new_messages)
            for w in (no_sharing(other, counter), no_sharing(short, counter)) for c in w.conversations]


async def warm_up(target: Target, suite: SuiteSizes, counter: TokenCounter, salt: str | None,
                  timeout_s: float) -> list[str]:
    """The warm-up (module doc); returns the errors of its requests (empty when all succeeded)."""
    extra = {"ignore_eos": True, **({"cache_salt": salted(salt, "warm-up")} if salt else {})}
    prompts = warm_up_prompts(suite, counter)
    burst = max(suite.decode_concurrency)
    errors = []
    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=burst + 4)) as client:
        for messages in prompts:
            result = await stream_chat(client, target.chat_url, ChatRequest(target.model, messages, 8,
                                                                            extra_body=extra))
            errors += [result.error] if result.error else []
        results = await asyncio.gather(*(
            stream_chat(client, target.chat_url, ChatRequest(target.model, prompts[-1], 16, extra_body=extra))
            for _ in range(burst)))
    return errors + [r.error for r in results if r.error]


async def run_suite(target: Target, passes: list[SuitePass], counter: TokenCounter, *, seed: int,
                    timeout_s: float, salt: str | None,
                    on_request=lambda: None) -> tuple[list[dict], list[Pass]]:
    """Every pass against `target`, one after the other. Returns (records, passes)."""
    records: list[dict] = []
    summaries: list[Pass] = []
    for p in passes:
        settings = RunSettings(concurrency=p.concurrency, max_tokens=p.max_tokens, rounds=1,
                               timeout_s=timeout_s, seed=seed, ignore_eos=True, cache_salt=salt)
        got, done = await run_workloads([target], [p.workload], [None], settings, counter, on_request)
        records += got
        summaries += done
    return records, summaries


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def _ok(records: list[dict]) -> list[dict]:
    return [r for r in records if r["error"] is None and r["first_chunk_s"] is not None]


def _ttft_p50_ms(records: list[dict]) -> float | None:
    return _ms(percentile([r["first_chunk_s"] for r in _ok(records)], 50))


BURST_TAIL = 0.1  # a stream whose first chunk came in this last share of its time is a burst


def _streams(records: list[dict]) -> list[dict]:
    return [r for r in _ok(records) if (r["completion_tokens"] or 0) > 1]


def _burst(record: dict) -> bool:
    return record["e2e_s"] - record["first_chunk_s"] < BURST_TAIL * record["e2e_s"]


def _tbt_p50_ms(records: list[dict]) -> float | None:
    return _ms(percentile([(r["e2e_s"] - r["first_chunk_s"]) / (r["completion_tokens"] - 1)
                           for r in _streams(records) if not _burst(r)], 50))


def peer_row(server: str, prefix_reuse: str, rows: list[dict], records: list[dict],
             suite: SuiteSizes) -> dict:
    """The table's row of one server (module doc) from its summary rows and records."""
    by_pass = {r["workload"]: r for r in rows if r["target"] == server}
    mine = [r for r in records if r["target"] == server]
    row: dict = {"server": server, "prefix_reuse": prefix_reuse}
    for c in suite.decode_concurrency:
        row[f"output_tok_s_c{c}"] = by_pass.get(decode_name(c), {}).get("output_tok_s")
        row[f"tbt_p50_ms_c{c}"] = _tbt_p50_ms([r for r in mine if r["workload"] == decode_name(c)])
    half = suite.sizes.instruction_tokens / 2
    row["ttft_p50_ms_shared_later"] = _ttft_p50_ms([r for r in mine if r["workload"] == SHARED
                                                    and (r["shareable_tokens"] or 0) > half])
    row["ttft_p50_ms_multi_turn_later"] = _ttft_p50_ms([r for r in mine if r["workload"] == MULTI_TURN
                                                        and r["turn"] >= 1])
    row["ttft_p50_ms_cold"] = _ttft_p50_ms([r for r in mine if r["workload"] == COLD])
    row["instruction_hit_rate"] = by_pass.get(SHARED, {}).get("token_hit_rate")
    decoding = [r for r in mine if r["workload"] in {decode_name(c) for c in suite.decode_concurrency}]
    row["burst_streams"] = sum(1 for r in _streams(decoding) if _burst(r))
    row["requests"] = len(mine)
    row["errors"] = sum(1 for r in mine if r["error"] is not None)
    return row


def _cell(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def peer_table(table: list[dict], suite: SuiteSizes) -> str:
    """The Markdown table of peer_row rows; a hit rate the server did not report reads
    "not reported"."""
    header = ["server", "reuse"]
    for c in suite.decode_concurrency:
        header += [f"output tok/s c={c}", f"between tokens p50 ms c={c}"]
    header += ["TTFT p50 ms shared (later)", "TTFT p50 ms multi-turn (later)", "TTFT p50 ms cold",
               "instruction tokens restored", "streams in one burst", "requests (errors)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in table:
        cells = [row["server"], row["prefix_reuse"]]
        for c in suite.decode_concurrency:
            cells += [_cell(row[f"output_tok_s_c{c}"]), _cell(row[f"tbt_p50_ms_c{c}"])]
        rate = row["instruction_hit_rate"]
        cells += [_cell(row["ttft_p50_ms_shared_later"]), _cell(row["ttft_p50_ms_multi_turn_later"]),
                  _cell(row["ttft_p50_ms_cold"]), "not reported" if rate is None else f"{100 * rate:.1f}%",
                  str(row["burst_streams"]), f"{row['requests']} ({row['errors']})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
