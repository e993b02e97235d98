"""The renderer's time per chat request, split by stage, and PromptRenderer.render_chat's time
with nothing remembered and with the instructions remembered.

    .venv/bin/python benchmarks/render_time.py                     # CPU only, about 30 s
    .venv/bin/python benchmarks/render_time.py --out /tmp/r.json

An HTTP client's time to first token includes this: the LLM server replica (lean path) or the
Renderer deployment (classic path) runs it for every chat request before the engine sees it.
For each instruction length L, hybrid-serve-bench's shared-instructions workload (2 systems
of L tokens, user messages of 50-500 tokens; the embedded model's tokenizer and template) is
rendered request by request, and per request:

  stages, each done from scratch as a renderer without memory does it:
    template      the chat through the chat template with the generation prompt, to text
    tokenize      that text tokenized (encode_text: apply_chat_template's own call)
    boundary      the instructions rendered alone and tokenized (the instruction boundary's
                  verification, deployments/prompts/instruction_boundary.py)
    breakpoint    the same for a cache_control marker on the system message (its head is the
                  instructions again: cache_breakpoints.py renders it as its own)
  render_chat:
    cold          a renderer that remembers nothing (every stage above, the marker aside)
    warm          one renderer for the workload: a request whose instructions were seen
                  starts from their remembered ids and tokenizes only the rest, where the
                  exact-cut rule allows it (deployments/prompts/exact_cuts.py)
    warm marked   the same with the marker on the system message

And whether tokenizing holds the GIL (what LocalPrompts' render threads rely on): while
another thread tokenizes about 34,000 tokens (encode_text), this thread spins, and its longest
pause is compared with the encode's time (about the same if the GIL were held throughout, as
it is by the Rust tokenizer's single-text `encode`, the control; encode_text goes through
transformers to its `encode_batch`, which releases it).

Every render_chat result is checked against apply_chat_template(tokenize=True). Medians over
the requests, the first request of each system left out of the warm columns (it fills the
memory), interleaved per request so every column sees the same machine. Also: the warm
renderer's counts (chats that started from a remembered prefix, tokens reused).
Prints a table and writes JSON (--out, default benchmarks/results/render_time.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from transformers import AutoTokenizer  # noqa: E402

from deployments.prompts.exact_cuts import CutRule, encode_text  # noqa: E402
from deployments.prompts.instruction_boundary import render_alone  # noqa: E402
from deployments.prompts.rendering import PromptRenderer  # noqa: E402
from engine.engine_config import DEFAULT_MODEL_DIR  # noqa: E402
from harness import add_out_argument, markdown_table, write_result  # noqa: E402
from hybrid_serve_bench.tokens import TokenizerCounter  # noqa: E402
from hybrid_serve_bench.workloads import CACHE_CONTROL, Sizes, shared_instructions  # noqa: E402

LENGTHS = (500, 2000, 8000, 16000)
SYSTEMS = 2
COLUMNS = ("template", "tokenize", "boundary", "breakpoint", "cold", "warm", "warm_marked")


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def measure(tokenizer, rule: CutRule, counter: TokenizerCounter, length: int, requests: int) -> dict:
    workload = shared_instructions(Sizes(instruction_tokens=length, requests=requests, systems=SYSTEMS), counter)
    warm, warm_marked = PromptRenderer(tokenizer, cuts=rule), PromptRenderer(tokenizer, cuts=rule)
    seconds: dict[str, list[float]] = {column: [] for column in COLUMNS}
    prompt_tokens = []
    for index, conversation in enumerate(workload.conversations):
        messages = [dict(m) for m in conversation.turns[0].new_messages]
        marked = [{**messages[0], "cache_control": CACHE_CONTROL}, *messages[1:]]
        text, t = timed(lambda: tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        seconds["template"].append(t)
        want, t = timed(lambda: encode_text(tokenizer, text))
        seconds["tokenize"].append(t)
        prompt_tokens.append(len(want))
        _, t = timed(lambda: encode_text(tokenizer, render_alone(tokenizer, messages[:1])))
        seconds["boundary"].append(t)
        _, t = timed(lambda: encode_text(tokenizer, render_alone(tokenizer, marked[:1])))
        seconds["breakpoint"].append(t)
        cold = PromptRenderer(tokenizer, cuts=rule)
        results = {}
        for column, renderer, chat in (("cold", cold, messages), ("warm", warm, messages),
                                       ("warm_marked", warm_marked, marked)):
            results[column], t = timed(lambda: renderer.render_chat(chat))
            if column == "cold" or index >= SYSTEMS:
                seconds[column].append(t)
        reference = tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
        for column, got in results.items():
            assert got.token_ids == reference == want, f"{column}: ids differ from apply_chat_template"
            assert got.instruction_boundary == results["cold"].instruction_boundary is not None, column
        assert results["warm_marked"].cache_breakpoints == (results["cold"].instruction_boundary,)
    row = {"instruction_tokens": length, "requests": requests, "prompt_tokens_p50": statistics.median(prompt_tokens)}
    row.update({f"{column}_ms": 1e3 * statistics.median(values) for column, values in seconds.items()})
    row["warm_reuses"] = warm.stats.reuses
    row["warm_chats"] = warm.stats.chats
    row["warm_reused_tokens"] = warm.stats.reused_tokens
    row["warm_tokenized_tokens"] = warm.stats.tokenized_tokens
    row["cold_over_warm"] = row["cold_ms"] / row["warm_ms"]
    return row


def longest_pause(work) -> tuple[float, float]:
    """(seconds work() took in another thread, the longest pause of this thread's Python loop
    meanwhile). A GIL held through the work pauses this thread for about all of it."""
    done, took = threading.Event(), []

    def run() -> None:
        started = time.perf_counter()
        work()
        took.append(time.perf_counter() - started)
        done.set()

    thread = threading.Thread(target=run)
    last, longest = time.perf_counter(), 0.0
    thread.start()
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    thread.join()
    return took[0], longest


def gil_check(tokenizer, repeats: int = 5) -> dict:
    """encode_text of a text of about 34,000 tokens in a thread, `repeats` times: the smallest
    ratio of this thread's longest pause to the encode's time (the smallest, so that the
    machine's own scheduling pauses do not count); about 1 if the GIL were held throughout."""
    text = "The policy says refunds are always reviewed before shipping, unless asked. " * 1000
    runs = [longest_pause(lambda: encode_text(tokenizer, text)) for _ in range(repeats)]
    # the control: the Rust tokenizer's single-text encode, which keeps the GIL
    held = [longest_pause(lambda: tokenizer.backend_tokenizer.encode(text, add_special_tokens=False))
            for _ in range(repeats)]
    return {"tokens": len(encode_text(tokenizer, text)), "encode_ms": [1e3 * t for t, _ in runs],
            "longest_pause_ms": [1e3 * p for _, p in runs],
            "min_pause_over_encode": min(p / t for t, p in runs),
            "control_backend_encode_min_pause_over_encode": min(p / t for t, p in held)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    add_out_argument(parser, "render_time")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    rule = CutRule.of(tokenizer)
    assert rule.enabled, rule.reason
    counter = TokenizerCounter(str(DEFAULT_MODEL_DIR))
    rows = [measure(tokenizer, rule, counter, length, args.requests) for length in LENGTHS]
    print(markdown_table(
        ["instruction tokens", "template ms", "tokenize ms", "boundary ms", "breakpoint ms",
         "render_chat cold ms", "warm ms", "warm marked ms", "cold / warm", "warm reuses"],
        [[str(r["instruction_tokens"]), *(f"{r[f'{c}_ms']:.3f}" for c in COLUMNS),
          f"{r['cold_over_warm']:.1f}", f"{r['warm_reuses']}/{r['warm_chats']}"] for r in rows]))
    gil = gil_check(tokenizer)
    print(f"tokenizing {gil['tokens']} tokens in a thread: this thread's longest pause / the encode's time, "
          f"at least {gil['min_pause_over_encode']:.2f} with encode_text, "
          f"{gil['control_backend_encode_min_pause_over_encode']:.2f} with the Rust tokenizer's own "
          "encode (which keeps the GIL)")
    write_result(args.out, "render_time", {"tokenizer": str(DEFAULT_MODEL_DIR), "exact_cuts": rule.enabled,
                                           "rows": rows, "gil": gil})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
