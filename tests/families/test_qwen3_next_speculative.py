"""Speculative decoding on Qwen3-Next (issue 25, point 1; docs/design.md section 10): the gated
delta-net verifies a chunk of k + 1 tokens with its one-token decode step, leaving each
position's conv and recurrent state in a scratch slot (engine/speculative/verify.py
mix_verification), so with 3 n-gram draft tokens greedy outputs are those of speculation off
and a rejected draft leaves no trace in the request's state slot.

The model is test_qwen3_next.py's tiny random Qwen3-Next with routed experts (BASE) at the
embedded model's vocabulary, its LM head rows scaled by 0.05 but those of four tokens: its
greedy outputs, mostly those four tokens and still set by the whole context (state and KV),
repeat n-grams often enough for drafts to be accepted. With a plain random head about one draft
in 400 was accepted.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from engine.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.model_config import GATED_DELTA_NET
from engine.speculative.verify import check_verifiable
from hf_reference_checks import save_engine_model
from test_qwen3_next import BASE, one_thread, perturb_constant_init  # noqa: F401 (one_thread: autouse fixture)
from tests.engine.reuse_cases import GREEDY, SYSTEM, Alone, chat, instruction_reuse, multi_turn, run
from tests.engine.test_speculative import (  # noqa: F401 (repeating_prompts: a fixture, built with this module's engine_off)
    check_rejected_draft_leaves_no_trace,
    check_speculation_equals_off,
    repeating_prompts,
)

K = 3
FAVOURED_TOKENS = range(300, 304)
# reuse_cases' requests without logits (a request that asks for logits does not speculate)
# and longer, so that drafts are proposed
SPECULATING = replace(GREEDY, return_logits=False, max_tokens=16)


@torch.no_grad()
def favour_four_tokens(reference: Qwen3NextForCausalLM, seed: int) -> None:
    """test_qwen3_next's perturbation, then every LM head row but FAVOURED_TOKENS' scaled by 0.05."""
    perturb_constant_init(reference, seed)
    others = torch.ones(reference.lm_head.weight.shape[0], dtype=torch.bool)
    others[FAVOURED_TOKENS.start : FAVOURED_TOKENS.stop] = False
    reference.lm_head.weight[others] *= 0.05


def save_speculating_model(directory: Path, **overrides) -> EngineConfig:
    """BASE (with `overrides`) with its LM head favouring four tokens (favour_four_tokens)
    saved in `directory` with the embedded model's tokenizer: the engine configuration of it,
    speculation off."""
    save_engine_model(Qwen3NextConfig, Qwen3NextForCausalLM, dict(BASE, **overrides), directory,
                      perturb=favour_four_tokens)
    return EngineConfig(model_dir=str(directory), max_num_batched_tokens=40, max_num_seqs=8)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    """Speculation off; the saved model (save_speculating_model)."""
    return save_speculating_model(tmp_path_factory.mktemp("qwen3_next_speculative"))


@pytest.fixture(scope="module")
def engine_off(config) -> LLMEngine:
    return LLMEngine(config)


@pytest.fixture(scope="module")
def engine_on(config) -> LLMEngine:
    return LLMEngine(replace(config, num_speculative_tokens=K))


def test_gated_delta_net_layers_verify(engine_on):
    layer_types = engine_on.executor.model.config.layer_types
    assert GATED_DELTA_NET in layer_types
    check_verifiable(layer_types)
    assert engine_on.config.num_speculative_tokens == K


def test_greedy_outputs_equal_speculation_off_over_the_exactness_workload(config, repeating_prompts):
    """test_speculative's exactness run on Qwen3-Next: chat requests sharing system prompts
    (instruction reuse), multi-turn continuations and each from scratch, plus prompts that
    repeat a span; outputs equal speculation off's, drafts were accepted."""
    check_speculation_equals_off(config, K, repeating_prompts, "qwen3_next")


def _reuse_cases(engine: LLMEngine) -> dict[str, Alone]:
    """reuse_cases' instruction reuse, multi-turn and repeat with SPECULATING requests."""
    cases = dict(zip(("i1", "i2", "i3"), instruction_reuse(engine, "spec-instruction", params=SPECULATING)))
    cases.update(zip(("m1", "m2", "m3"), multi_turn(engine, "spec-multi-turn", params=SPECULATING)))
    conversation = chat(SYSTEM, "Repeat after me: seven rivers.")
    for request_id in ("r1", "r2"):
        cases[request_id] = run(engine, request_id, conversation, "spec-repeat", SPECULATING)
    return cases


def test_reuse_cases_restore_the_same_tokens_with_speculation(engine_off, engine_on):
    """With speculation on, each reuse case restores what it restores with speculation off
    (the instructions; at least the previous turn's prompt; the whole repeated prompt, no
    prefill) and gives the same tokens, equal to the from-scratch run's."""
    chunks = engine_on.stats().speculation.verification_chunks
    on, off = _reuse_cases(engine_on), _reuse_cases(engine_off)
    assert engine_on.stats().speculation.verification_chunks > chunks, "no verification ran"
    for request_id, got in on.items():
        assert (got.tokens, got.cached) == (off[request_id].tokens, off[request_id].cached), request_id
    assert on["i1"].cached == 0 and on["i2"].cached == on["i2"].boundary is not None
    assert on["m2"].cached >= len(on["m1"].prompt)
    assert on["r2"].cached == len(on["r2"].prompt) and on["r2"].chunk_sizes[0] == 0
    for restored, scratch in (("i2", "i3"), ("m2", "m3"), ("r2", "r1")):
        assert on[restored].tokens == on[scratch].tokens, restored
    assert on["i3"].cached == on["m3"].cached == 0
    assert engine_on.pool_usage().idle


def test_a_rejected_draft_leaves_no_trace_in_the_state_slot_or_kept_kv(config):
    """test_speculative's worker-level rollback check on Qwen3-Next: a verification with a
    wrong draft leaves the gated delta-net's conv and recurrent state slot untouched, and the
    commit gives the state and KV of plain decoding."""
    check_rejected_draft_leaves_no_trace(config)
