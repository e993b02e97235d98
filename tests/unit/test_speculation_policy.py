"""The speculation policy (engine/speculative/policy.py) with given step costs and acceptance:
which k and batch cap it turns on, when it stays off, how it resolves an unset
num_speculative_tokens, and how the acceptance gate stops and resumes a request's drafting."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from engine.core.llm_engine import LLMEngine
from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig
from engine.models.registry import load_model_config
from engine.speculative.policy import (
    MIN_SPEEDUP, STEP_COSTS_PATH, TRAINED_HEAD_FILE, TRAINED_HEAD_REPORT, AcceptanceGate, StepCosts, choose,
    expected_tokens, load_step_costs, model_signature, resolve_speculation, step_costs_from_json,
)

# decode 1 ms at batch 1 and 2 ms at batch 16 and 4 ms at 64; a verification step of k drafts
# costs 1 + 0.25 k ms at batch 1, 2 + 1.5 k at 16, 4 + 8 k at 64; MTP drafting 0.1 k ms a step
COSTS = StepCosts(
    device="test GPU",
    decode_ms={1: 1.0, 16: 2.0, 64: 4.0},
    verify_ms={k: {1: 1 + 0.25 * k, 16: 2 + 1.5 * k, 64: 4 + 8 * k} for k in (1, 2, 3, 4)},
    draft_ms={"mtp": {k: {1: 0.1 * k, 16: 0.1 * k, 64: 0.1 * k} for k in (1, 2, 3, 4)}},
    acceptance={"mtp": (0.8, 0.6, 0.45, 0.3)},
)


def test_expected_tokens_add_the_shares_accepted_at_each_depth():
    assert expected_tokens((0.8, 0.6, 0.45, 0.3), 3) == pytest.approx(2.85)
    assert expected_tokens((0.8,), 3) == pytest.approx(1.8)  # unmeasured depths count as rejected
    assert expected_tokens((), 2) == 1.0


def test_step_ratio_interpolates_between_measured_batch_sizes():
    assert COSTS.step_ratio("mtp", 2, 1) == pytest.approx((1.5 + 0.2) / 1.0)
    assert COSTS.step_ratio("ngram", 2, 16) == pytest.approx(5.0 / 2.0)  # no drafting cost
    # batch 40 lies halfway from 16 to 64: verify 5 + (20 - 5) / 2, decode 3
    assert COSTS.step_ratio("ngram", 2, 40) == pytest.approx(12.5 / 3.0)
    assert COSTS.step_ratio("ngram", 2, 200) == COSTS.step_ratio("ngram", 2, 64)  # flat past the last


def test_choose_takes_the_k_that_wins_most_at_batch_1_and_caps_where_it_stops_winning():
    choice = choose(COSTS, "mtp", COSTS.acceptance["mtp"], max_k=16)
    # speed-up at batch 1: E_k / (1 + 0.35 k): k=1 1.33, k=2 1.41, k=3 1.39, k=4 1.31
    assert choice.k == 2 and choice.drafter == "mtp"
    assert choice.speedup == pytest.approx(2.4 / 1.7)
    # at batch 16, k = 2: 2.4 / (5.2 / 2) = 0.92 < MIN_SPEEDUP: drafting only at batch 1
    assert choice.max_batch_size == 1
    assert choice.break_even == {b: pytest.approx(COSTS.step_ratio("mtp", 2, b)) for b in (1, 16, 64)}


def test_choose_keeps_drafting_up_to_the_largest_batch_that_still_wins():
    cheap = replace(COSTS, verify_ms={2: {1: 1.2, 16: 2.6, 64: 12.0}}, draft_ms={})
    choice = choose(cheap, "mtp", (0.9, 0.8), max_k=4)
    assert choice.k == 2 and choice.max_batch_size == 16  # 2.7 / 1.3 = 2.08 at 16, 2.7 / 3 at 64


def test_choose_stays_off_when_nothing_wins_or_a_figure_is_missing():
    assert choose(COSTS, "mtp", (0.0, 0.0, 0.0, 0.0), max_k=16) is None  # a random head
    assert choose(COSTS, "mtp", (0.2, 0.05), max_k=16) is None  # 1.2 / 1.35 at k = 1
    assert choose(None, "mtp", (0.9, 0.9), max_k=16) is None
    assert choose(COSTS, "mtp", None, max_k=16) is None
    assert choose(COSTS, "mtp", (0.9, 0.9), max_k=0) is None
    barely = StepCosts("g", {1: 1.0}, {1: {1: 1.0}}, acceptance={})
    # 1.04 tokens for the decode step's cost: below MIN_SPEEDUP
    assert choose(barely, "ngram", (MIN_SPEEDUP - 1.01,), max_k=1) is None
    assert choose(barely, "ngram", (MIN_SPEEDUP - 0.99,), max_k=1).k == 1


def _write_table(path, model_dir, dtype="float32", acceptance=(0.8, 0.6, 0.45, 0.3)):
    signature = model_signature(load_model_config(model_dir), dtype)
    entry = {"device": "test GPU", "model": signature, "context": 1024,
             "decode_ms": {str(b): ms for b, ms in COSTS.decode_ms.items()},
             "verify_ms": {str(k): {str(b): ms for b, ms in t.items()} for k, t in COSTS.verify_ms.items()},
             "draft_ms": {"mtp": {str(k): {str(b): ms for b, ms in t.items()} for k, t in COSTS.draft_ms["mtp"].items()}},
             "acceptance": {"mtp": list(acceptance)}}
    path.write_text(json.dumps({"entries": [entry]}))


@pytest.fixture
def model_with_head(tmp_path):
    """The tiny model's files and a trained-head report (the head's tensors are not read here)."""
    model_dir = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    (model_dir / TRAINED_HEAD_FILE).parent.mkdir()
    (model_dir / TRAINED_HEAD_FILE).write_bytes(b"")
    (model_dir / TRAINED_HEAD_REPORT).write_text(json.dumps({"acceptance_by_depth": [0.9, 0.7, 0.5]}))
    return model_dir


def test_an_unset_k_resolves_off_on_the_cpu_and_on_where_the_figures_win_on_cuda(tmp_path, model_with_head):
    table = tmp_path / "costs.json"
    _write_table(table, model_with_head)
    model_config = load_model_config(model_with_head)
    cpu = EngineConfig(model_dir=str(model_with_head))
    assert cpu.num_speculative_tokens is None
    resolved, choice = resolve_speculation(cpu, model_config, table)
    assert resolved.num_speculative_tokens == 0 and choice is None
    cuda = replace(cpu, device="cuda")
    resolved, choice = resolve_speculation(cuda, model_config, table)
    # the head's own acceptance (its report) is taken over the table's: E_2 = 2.6 for 1.7 ms
    # (1.53x) beats E_3 = 3.1 for 2.05 ms (1.51x); at batch 16, 2.6 for 2.6 decode steps
    assert choice.k == 2 and choice.expected_tokens == pytest.approx(2.6)
    assert (resolved.num_speculative_tokens, resolved.speculative_drafter, resolved.speculative_max_batch_size) == (
        2, "mtp", 1)
    assert resolve_speculation(resolved, model_config, table) == (resolved, None)  # resolving twice: the same


def test_no_head_no_figures_or_a_setting_given_leave_speculation_as_configured(tmp_path, model_with_head):
    table = tmp_path / "costs.json"
    _write_table(table, model_with_head)
    cuda = EngineConfig(model_dir=str(DEFAULT_MODEL_DIR), device="cuda")
    tiny = load_model_config(DEFAULT_MODEL_DIR)
    assert resolve_speculation(cuda, tiny, table)[0].num_speculative_tokens == 0  # no head of its own
    with_head = replace(cuda, model_dir=str(model_with_head))
    assert resolve_speculation(with_head, tiny, tmp_path / "absent.json")[0].num_speculative_tokens == 0
    assert resolve_speculation(replace(with_head, dtype="bfloat16"), tiny, table)[0].num_speculative_tokens == 0
    for given in (0, 4):
        config = replace(with_head, num_speculative_tokens=given)
        assert resolve_speculation(config, tiny, table) == (config, None)
    assert load_step_costs(tiny, "float32", STEP_COSTS_PATH) is None  # no entry for the tiny model


def test_the_checked_in_table_keeps_speculation_off_with_its_measured_acceptance():
    """step_costs.json holds the 1.5B benchmark model's figures on the GPU it was measured on;
    with the acceptance measured beside them it must say what the benchmark says (off with a
    head drafting at chance)."""
    entries = json.loads(STEP_COSTS_PATH.read_text())["entries"]
    assert entries, "the table has the benchmark model's entry"
    for entry in entries:
        costs = step_costs_from_json(entry)
        assert costs.decode_ms and all(set(t) == set(costs.decode_ms) for t in costs.verify_ms.values())
        acceptance = costs.acceptance.get("mtp")
        if acceptance is not None and max(acceptance) == 0.0:
            assert choose(costs, "mtp", acceptance, max_k=16) is None


def test_the_engine_resolves_an_unset_k_to_off_on_the_cpu():
    engine = LLMEngine(EngineConfig())
    assert engine.config.num_speculative_tokens == 0 and engine.scheduler.speculation.num_speculative_tokens == 0
    assert engine.speculation_choice is None


def test_the_gate_stops_a_request_below_break_even_and_probes_it_again():
    choice = choose(COSTS, "mtp", COSTS.acceptance["mtp"], max_k=16)  # k = 2, break-even 1.7 at batch 1
    gate = AcceptanceGate(choice, ema_weight=0.5, probe_steps=3)
    gate.begin_step(1)
    assert gate.allows("good") and gate.allows("bad")  # both start at the expected 2.4 tokens
    for _ in range(3):
        gate.observe("good", 2)  # 3 tokens a verification
        gate.observe("bad", 0)  # 1 token: 2.4 -> 1.7 -> 1.35 -> 1.18
    assert gate.allows("good") and not gate.allows("bad") and gate.requests_stopped == 1
    gate.begin_step(1)
    gate.begin_step(1)
    assert not gate.allows("bad")
    gate.begin_step(1)
    assert gate.allows("bad")  # probe_steps later: one more try
    gate.observe("bad", 2)  # 1.18 -> 2.09: above break-even again
    gate.begin_step(1)
    assert gate.allows("bad")
    # at batch 16 the break-even is 2.6 tokens: "bad" (2.09) stops, "good" (2.94) goes on
    gate.begin_step(16)
    assert gate.allows("good") and not gate.allows("bad")
    gate.forget("good")
    assert not gate.allows("good")  # forgotten: back to the expected 2.4 tokens, below 2.6
