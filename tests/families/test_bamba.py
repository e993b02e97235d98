"""Bamba (engine/models/bamba.py) against transformers' BambaForCausalLM.

Tiny random models made with transformers (fp32, CPU, eager attention; norm weights, biases,
A_log, D and dt_bias perturbed from transformers' constant inits so a misplaced term shows),
saved with save_pretrained and loaded by the engine's loader (tests/families/hf_reference_checks.py):
- logits within 1e-4 relative in one chunk, in odd chunks with the state carried, and with
  several requests in one forward; 32 greedy tokens equal to generate()'s (near-ties counted);
- the checkpoint reuse cases through LLMEngine (tests/engine/reuse_cases.py: instruction
  reuse, multi-turn, repeats) on a saved model with the embedded model's tokenizer;
- tp=2 (gloo ranks, tests/tp/tp_support.py) equals tp=1;
- config spellings (attn_layer_indices, the saved time_step_limit, partial rotary) and refusals.
"""

from __future__ import annotations

import math

import pytest
from transformers import BambaConfig, BambaForCausalLM

from engine.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.model_config import ATTENTION, MAMBA, MLP_SPLIT
from engine.models.registry import parse_model_config
from hf_reference_checks import (
    check_engine_greedy,
    check_instruction_reuse,
    check_multi_turn,
    check_repeat,
    Case,
    check_batched,
    check_greedy,
    check_one_chunk,
    check_odd_chunks,
    check_tp2_matches_tp1,
    save_engine_model,
    save_reference,
)

# GQA, two Mamba groups (a grouped gated norm), biases on attention, MLP and Mamba
# projections, head_dim * heads != hidden_size, RoPE on half of each head.
BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    attn_layer_indices=[1, 3],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    attention_bias=True,
    mlp_bias=True,
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=3,
    mamba_chunk_size=16,
    mamba_proj_bias=True,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    initializer_range=0.1,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
# Defaults elsewhere: one group, 4-tap conv, no biases, head_dim from hidden_size, tied embeddings.
PLAIN = dict(
    BASE, attn_layer_indices=[2], attention_bias=False, mlp_bias=False, mamba_proj_bias=False,
    mamba_n_groups=1, mamba_d_conv=4, head_dim=None, tie_word_embeddings=True,
)
CASES = {"biases_gqa": BASE, "plain_tied": PLAIN}


def _hf(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if v is not None}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    return Case(BambaConfig, BambaForCausalLM, _hf(CASES[request.param]), tmp_path_factory.mktemp(request.param))


def test_checkpoint_loads_as_bamba(case: Case):
    config = case.config
    assert config.model_type == "bamba" and config.mlp_layout == MLP_SPLIT
    assert config.partial_rotary_factor == 0.5 and config.rope_theta == 500.0
    assert config.time_step_limit == (0.0, math.inf)
    assert config.attention_layers == sorted(case.reference.config.attn_layer_indices)


def test_one_chunk_matches_reference(case: Case):
    check_one_chunk(case)


def test_odd_chunks_match_reference(case: Case):
    check_odd_chunks(case)


def test_batched_requests_match_reference(case: Case):
    check_batched(case)


def test_32_greedy_tokens_match_generate(case: Case):
    check_greedy(case)


# ---- checkpoints through LLMEngine ---------------------------------------------------------


@pytest.fixture(scope="module")
def engine_model_dir(tmp_path_factory):
    return save_engine_model(BambaConfig, BambaForCausalLM, _hf(BASE), tmp_path_factory.mktemp("bamba_engine"))


@pytest.fixture(scope="module")
def engine(engine_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(engine_model_dir), max_num_batched_tokens=40, max_num_seqs=8))


def test_instruction_reuse_matches_scratch(engine):
    assert engine.executor.model.config.model_type == "bamba"
    check_instruction_reuse(engine, "bamba")


def test_multi_turn_matches_scratch(engine):
    check_multi_turn(engine, "bamba")


def test_repeat_runs_no_prefill(engine):
    check_repeat(engine, "bamba")


def test_engine_greedy_output_equals_generate(engine):
    check_engine_greedy(engine, BambaForCausalLM, "bamba engine")


# ---- tensor parallel -------------------------------------------------------------------------


def test_tp2_matches_tp1(tmp_path):
    model_dir = tmp_path / "model"
    save_reference(BambaConfig, BambaForCausalLM, _hf(BASE), model_dir)
    check_tp2_matches_tp1(model_dir, "bamba", tmp_path / "tp2")


# ---- config spellings and refusals ---------------------------------------------------------


def _raw(**changes) -> dict:
    raw = dict(model_type="bamba", vocab_size=97, hidden_size=64, intermediate_size=96,
               num_hidden_layers=3, attn_layer_indices=[1], num_attention_heads=4,
               num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=16,
               time_step_limit=[0.0, {"__float__": "Infinity"}], rope_theta=10000.0)
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


def test_spellings():
    config = parse_model_config(_raw())
    assert config.layer_types == (MAMBA, ATTENTION, MAMBA)
    assert config.time_step_limit == (0.0, math.inf) and config.rope_theta == 10000.0
    assert config.mamba_d_head == 16 and config.attention_multiplier == 16**-0.5
    listed = parse_model_config(_raw(rope_theta=None, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}))
    assert listed == config
    assert parse_model_config(_raw(attn_layer_indices=None)).layer_types == (MAMBA,) * 3
    assert parse_model_config(_raw(attn_rotary_emb=8)) == config  # head_dim 16, half rotated


@pytest.mark.parametrize("changes, key", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attn_layer_indices=[3]), "attn_layer_indices"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 1.0}), "partial_rotary_factor"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope_type"),
    (dict(attn_rotary_emb=16), "attn_rotary_emb"),
    (dict(mamba_d_head=12), "mamba_d_head"),
    (dict(mamba_n_groups=3), "mamba_n_groups"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(intermediate_size=None), "intermediate_size"),
])
def test_refusals_name_the_key(changes, key):
    with pytest.raises(ValueError, match=key):
        parse_model_config(_raw(**changes))
