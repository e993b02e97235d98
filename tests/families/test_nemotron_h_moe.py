"""Nemotron-H with MoE blocks ("moe" / "E": engine/models/nemotron_h_moe.py) against
transformers' NemotronHForCausalLM.

Tiny random models made with transformers (fp32, CPU, eager attention; norm weights, biases,
A_log, D, dt_bias and the routers' e_score_correction_bias drawn away from transformers'
constant inits), saved with save_pretrained (experts one by one, "backbone." names) and loaded
by the engine's loader. Two configurations: MoE blocks among every other block kind with
one expert group; and the published pattern spelling with latent projections
(moe_latent_size), 4 expert groups of which 2 are kept, no renormalisation and a routing
scale. Checked:
- the router alone against NemotronHTopkRouter (experts and weights), with the selection
  bias and the group restriction each changing some choice (so both are exercised);
- logits within 1e-4 relative in one chunk, odd chunks and batched; 32 greedy tokens equal to
  generate()'s (tests/families/hf_reference_checks.py);
- the fused 3-D expert spelling (experts.up_proj / down_proj) loads the same parameters;
- instruction reuse, multi-turn and repeats through LLMEngine equal from scratch;
- tp=2 equals tp=1 (each expert's and the shared expert's channels split);
- config spellings and refusals, naming the key.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import NemotronHConfig, NemotronHForCausalLM
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

from engine.engine_config import EngineConfig
from engine.kernels.grouped_experts_reference import ExpertActivation
from engine.layers.routed_experts import Routing, RoutingRule, route
from engine.core.llm_engine import LLMEngine
from engine.execution.loader import load_model
from engine.model_config import ATTENTION, MAMBA, MLP, MOE
from engine.models.nemotron_h_moe import NemotronHMoE
from engine.models.registry import parse_model_config
from hf_reference_checks import (
    check_engine_greedy,
    Case,
    check_batched,
    check_greedy,
    check_instruction_reuse,
    check_multi_turn,
    check_odd_chunks,
    check_one_chunk,
    check_repeat,
    check_tp2_matches_tp1,
    perturb_constant_init,
    save_engine_model,
    save_reference,
)
from tests.engine.test_speculative import (  # noqa: F401 (repeating_prompts: a fixture, built with engine_off)
    check_speculation_equals_off,
    repeating_prompts,
)

_COMMON = dict(
    vocab_size=97, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
    intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
    conv_kernel=4, chunk_size=16, use_bias=True, layer_norm_epsilon=1e-5, initializer_range=0.1,
    max_position_embeddings=256, n_routed_experts=8, num_experts_per_tok=3,
    moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
)
# MoE blocks beside every other kind; one expert group (no restriction), weights renormalised.
LISTED = dict(_COMMON, layers_block_type=["mamba", "moe", "attention", "mlp", "moe", "mamba", "moe"])
# The published spelling, latent experts, 2 of 4 groups, raw sigmoid weights scaled by 2.5.
GROUPED_LATENT = dict(
    _COMMON, hybrid_override_pattern="M*E-EM", moe_latent_size=40, n_group=4, topk_group=2,
    norm_topk_prob=False, routed_scaling_factor=2.5, use_bias=False,
)
CONFIGS = {"listed": LISTED, "grouped_latent": GROUPED_LATENT}


@torch.no_grad()
def perturb(reference: torch.nn.Module, seed: int) -> None:
    """perturb_constant_init, and each router's selection bias (a zero buffer in transformers)
    drawn ~N(0, 0.2), on the scale of the sigmoid scores it is added to."""
    perturb_constant_init(reference, seed)
    generator = torch.Generator().manual_seed(seed + 2)
    for name, buffer in reference.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.2 * torch.randn(buffer.shape, generator=generator))


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory) -> Case:
    return Case(NemotronHConfig, NemotronHForCausalLM, CONFIGS[request.param],
                tmp_path_factory.mktemp(request.param), perturb=perturb)


def _moe_blocks(model) -> list[tuple[int, NemotronHMoE]]:
    return [(i, layer.mixer) for i, layer in enumerate(model.layers) if layer.kind == MOE]


def test_checkpoint_loads_moe_blocks(case: Case):
    config, hf = case.config, case.reference.config
    assert config.num_local_experts == 8 and config.intermediate_size == 32
    assert config.shared_expert_intermediate_size == 48 and config.shared_intermediate_size == 96
    latent = hf.moe_latent_size or hf.hidden_size
    blocks = _moe_blocks(case.model)
    assert [i for i, _ in blocks] == [i for i, kind in enumerate(hf.layers_block_type) if kind == "moe"]
    for i, block in blocks:
        hf_block = case.reference.model.layers[i].mixer
        experts = block.experts
        assert experts.activation is ExpertActivation.RELU_SQUARED
        assert experts.input_linear.weight.shape == (8, 32, latent)
        assert torch.equal(experts.input_linear.weight, hf_block.experts.up_proj)
        assert torch.equal(experts.output_linear.weight, hf_block.experts.down_proj)
        assert experts.router.layer.weight.dtype == torch.float32
        assert torch.equal(experts.router.e_score_correction_bias, hf_block.gate.e_score_correction_bias)
        assert experts.router.e_score_correction_bias.abs().max() > 0
        assert (block.fc1_latent_proj is not None) == (hf.moe_latent_size is not None)
    # MoE blocks hold no cache: the KV and state sizes count attention and Mamba2 blocks only
    caches = case.model.allocate_caches(4, 16, 2)
    assert set(caches.key_cache) == set(config.attention_layers)
    assert set(caches.conv_state) == set(config.mamba_layers)


def test_router_matches_transformers():
    """route() on random hidden states against NemotronHTopkRouter with the same weights: the
    same experts (as sets) with the same weights; ignoring the selection bias or keeping
    every group would change some token's experts."""
    hf_config = NemotronHConfig(**GROUPED_LATENT)
    torch.manual_seed(0)
    router = NemotronHTopkRouter(hf_config)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.2)
    hidden = torch.randn(200, hf_config.hidden_size)
    _, want_weights, want_ids = router(hidden)
    routing = Routing(RoutingRule.SIGMOID_GROUPED_TOP_K, 3, False, num_groups=4, top_groups=2, scaling=2.5)
    logits = hidden @ router.weight.T
    ids, weights = route(logits, routing, router.e_score_correction_bias)
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order))
    unbiased, _ = route(logits, routing, torch.zeros(8))
    ungrouped, _ = route(logits, Routing(RoutingRule.SIGMOID_GROUPED_TOP_K, 3, num_groups=4, top_groups=4),
                         router.e_score_correction_bias)
    same = lambda a: (a.sort(-1).values == ids.sort(-1).values).all(-1)  # noqa: E731
    assert not same(unbiased).all() and not same(ungrouped).all()


def test_one_chunk_matches_reference(case: Case):
    check_one_chunk(case)


def test_odd_chunks_match_reference(case: Case):
    check_odd_chunks(case)


def test_batched_requests_match_reference(case: Case):
    check_batched(case)


def test_32_greedy_tokens_match_generate(case: Case):
    check_greedy(case)


def test_fused_expert_tensors_load_alike(case: Case, tmp_path):
    """experts.up_proj (E, I, L) / experts.down_proj (E, L, I), as transformers holds them,
    load into the same parameters as the one-by-one tensors."""
    tensors = load_file(str(case.directory / "model.safetensors"))
    for i, _ in _moe_blocks(case.model):
        prefix = f"backbone.layers.{i}.mixer.experts"
        for projection in ("up_proj", "down_proj"):
            pieces = [tensors.pop(f"{prefix}.{e}.{projection}.weight") for e in range(8)]
            tensors[f"{prefix}.{projection}"] = torch.stack(pieces)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((case.directory / "config.json").read_text())
    fused, _ = load_model(tmp_path)
    want = dict(case.model.named_parameters())
    for name, param in fused.named_parameters():
        assert torch.equal(param, want[name]), name


# ---- checkpoints through LLMEngine ---------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    directory = save_engine_model(NemotronHConfig, NemotronHForCausalLM, LISTED,
                                  tmp_path_factory.mktemp("nemotron_h_moe_engine"), perturb=perturb)
    return LLMEngine(EngineConfig(model_dir=str(directory), max_num_batched_tokens=40, max_num_seqs=8))


def test_instruction_reuse_matches_scratch(engine):
    assert MOE in engine.executor.model.config.layer_types
    check_instruction_reuse(engine, "nhm")


def test_multi_turn_matches_scratch(engine):
    check_multi_turn(engine, "nhm")


def test_repeat_runs_no_prefill(engine):
    check_repeat(engine, "nhm")


def test_engine_greedy_output_equals_generate(engine):
    check_engine_greedy(engine, NemotronHForCausalLM, "nemotron_h_moe engine")


@pytest.fixture(scope="module")
def engine_off(engine) -> LLMEngine:
    """The spec-off engine test_speculative's repeating_prompts fixture continues spans with."""
    return engine


def test_speculation_equals_off(engine, repeating_prompts):
    """MoE blocks hold no state, so they verify drafts as they run any rows: with 3 n-gram draft
    tokens test_speculative's exactness run gives speculation off's outputs, drafts accepted."""
    check_speculation_equals_off(engine.config, 3, repeating_prompts, "nemotron_h_moe")


# ---- tensor parallel -------------------------------------------------------------------------


def test_tp2_matches_tp1(tmp_path):
    """Latent experts in groups at tp=2 (each rank its channels of every expert and of the
    shared expert; router and latent projections replicated) against tp=1."""
    model_dir = tmp_path / "model"
    save_reference(NemotronHConfig, NemotronHForCausalLM, dict(GROUPED_LATENT, vocab_size=101),
                   model_dir, perturb=perturb)
    check_tp2_matches_tp1(model_dir, "nemotron_h_moe", tmp_path / "tp2")


# ---- config spellings and refusals ---------------------------------------------------------


def _raw(**changes) -> dict:
    raw = dict(model_type="nemotron_h", vocab_size=97, hidden_size=64, intermediate_size=96,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
               mamba_head_dim=16, n_groups=2, ssm_state_size=16, n_routed_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=32,
               moe_shared_expert_intermediate_size=48, hybrid_override_pattern="ME*-")
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


def test_moe_spellings_agree_and_defaults_are_transformers():
    pattern = parse_model_config(_raw())
    listed = parse_model_config(_raw(hybrid_override_pattern=None,
                                     layers_block_type=["mamba", "moe", "attention", "mlp"]))
    assert pattern == listed and pattern.layer_types == (MAMBA, MOE, ATTENTION, MLP)
    defaults = NemotronHConfig()
    config = parse_model_config(_raw(n_routed_experts=None, num_experts_per_tok=None,
                                     moe_intermediate_size=None, moe_shared_expert_intermediate_size=None))
    assert config.num_local_experts == defaults.n_routed_experts
    assert config.num_experts_per_tok == defaults.num_experts_per_tok
    assert config.intermediate_size == defaults.moe_intermediate_size
    assert config.shared_expert_intermediate_size == defaults.moe_shared_expert_intermediate_size
    assert (config.n_group, config.topk_group) == (defaults.n_group, defaults.topk_group)
    assert config.norm_topk_prob == defaults.norm_topk_prob
    assert math.isclose(config.routed_scaling_factor, defaults.routed_scaling_factor)
    assert config.moe_latent_size == 0
    dense = parse_model_config(_raw(hybrid_override_pattern="M*-"))
    assert dense.num_local_experts == 0 and dense.intermediate_size == 0


@pytest.mark.parametrize("changes, key", [
    (dict(n_group=3), "n_group"),
    (dict(n_group=2, topk_group=3), "topk_group"),
    (dict(n_group=8, topk_group=2), "n_group"),  # one expert a group: no top-2 group score
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers"),
])
def test_refusals_name_the_key(changes, key):
    with pytest.raises(ValueError, match=key):
        parse_model_config(_raw(**changes))
