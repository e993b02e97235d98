"""The renderer's time per chat request (chat template, tokenization, verified instruction
boundary), with and without the instruction renderings it remembers (RenderedPrefixes).

    .venv/bin/python benchmarks/render_time.py                     # CPU only, about 20 s
    .venv/bin/python benchmarks/render_time.py --out /tmp/r.json

An HTTP client's time to first token includes this: deployments/renderer.py runs it for every
chat request before the engine sees the request. For each instruction length L, the
shared-instructions workload of hybrid-serve-bench (its systems and user messages, the
embedded model's tokenizer and template) is rendered request by request with
deployments.prompts.rendering.PromptRenderer.render_chat, once with one renderer for the
workload (the first request of each system renders its instructions, the others take them
from its RenderedPrefixes) and once with a new renderer per request (nothing remembered);
both give the same ids and boundaries (checked). Medians over the requests, interleaved per request so both
columns see the same machine.
Prints a table and writes JSON (--out, default benchmarks/results/render_time.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from transformers import AutoTokenizer  # noqa: E402

from deployments.prompts.rendering import PromptRenderer  # noqa: E402
from engine.engine_config import DEFAULT_MODEL_DIR  # noqa: E402
from harness import add_out_argument, markdown_table, write_result  # noqa: E402
from hybrid_serve_bench.tokens import TokenizerCounter  # noqa: E402
from hybrid_serve_bench.workloads import Sizes, shared_instructions  # noqa: E402

LENGTHS = (500, 2000, 8000, 16000)


def measure(tokenizer, counter: TokenizerCounter, length: int, requests: int) -> dict:
    workload = shared_instructions(Sizes(instruction_tokens=length, requests=requests, systems=2), counter)
    renderer = PromptRenderer(tokenizer)
    plain, remembered = [], []
    for conversation in workload.conversations:
        messages = [dict(m) for m in conversation.turns[0].new_messages]
        started = time.perf_counter()
        want = PromptRenderer(tokenizer).render_chat(messages)
        plain.append(time.perf_counter() - started)
        started = time.perf_counter()
        got = renderer.render_chat(messages)
        remembered.append(time.perf_counter() - started)
        assert got == want and got.instruction_boundary is not None, "the remembered rendering differs"
    plain_ms, remembered_ms = 1e3 * statistics.median(plain), 1e3 * statistics.median(remembered)
    return {"instruction_tokens": length, "requests": requests, "render_ms": plain_ms,
            "render_remembered_ms": remembered_ms, "ratio": plain_ms / remembered_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    add_out_argument(parser, "render_time")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    counter = TokenizerCounter(str(DEFAULT_MODEL_DIR))
    rows = [measure(tokenizer, counter, length, args.requests) for length in LENGTHS]
    print(markdown_table(
        ["instruction tokens", "render ms", "render ms, instructions remembered", "ratio"],
        [[str(r["instruction_tokens"]), f"{r['render_ms']:.2f}", f"{r['render_remembered_ms']:.2f}",
          f"{r['ratio']:.2f}"] for r in rows]))
    write_result(args.out, "render_time", {"tokenizer": str(DEFAULT_MODEL_DIR), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
