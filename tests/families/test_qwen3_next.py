"""Qwen3-Next (engine/models/qwen3_next.py) against transformers' Qwen3NextForCausalLM.

Tiny random models made with transformers (fp32, CPU, eager attention; the zero-centred norms,
the gated delta-net's norm, A_log and dt_bias drawn instead of transformers' constant inits so
a misplaced term shows), one with routed experts and a gated shared expert in every layer, one
dense, one mixing dense and sparse layers (mlp_only_layers, decoder_sparse_step), saved with
save_pretrained (experts one by one, as published) and loaded by the engine's loader:
- each layer's MLP kind is the one transformers builds;
- logits within 1e-4 relative (max|a-b| / max|b|) in one chunk, in odd chunks with the state
  carried, and with several requests in one forward; 32 greedy tokens equal to generate()'s
  (a near-tie, top-2 reference logits within 1e-4, is counted and stops the comparison);
- the gated delta rule reference gives the same outputs and state for any chunking, chunk
  size and one-token steps;
- the checkpoint exactness cases through LLMEngine (tests/engine/reuse_cases.py: instruction
  reuse, multi-turn, repeats) on a saved model with the embedded model's tokenizer: the gated
  delta-net's state rides in the engine's state slots, checkpoints and import checks;
- tensor parallel: tp=2 (gloo ranks, tests/tp/tp_support.py; one key head and its value heads,
  half of every expert's and every dense MLP's channels per rank) equals tp=1, on the mixed model;
- mtp.* tensors load into model.mtp; spellings accepted and refusals named by key.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from engine.parallel.cache_capacity import recurrent_state_shape
from engine.checkpoints.import_checks import expected_shard_layout
from engine.engine_config import EngineConfig
from engine.kernels.gated_delta_rule_reference import (
    chunk_gated_delta_rule, gated_delta_rule_step, l2_normalize,
)
from engine.core.llm_engine import LLMEngine
from engine.execution.loader import load_model
from engine.model_config import ATTENTION, GATED_DELTA_NET
from engine.layers.mlp import SplitGatedMLP
from engine.models.qwen3_next import Qwen3NextModel, SparseMoeBlock
from engine.models.registry import load_model_config, parse_model_config
from engine.parallel.shard_layout import rank_shard_layout
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
from paged_runner import PagedRunner, Request
from tests.engine.exactness import Tally, run_workload
from tests.tp.tp_support import run_model, run_world

# Alternating gated delta-net and gated attention; 2 key heads of 8 channels serving 4 value
# heads of 16 (grouped value attention), GQA with head_dim * heads != hidden_size, RoPE on
# half of each head; 6 routed experts (2 a token) and a gated shared expert in every layer.
BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
# Dense: a MoE config whose every layer is dense (mlp_only_layers); the default layer pattern
# (every 4th layer full attention), tied embeddings, a 3-tap conv, one value head per key head.
VARIANT = dict(
    BASE,
    num_hidden_layers=4,
    layer_types=None,
    tie_word_embeddings=True,
    linear_conv_kernel_dim=3,
    linear_num_value_heads=2,
    mlp_only_layers=[0, 1, 2, 3],
)
# Mixed: decoder_sparse_step 2 leaves layers 0 and 2 dense, mlp_only_layers layer 3; layer 1 (a
# full-attention layer between dense ones) holds the experts. The dense MLPs are
# intermediate_size (96) wide, the shared expert 48.
MIXED = dict(BASE, decoder_sparse_step=2, mlp_only_layers=[3])
CASES = {"experts": BASE, "dense": VARIANT, "mixed": MIXED}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for this module's tiny tensors: on the shared 2-core CI box several
    threads per op only contend (the odd-chunks run took 12 s with the default, 0.2 s with one)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@torch.no_grad()
def perturb_constant_init(reference: Qwen3NextForCausalLM, seed: int) -> None:
    """transformers sets the zero-centred norms to 0, the gated norm to 1 and dt_bias to 1:
    draw them (and A_log), so a per-head, per-channel or misplaced term changes the output."""
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in reference.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("linear_attn.norm.weight"):
            param.copy_(1.0 + 0.3 * noise)
        elif name.endswith("norm.weight"):
            param.copy_(0.3 * noise)
        elif name.endswith("dt_bias"):
            param.copy_(0.7 * noise)
        elif name.endswith("A_log"):
            param.copy_(torch.log(torch.rand(param.shape, generator=generator) * 8 + 0.5))


def save_reference(hf_kwargs: dict, directory: Path) -> Qwen3NextForCausalLM:
    return save_hf_reference(
        Qwen3NextConfig, Qwen3NextForCausalLM, without_none(hf_kwargs), directory,
        perturb=perturb_constant_init,
    )


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    directory = tmp_path_factory.mktemp(request.param)
    return Case(Qwen3NextConfig, Qwen3NextForCausalLM, without_none(CASES[request.param]), directory,
                perturb_constant_init)


def test_checkpoint_loads_with_both_mixers(case: Case):
    assert isinstance(case.model, Qwen3NextModel)
    assert set(case.config.layer_types) == {GATED_DELTA_NET, ATTENTION}
    assert case.config.recurrent_layers == [i for i, k in enumerate(case.config.layer_types) if k == GATED_DELTA_NET]
    caches = case.model.allocate_caches(4, 16, 2)
    c = case.config
    conv_dim = 2 * c.linear_key_dim + c.linear_value_dim
    for layer in c.recurrent_layers:  # the engine's two state slot tensors, gated delta-net shapes
        assert caches.conv_state[layer].shape == (2, conv_dim, c.linear_conv_kernel_dim - 1)
        assert caches.ssm_state[layer].shape == (
            2, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    layout = expected_shard_layout(c, TensorParallel.single(), "float32")
    assert layout.conv_state == (len(c.recurrent_layers), conv_dim, c.linear_conv_kernel_dim - 1)
    assert case.model.mtp is None
    assert case.config.num_local_experts in (0, 6)
    assert_mlp_kinds_as_transformers(case.model, case.reference)


def assert_mlp_kinds_as_transformers(model: Qwen3NextModel, reference: Qwen3NextForCausalLM) -> None:
    """Each layer's MLP is a SparseMoeBlock exactly where transformers built a sparse block,
    otherwise a SplitGatedMLP of the reference MLP's width."""
    assert len(model.layers) == len(reference.model.layers)
    for i, (layer, theirs) in enumerate(zip(model.layers, reference.model.layers)):
        if isinstance(theirs.mlp, Qwen3NextSparseMoeBlock):
            assert isinstance(layer.mlp, SparseMoeBlock), i
        else:
            assert isinstance(layer.mlp, SplitGatedMLP), i
            assert layer.mlp.gate_proj.weight.shape == theirs.mlp.gate_proj.weight.shape, i


def test_one_chunk_matches_reference(case: Case):
    check_one_chunk(case)


def test_odd_chunks_match_reference(case: Case):
    check_odd_chunks(case)


def test_batched_requests_match_reference(case: Case):
    check_batched(case)


def test_32_greedy_tokens_match_generate(case: Case):
    check_greedy(case)


# ---- the gated delta rule reference ---------------------------------------------------------


def test_reference_is_chunking_invariant():
    """Any pieces (state carried), any chunk size, and one-token steps: same outputs and state."""
    generator = torch.Generator().manual_seed(5)
    T, H, K, V = 53, 3, 8, 12
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    q, k = l2_normalize(randn(T, H, K)), l2_normalize(randn(T, H, K))
    v, g = randn(T, H, V), -2 * torch.rand(T, H, generator=generator)
    beta = torch.rand(T, H, generator=generator)
    state0 = 0.1 * randn(H, K, V)
    scale = K ** -0.5
    whole, final = chunk_gated_delta_rule(q, k, v, g, beta, state0, scale, chunk_size=64)
    for chunk_size in (1, 5, 16):
        out, state = chunk_gated_delta_rule(q, k, v, g, beta, state0, scale, chunk_size)
        assert rel_err(out, whole) < 1e-5 and rel_err(state, final) < 1e-5, chunk_size
    pieces, state, start = [], state0, 0
    for size in (3, 17, 1, 9, 23):
        out, state = chunk_gated_delta_rule(
            q[start:start + size], k[start:start + size], v[start:start + size],
            g[start:start + size], beta[start:start + size], state, scale, chunk_size=8)
        pieces.append(out)
        start += size
    assert rel_err(torch.cat(pieces), whole) < 1e-5 and rel_err(state, final) < 1e-5
    steps, state = [], state0[None]
    for t in range(T):
        out, state = gated_delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                           beta[t:t + 1], state, scale)
        steps.append(out)
    assert rel_err(torch.cat(steps), whole) < 1e-5 and rel_err(state[0], final) < 1e-5


# ---- multi-token prediction weights ---------------------------------------------------------


def as_published(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """A parameter of ours as a published checkpoint stores it: a sparse block's router as
    mlp.gate, its stacked experts one by one (gate_proj, up_proj, down_proj)."""
    if name.endswith("mlp.experts.router.layer.weight"):
        return {name.replace("experts.router.layer.weight", "gate.weight"): value}
    stem = name.removesuffix(".input_linear.weight").removesuffix(".output_linear.weight")
    if name.endswith("input_linear.weight"):
        half = value.shape[1] // 2
        return {**{f"{stem}.{e}.gate_proj.weight": w[:half] for e, w in enumerate(value)},
                **{f"{stem}.{e}.up_proj.weight": w[half:] for e, w in enumerate(value)}}
    if name.endswith("output_linear.weight"):
        return {f"{stem}.{e}.down_proj.weight": w for e, w in enumerate(value)}
    return {name: value}


@pytest.mark.parametrize("case", ["experts", "dense"], indirect=True)  # mixed + MTP: refused
def test_mtp_tensors_load_into_model_mtp(case: Case, tmp_path):
    """A checkpoint with mtp.* tensors (experts one by one) and num_nextn_predict_layers: they
    load into model.mtp, and the logits do not change."""
    directory = tmp_path / "with_mtp"
    shutil.copytree(case.directory, directory)
    raw = json.loads((directory / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(raw))
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Qwen3NextModel(parse_model_config(raw)).named_parameters()
                  if name.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= set(shapes)
    generator = torch.Generator().manual_seed(3)
    mtp = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    published = {k: v.contiguous() for name, value in mtp.items() for k, v in as_published(name, value).items()}
    save_file({**load_file(directory / "model.safetensors"), **published}, str(directory / "model.safetensors"))
    model, _ = load_model(directory)
    loaded = dict(model.mtp.named_parameters(prefix="mtp"))
    assert set(loaded) == set(mtp) and all(torch.equal(loaded[n], mtp[n]) for n in mtp)
    # as published: config.json without the key, the layer count read from the tensor names
    del raw["num_nextn_predict_layers"]
    (directory / "config.json").write_text(json.dumps(raw))
    assert load_model_config(directory).num_mtp_layers == 1
    assert load_model_config(case.directory).num_mtp_layers == 0
    prompt = case.prompt(20, seed=9)
    with_mtp = PagedRunner(model).run_in_chunks(Request(state_slot=0), prompt, [])
    without = PagedRunner(case.model).run_in_chunks(Request(state_slot=0), prompt, [])
    assert torch.equal(with_mtp, without)


# ---- checkpoints through LLMEngine ---------------------------------------------------------


@pytest.fixture(scope="module")
def engine_model_dir(tmp_path_factory) -> Path:
    """BASE saved with the embedded model's vocabulary and tokenizer (save_engine_model)."""
    return save_engine_model(Qwen3NextConfig, Qwen3NextForCausalLM, without_none(BASE), tmp_path_factory.mktemp("qwen3_next_engine"))


@pytest.fixture(scope="module")
def engine(engine_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(engine_model_dir), max_num_batched_tokens=40, max_num_seqs=8))


def test_engine_runs_qwen3_next(engine):
    model = engine.executor.model
    assert model.config.model_type == "qwen3_next"
    assert model.state_bytes_per_slot() > 0 and engine.executor.checkpoints is not None


def test_instruction_reuse_matches_scratch(engine):
    check_instruction_reuse(engine, "qn")


def test_multi_turn_matches_scratch(engine):
    check_multi_turn(engine, "qn")


def test_repeat_runs_no_prefill(engine):
    check_repeat(engine, "qn")


def test_engine_greedy_output_equals_generate(engine):
    check_engine_greedy(engine, Qwen3NextForCausalLM, "qwen3_next engine")


def test_an_attention_only_model_serves_and_reuses(tmp_path):
    """A config with full-attention layers only (no recurrent state; its Mamba-sized fields
    unset) starts (state slots of 0 bytes, one a sequence) and reuses its KV checkpoints as
    the hybrid does."""
    model_dir = save_engine_model(Qwen3NextConfig, Qwen3NextForCausalLM,
                                  without_none(dict(BASE, layer_types=["full_attention"] * 4)), tmp_path)
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), max_num_batched_tokens=40, max_num_seqs=8))
    assert engine.executor.model.state_bytes_per_slot() == 0
    assert engine.executor.capacity.num_state_slots == 8
    check_instruction_reuse(engine, "qn-attention-only")
    check_multi_turn(engine, "qn-attention-only")


def test_exactness_workload_matches_scratch(engine):
    """The exactness suite's randomized chat workload (16 requests, each also run from scratch
    in the same batches): identical greedy tokens, logits within 1e-4, near-ties counted."""
    tally = Tally()
    run_workload(engine, seed=3, num_requests=16, tally=tally)
    print(f"qwen3_next workload: requests={tally.requests} hits={tally.hits} "
          f"cached_tokens={tally.cached_tokens} near_ties={tally.near_ties}")
    assert tally.requests == 16 and tally.hits > 0
    assert engine.pool_usage().idle


# ---- tensor parallel -------------------------------------------------------------------------


def test_tp2_matches_tp1(tmp_path):
    """tp_support's greedy batch and stop-and-continue: tp=2 (two gloo ranks, each with one
    key head and its two value heads, half of the channels of every expert, of the shared
    expert and of the dense MLPs) against tp=1 in process, on the mixed model (a sparse layer
    and dense ones)."""
    model_dir = tmp_path / "model"
    save_reference(dict(MIXED, vocab_size=101), model_dir)
    torch.set_num_threads(1)
    single = run_model(model_dir, TensorParallel.single())
    ranks = run_world(2, {"qwen3_next": model_dir}, tmp_path / "tp2")["qwen3_next"]
    config = parse_model_config(json.loads((model_dir / "config.json").read_text()))
    for rank, got in enumerate(ranks):
        assert torch.equal(got["tokens"], single["tokens"])
        assert rel_err(got["logits"], single["logits"]) < TOLERANCE
        for key in ("whole", "copied", "restored"):
            assert rel_err(got[key], single["whole"]) < TOLERANCE, key
        assert got["num_elements"] < single["num_elements"]
        (conv_dim, _), recurrent = recurrent_state_shape(config, rank_shard_layout(config, TensorParallel(rank, 2)))
        for conv, state in got["state_shapes"].values():
            assert conv[0] == conv_dim and state == recurrent == (2, 8, 16)
    print(f"tp=2: tokens equal, logits max relative error "
          f"{max(rel_err(r['logits'], single['logits']) for r in ranks):.2e}")


# ---- config spellings and refusals ---------------------------------------------------------


def _raw(**changes) -> dict:
    raw = dict(model_type="qwen3_next", vocab_size=97, hidden_size=64, intermediate_size=96,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=16, num_experts=0)
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


def test_spellings_agree():
    listed = parse_model_config(_raw(layer_types=["linear_attention"] * 3 + ["full_attention"],
                                     rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25}))
    default = parse_model_config(_raw(rope_theta=10000.0, partial_rotary_factor=0.25))
    assert listed == default
    assert default.layer_types == (GATED_DELTA_NET,) * 3 + (ATTENTION,)
    assert default.rotary_dim == 4 and default.attention_multiplier == 16 ** -0.5
    dense_moe = parse_model_config(_raw(num_experts=8, decoder_sparse_step=5))  # no layer sparse
    assert dense_moe.layer_types == default.layer_types and dense_moe.num_local_experts == 0
    assert dense_moe.shared_intermediate_size == 96
    sparse = parse_model_config(_raw(num_experts=None, num_experts_per_tok=None))  # transformers' defaults
    assert (sparse.num_local_experts, sparse.num_experts_per_tok, sparse.norm_topk_prob) == (512, 10, True)
    assert (sparse.intermediate_size, sparse.shared_intermediate_size) == (512, 512)
    assert parse_model_config(_raw(mtp_num_hidden_layers=1)).num_mtp_layers == 1
    mixed = parse_model_config(_raw(num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3],
                                    moe_intermediate_size=32, shared_expert_intermediate_size=48))
    assert mixed.dense_mlp_layers == (0, 2, 3) and mixed.num_local_experts == 8
    assert [mixed.has_routed_experts(i) for i in range(4)] == [False, True, False, False]
    assert (mixed.intermediate_size, mixed.shared_intermediate_size, mixed.dense_intermediate_size) == (32, 48, 96)
    layout = rank_shard_layout(mixed, TensorParallel(1, 2))
    assert (layout.expert_channels, layout.mlp_channels, layout.dense_mlp_channels) == ((16, 32), (24, 48), (48, 96))
    assert rank_shard_layout(default, TensorParallel(1, 2)).dense_mlp_channels == (0, 0)


@pytest.mark.parametrize("changes", [
    dict(decoder_sparse_step=2),
    dict(mlp_only_layers=[0, 4]),
    dict(decoder_sparse_step=3, mlp_only_layers=[5]),
    dict(num_experts=0, decoder_sparse_step=2, mlp_only_layers=[1]),
], ids=["step", "only-layers", "both", "no-experts"])
def test_mlp_kinds_as_transformers_chooses(changes):
    """Each layer's MLP kind and width (meta tensors) against the model transformers builds
    from the same config."""
    raw = _raw(**{**dict(num_hidden_layers=6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48), **changes})
    with torch.device("meta"):
        reference = Qwen3NextForCausalLM(Qwen3NextConfig(**{k: v for k, v in raw.items() if k != "model_type"}))
        model = Qwen3NextModel(parse_model_config(raw))
    assert_mlp_kinds_as_transformers(model, reference)


@pytest.mark.parametrize("changes, key", [
    (dict(num_experts=8, decoder_sparse_step=2, num_nextn_predict_layers=1), "num_nextn_predict_layers"),
    (dict(num_experts=8, num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(layer_types=["mamba"] * 4), "layer_types"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type"),
    (dict(num_attention_heads=3), "num_key_value_heads"),
])
def test_refusals_name_the_key(changes, key):
    with pytest.raises(ValueError, match=key):
        parse_model_config(_raw(**changes))


def test_tp_splits_key_heads_or_refuses_by_name():
    config = parse_model_config(_raw())
    layout = rank_shard_layout(config, TensorParallel(1, 2))
    assert (layout.linear_key_heads, layout.linear_value_heads) == ((1, 2), (2, 4))
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        rank_shard_layout(parse_model_config(_raw(linear_num_key_heads=1, linear_num_value_heads=4)),
                          TensorParallel(0, 2))
