"""Nemotron-H (engine/models/nemotron_h.py) against transformers' NemotronHForCausalLM.

Tiny random models made with transformers (fp32, CPU, eager attention; norm weights, biases,
A_log, D and dt_bias perturbed from transformers' constant inits so a misplaced term shows),
saved with save_pretrained ("backbone." names) and loaded by the engine's loader:
- logits within 1e-4 relative (max|a-b| / max|b|) in one chunk, in odd chunks with the
  state carried, and with several requests in one forward; 32 greedy tokens equal to
  generate()'s (a near-tie, top-2 reference logits within 1e-4, is counted and stops the
  comparison);
- the checkpoint exactness cases through LLMEngine (tests/engine/reuse_cases.py: instruction
  reuse, multi-turn, repeats) on a saved model with the embedded model's tokenizer;
- tensor parallel: tp=2 (gloo ranks, tests/tp/tp_support.py) equals tp=1;
- both block-pattern spellings, and the refusals, by name of the key (MoE blocks:
  test_nemotron_h_moe.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from engine.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.model_config import ATTENTION, MAMBA, MLP
from engine.models.nemotron_h import NemotronHModel
from engine.models.registry import parse_model_config
from engine.parallel.tensor_parallel import TensorParallel
from hf_reference_checks import (
    check_engine_greedy,
    check_instruction_reuse,
    check_multi_turn,
    check_repeat,
    TOLERANCE,
    Case,
    check_batched,
    check_greedy,
    check_odd_chunks,
    check_one_chunk,
    rel_err,
    save_engine_model,
    save_reference as save_hf_reference,
    without_none,
)
from tests.tp.tp_support import run_model, run_world

# Every block kind, a grouped gated norm (2 groups of 64 channels), GQA with head_dim * heads
# != hidden_size, biases in the Mamba projections and the conv.
BASE = dict(
    vocab_size=97,
    hidden_size=64,
    layers_block_type=["mamba", "mlp", "attention", "mamba", "mlp", "attention", "mamba"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    intermediate_size=96,
    mamba_num_heads=8,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=16,
    use_bias=True,
    use_conv_bias=True,
    layer_norm_epsilon=1e-5,
    initializer_range=0.1,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
# The published spelling, 4 groups, a 3-tap conv, no projection biases.
PATTERN = dict(
    BASE,
    layers_block_type=None,
    hybrid_override_pattern="M*-M-M",
    n_groups=4,
    conv_kernel=3,
    use_bias=False,
)


def save_reference(hf_kwargs: dict, directory: Path) -> NemotronHForCausalLM:
    return save_hf_reference(NemotronHConfig, NemotronHForCausalLM, without_none(hf_kwargs), directory)


@pytest.fixture(scope="module", params=["layers_block_type", "hybrid_override_pattern"])
def case(request, tmp_path_factory) -> Case:
    kwargs = BASE if request.param == "layers_block_type" else PATTERN
    return Case(NemotronHConfig, NemotronHForCausalLM, without_none(kwargs), tmp_path_factory.mktemp(request.param))


def test_checkpoint_loads_with_every_block_kind(case: Case):
    kinds = set(case.config.layer_types)
    assert kinds == {MAMBA, ATTENTION, MLP}
    assert isinstance(case.model, NemotronHModel)
    assert case.config.rope_theta is None and case.config.time_step_limit == (0.0, math.inf)
    caches = case.model.allocate_caches(4, 16, 2)
    assert set(caches.key_cache) == set(case.config.attention_layers)
    assert set(caches.conv_state) == set(case.config.mamba_layers)
    # MLP blocks hold neither: the sizes count the Mamba2 and attention blocks only
    (conv_dim, taps), (heads, head_dim, state_size) = case.model.mamba_state_shape()
    per_mamba = conv_dim * taps * 4 + heads * head_dim * state_size * 4
    assert case.model.state_bytes_per_slot() == len(case.config.mamba_layers) * per_mamba
    per_attention = 2 * 16 * case.model.kv_heads_per_rank() * case.config.head_dim * 4
    assert case.model.kv_bytes_per_block(16) == len(case.config.attention_layers) * per_attention


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
def engine_model_dir(tmp_path_factory) -> Path:
    """BASE saved with the embedded model's vocabulary and tokenizer (save_engine_model)."""
    return save_engine_model(NemotronHConfig, NemotronHForCausalLM, without_none(BASE), tmp_path_factory.mktemp("nemotron_h_engine"))


@pytest.fixture(scope="module")
def engine(engine_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(engine_model_dir), max_num_batched_tokens=40, max_num_seqs=8))


def test_engine_runs_nemotron_h(engine):
    assert engine.executor.model.config.model_type == "nemotron_h"


def test_instruction_reuse_matches_scratch(engine):
    check_instruction_reuse(engine, "nh")


def test_multi_turn_matches_scratch(engine):
    check_multi_turn(engine, "nh")


def test_repeat_runs_no_prefill(engine):
    check_repeat(engine, "nh")


def test_engine_greedy_output_equals_generate(engine):
    check_engine_greedy(engine, NemotronHForCausalLM, "nemotron_h engine")


# ---- tensor parallel -------------------------------------------------------------------------


def test_tp2_matches_tp1(engine_model_dir, tmp_path):
    """tp_support's greedy batch and stop-and-continue on the engine's saved model: tp=2 (two
    gloo ranks) against tp=1 in process."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    # a smaller vocabulary keeps the spawned ranks quick
    save_reference(dict(BASE, vocab_size=101), model_dir)
    torch.set_num_threads(1)
    single = run_model(model_dir, TensorParallel.single())
    assert single["tokens"].unique().numel() > 5, "degenerate greedy outputs test nothing"
    ranks = run_world(2, {"nemotron_h": model_dir}, tmp_path / "tp2")["nemotron_h"]
    for rank in ranks:
        assert torch.equal(rank["tokens"], single["tokens"])
        assert rel_err(rank["logits"], single["logits"]) < TOLERANCE
        for key in ("whole", "copied", "restored"):
            assert rel_err(rank[key], single["whole"]) < TOLERANCE, key
        assert rank["num_elements"] < single["num_elements"]
    print(f"tp=2: tokens equal, logits max relative error "
          f"{max(rel_err(r['logits'], single['logits']) for r in ranks):.2e}")


# ---- config spellings and refusals ---------------------------------------------------------


def _raw(**changes) -> dict:
    raw = dict(model_type="nemotron_h", vocab_size=97, hidden_size=64, intermediate_size=96,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
               mamba_head_dim=16, n_groups=2, ssm_state_size=16,
               time_step_limit=[0.0, {"__float__": "Infinity"}])
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


def test_both_pattern_spellings_agree():
    listed = parse_model_config(_raw(layers_block_type=["linear_attention", "full_attention", "mlp"]))
    legacy = parse_model_config(_raw(layers_block_type=["mamba", "attention", "mlp"]))
    pattern = parse_model_config(_raw(hybrid_override_pattern="M*-", num_hidden_layers=3))
    both = parse_model_config(_raw(hybrid_override_pattern="M*-", layers_block_type=["mamba", "attention", "mlp"]))
    assert listed == legacy == pattern == both
    assert pattern.layer_types == (MAMBA, ATTENTION, MLP) and pattern.num_hidden_layers == 3
    assert pattern.time_step_limit == (0.0, math.inf)
    assert pattern.mamba_layers == [0] and pattern.attention_layers == [1]


@pytest.mark.parametrize("changes, key", [
    (dict(hybrid_override_pattern="M*-", layers_block_type=["mamba", "mlp", "attention"]), "disagree"),
    (dict(hybrid_override_pattern="M*-", num_hidden_layers=4), "num_hidden_layers"),
    (dict(hybrid_override_pattern="M*X"), "hybrid_override_pattern"),
    (dict(), "layers_block_type"),
    (dict(hybrid_override_pattern="M-", mlp_hidden_act="silu"), "mlp_hidden_act"),
    (dict(hybrid_override_pattern="M-", mlp_bias=True), "mlp_bias"),
    (dict(hybrid_override_pattern="M*", attention_bias=True), "attention_bias"),
    (dict(hybrid_override_pattern="M*", position_embedding_type="rope"), "position_embedding_type"),
    (dict(hybrid_override_pattern="M*", num_nextn_predict_layers=1), "num_nextn_predict_layers"),
    (dict(hybrid_override_pattern="M-", n_groups=3), "n_groups"),
    (dict(hybrid_override_pattern="M-", tie_word_embeddings=True), "tie_word_embeddings"),
])
def test_refusals_name_the_key(changes, key):
    with pytest.raises(ValueError, match=key):
        parse_model_config(_raw(**changes))
