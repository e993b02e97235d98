"""The n-gram drafter's cost on the scheduler's thread (engine/speculative/ngram.py): one
proposal of k = 4 drafts per speculating request and step, NgramDrafter.propose (visiting the
earlier occurrences of the last token only) against propose_reference (the scan over every
start position it replaced), at contexts of 256 to 8,192 tokens, on three kinds of context:

  * random: token ids drawn from 50,000, so the last 3 or 2 tokens almost never occurred
    before and the scan runs through the whole context for each n;
  * common last token: the same, with one token every 10 positions (a full stop, say) and the
    context ending in it, so the search visits L / 10 occurrences for each n;
  * repeating: a 64-token span repeated to the length, so the 3-gram matches at once.

Each time is the median over --repeats calls (microseconds); the table also gives the batch-16
cost per step (16 requests) and the ratio. Prints a table and writes JSON.

    python benchmarks/ngram_lookup.py            # writes results/ngram_lookup.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from engine.speculative.ngram import NgramDrafter, propose_reference  # noqa: E402
from harness import add_out_argument, markdown_table, write_result  # noqa: E402

LENGTHS = (256, 1024, 2048, 8192)
K = 4
BATCH = 16


def contexts(length: int) -> dict[str, tuple[int, ...]]:
    rng = random.Random(length)
    span = [rng.randrange(100, 50_000) for _ in range(64)]
    random_tokens = [rng.randrange(100, 50_000) for _ in range(length)]
    common = [7 if i % 10 == 9 else t for i, t in enumerate(random_tokens)]
    common[-1] = 7
    return {"random": tuple(random_tokens), "common last token": tuple(common),
            "repeating": tuple((span * (length // 64 + 1))[:length])}


def median_us(call, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return 1e6 * statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(parser, "ngram_lookup")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    drafter = NgramDrafter()
    rows = []
    for length in LENGTHS:
        for kind, tokens in contexts(length).items():
            drafts = drafter.propose(tokens, K)
            assert drafts == propose_reference(drafter, tokens, K), (kind, length)
            search = median_us(lambda: drafter.propose(tokens, K), args.repeats)
            scan = median_us(lambda: propose_reference(drafter, tokens, K), args.repeats)
            rows.append({"context": kind, "tokens": length, "drafts": len(drafts), "search_us": search,
                         "scan_us": scan, "scan_over_search": scan / search})
    print(markdown_table(
        ["context", "tokens", "drafts", "search µs", "scan µs", f"batch {BATCH}: search ms / step",
         f"batch {BATCH}: scan ms / step", "scan / search"],
        [[r["context"], str(r["tokens"]), str(r["drafts"]), f"{r['search_us']:.1f}", f"{r['scan_us']:.1f}",
          f"{BATCH * r['search_us'] / 1e3:.3f}", f"{BATCH * r['scan_us'] / 1e3:.3f}",
          f"{r['scan_over_search']:.1f}"] for r in rows]))
    path = write_result(args.out, "ngram_lookup", {"k": K, "batch": BATCH, "repeats": args.repeats, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
