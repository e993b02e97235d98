"""benchmarks/spec_decode.py's link to the speculation policy: the step-cost rows it measures
become a table entry (policy_entry, write_policy_table) that engine/speculative/policy.py reads
back for the same model and decides from; and its exactness check counts a divergence as a
near-tie only within the bf16 bound."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.models.registry import load_model_config
from engine.speculative.policy import choose, load_step_costs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from spec_decode import first_divergence, policy_entry, write_policy_table  # noqa: E402


def _row(drafter, batch, verify_ms, decode_ms):
    return {"kind": "step_cost", "drafter": drafter, "batch": batch, "k": 3, "context": 1024,
            "verify_graph_ms": verify_ms, "decode_graph_ms": decode_ms}


def test_the_measured_rows_become_the_entry_the_policy_decides_from(tmp_path):
    rows = [_row("ngram", 1, 1.4, 1.0), _row("ngram", 16, 3.6, 2.0), _row("ngram", 64, 16.0, 4.0),
            _row("mtp", 1, 1.6, 1.9), _row("mtp", 16, 3.9, 3.1), _row("mtp", 64, 17.0, 5.0)]
    entry = policy_entry(DEFAULT_MODEL_DIR, "float32", "test GPU", rows, [0.9, 0.8, 0.7])
    assert entry["decode_ms"] == {"1": 1.0, "16": 2.0, "64": 4.0}
    assert entry["verify_ms"] == {"3": {"1": 1.4, "16": 3.6, "64": 16.0}}
    # drafting's cost: the MTP verification row over the n-gram one (its decode rows run the head too)
    assert entry["draft_ms"]["mtp"]["3"] == pytest.approx({"1": 0.2, "16": 0.3, "64": 1.0})
    table = tmp_path / "step_costs.json"
    write_policy_table(table, entry)
    write_policy_table(table, entry)  # the model's entry replaced, not added twice
    entries = json.loads(table.read_text())["entries"]
    assert sum(e["model"] == entry["model"] for e in entries) == 1
    costs = load_step_costs(load_model_config(DEFAULT_MODEL_DIR), "float32", table)
    choice = choose(costs, "mtp", costs.acceptance["mtp"], max_k=16)
    # 3.4 tokens for 1.6 ms at batch 1 (2.1x), for 3.9 / 2 decode steps at 16 (1.74x), not at 64
    assert (choice.k, choice.max_batch_size) == (3, 16)


def test_a_divergence_is_a_near_tie_only_within_four_bf16_steps():
    logits = [torch.tensor([8.0, 7.0, 0.0]), torch.tensor([8.0, 7.99, 0.0])]
    assert first_divergence([0, 1], [0, 1], logits, fp32=False) is None
    tie = first_divergence([0, 1], [0, 0], logits, fp32=False)
    assert tie["position"] == 1 and tie["near_tie"]  # 0.01 < 4 x 2^-4 at magnitude 8
    assert not first_divergence([1, 0], [0, 0], logits, fp32=False)["near_tie"]  # gap 1.0
    assert not first_divergence([0, 1], [0, 0], logits, fp32=True)["near_tie"]  # fp32: below 1e-4 only
    assert not first_divergence([0], [0, 0], logits, fp32=False)["near_tie"]  # a shorter output
