"""Falcon-H1 (engine/models/falcon_h1.py) against transformers' FalconH1ForCausalLM.

Every layer runs attention and Mamba2 side by side (a HYBRID layer: a KV slot and a state
slot). Tiny random models made with transformers with a non-1.0 value for every multiplier
(embedding, lm_head, key, attention in/out, ssm in/out, the five ssm_multipliers of the mup
vector, both mlp_multipliers), perturbed constant inits, saved with save_pretrained and loaded
by the engine's loader (tests/families/hf_reference_checks.py), in the three forms of the
Mamba norm (none, normed before the gate, after it):
- logits within 1e-4 relative in one chunk, in odd chunks with the state carried, and with
  several requests in one forward; 32 greedy tokens equal to generate()'s (near-ties counted);
- the checkpoint reuse cases through LLMEngine (tests/engine/reuse_cases.py);
- tp=2 (gloo ranks, tests/tp/tp_support.py) equals tp=1, the mup vector and the Mamba heads
  split together;
- config spellings and refusals.
"""

from __future__ import annotations

import math

import pytest
from transformers import FalconH1Config, FalconH1ForCausalLM

from engine.checkpoints.import_checks import expected_shard_layout
from engine.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.model_config import (
    HYBRID,
    MAMBA_GATE_ONLY,
    MAMBA_NORM_FIRST,
    MAMBA_NORM_GATE_FIRST,
)
from engine.models.registry import parse_model_config
from engine.parallel.tensor_parallel import TensorParallel
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

MULTIPLIERS = dict(
    embedding_multiplier=3.0,
    lm_head_multiplier=0.7,
    key_multiplier=1.3,
    attention_in_multiplier=0.8,
    attention_out_multiplier=1.4,
    ssm_in_multiplier=1.2,
    ssm_out_multiplier=0.6,
    ssm_multipliers=[0.9, 1.3, 0.7, 1.1, 0.5],
    mlp_multipliers=[1.5, 0.4],
)
# GQA with head_dim * heads != hidden_size, two Mamba groups, mamba_d_ssm != expand * hidden,
# biases everywhere (attention, MLP, Mamba in_proj, out_proj through projectors_bias).
BASE = dict(
    MULTIPLIERS,
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    attention_bias=True,
    mlp_bias=True,
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_ssm=96,
    mamba_d_state=16,
    mamba_d_conv=3,
    mamba_chunk_size=16,
    mamba_proj_bias=True,
    projectors_bias=True,
    mamba_rms_norm=False,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    initializer_range=0.1,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
CASES = {
    "gate_only": BASE,
    "norm_before_gate": dict(BASE, mamba_rms_norm=True, mamba_norm_before_gate=True, tie_word_embeddings=True),
    "norm_after_gate": dict(BASE, mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_n_groups=1),
}
NORM_FORMS = {"gate_only": MAMBA_GATE_ONLY, "norm_before_gate": MAMBA_NORM_FIRST,
              "norm_after_gate": MAMBA_NORM_GATE_FIRST}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    built = Case(FalconH1Config, FalconH1ForCausalLM, CASES[request.param], tmp_path_factory.mktemp(request.param))
    built.name = request.param
    return built


def test_checkpoint_loads_as_parallel_hybrid_layers(case: Case):
    config = case.config
    assert config.layer_types == (HYBRID,) * 3
    assert config.attention_layers == config.mamba_layers == [0, 1, 2]
    assert config.mamba_gated_norm == NORM_FORMS[case.name]
    caches = case.model.allocate_caches(4, 16, 2)
    assert set(caches.key_cache) == set(caches.conv_state) == {0, 1, 2}
    # every layer counted in both budgets and in the checkpoint shard shapes
    (conv_dim, taps), (heads, head_dim, state) = case.model.mamba_state_shape()
    assert case.model.state_bytes_per_slot() == 3 * 4 * (conv_dim * taps + heads * head_dim * state)
    assert case.model.kv_bytes_per_block(16) == 3 * 2 * 16 * config.num_key_value_heads * config.head_dim * 4
    layout = expected_shard_layout(config, TensorParallel.single(), "float32")
    assert layout.conv_state[0] == layout.ssm_state[0] == layout.kv_row[0] == 3
    assert caches.conv_stack.shape[0] == caches.kv_stack.shape[1] == 3


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
    """The norm-after-gate case: BASE's random model at the engine's vocabulary answers every
    prompt with one token, which would make the reuse checks compare nothing."""
    return save_engine_model(FalconH1Config, FalconH1ForCausalLM, CASES["norm_after_gate"],
                             tmp_path_factory.mktemp("falcon_engine"))


@pytest.fixture(scope="module")
def engine(engine_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(engine_model_dir), max_num_batched_tokens=40, max_num_seqs=8))


def test_instruction_reuse_matches_scratch(engine):
    assert engine.executor.model.config.model_type == "falcon_h1"
    runs = check_instruction_reuse(engine, "falcon")
    assert len({t for run in runs for t in run.tokens}) > 5, "degenerate greedy outputs test nothing"


def test_multi_turn_matches_scratch(engine):
    check_multi_turn(engine, "falcon")


def test_repeat_runs_no_prefill(engine):
    check_repeat(engine, "falcon")


def test_engine_greedy_output_equals_generate(engine):
    check_engine_greedy(engine, FalconH1ForCausalLM, "falcon_h1 engine")


# ---- tensor parallel -------------------------------------------------------------------------


def test_tp2_matches_tp1(tmp_path):
    """The norm-before-gate case with one norm group, so the group spans both ranks (its sum
    of squares all-reduced) and the one B/C group is held by both."""
    model_dir = tmp_path / "model"
    save_reference(FalconH1Config, FalconH1ForCausalLM, dict(CASES["norm_before_gate"], mamba_n_groups=1), model_dir)
    check_tp2_matches_tp1(model_dir, "falcon_h1", tmp_path / "tp2")


# ---- config spellings and refusals ---------------------------------------------------------


def _raw(**changes) -> dict:
    raw = dict(model_type="falcon_h1", vocab_size=97, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               mamba_n_heads=8, mamba_d_ssm=64, mamba_d_state=16, rope_theta=1e11, rope_scaling=None,
               time_step_limit=[0.0, {"__float__": "Infinity"}], key_multiplier=0.5,
               lm_head_multiplier=0.25, mlp_multipliers=[2.0, 0.5],
               ssm_multipliers=[1.0, 2.0, 3.0, 4.0, 5.0])
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


def test_spellings():
    config = parse_model_config(_raw())
    assert config.rope_theta == 1e11 and config.time_step_limit == (0.0, math.inf)
    assert config.mamba_d_head == 8 and config.mamba_intermediate_size == 64
    assert config.attention_multiplier == 0.5 / 4 and config.logits_scaling == 4.0
    assert config.mlp_gate_multiplier == 2.0 and config.residual_multiplier == 0.5
    assert config.mamba_projection_multipliers == (1.0, 2.0, 3.0, 4.0, 5.0)
    assert config.mamba_gated_norm == MAMBA_GATE_ONLY and config.partial_rotary_factor == 1.0
    listed = parse_model_config(_raw(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 1e11}))
    assert listed == config
    missing = _raw(mlp_multipliers=None, ssm_multipliers=None, key_multiplier=None,
                   lm_head_multiplier=None, mamba_d_ssm=None, mamba_d_head=None)
    defaults = parse_model_config(missing)
    assert defaults.mamba_projection_multipliers == (1.0,) * 5 and defaults.logits_scaling == 1.0
    # as transformers: a config.json without mamba_d_ssm gets FalconH1Config's default, an
    # explicit null mamba_expand * hidden_size
    assert defaults.mamba_intermediate_size == 1024 == FalconH1Config().mamba_d_ssm
    null = parse_model_config(dict(missing, mamba_d_ssm=None))
    assert null.mamba_intermediate_size == 128  # mamba_expand (2) * hidden_size


@pytest.mark.parametrize("changes, key", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(ssm_multipliers=[1.0, 2.0]), "ssm_multipliers"),
    (dict(mlp_multipliers=[1.0]), "mlp_multipliers"),
    (dict(lm_head_multiplier=0.0), "lm_head_multiplier"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    (dict(mamba_d_head=12), "mamba_d_head"),
    (dict(mamba_n_groups=3), "mamba_n_groups"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
])
def test_refusals_name_the_key(changes, key):
    with pytest.raises(ValueError, match=key):
        parse_model_config(_raw(**changes))
