"""GraniteMoeHybrid with routed experts (num_local_experts > 0, top-2 routing plus the shared
MLP, as Granite-4.0-H-Tiny) against transformers' GraniteMoeHybridForCausalLM: same weights,
fp32, CPU, logits within 1e-4 relative (max|a-b| / max|b|) in one chunk, in odd chunks with the
state carried, in mixed batches, and over 32 greedy tokens (a different token only at a
near-tie: reference top-2 logits within 1e-4, counted and printed). Then through LLMEngine on
a saved directory (with the embedded model's tokenizer): instruction reuse, multi-turn and
repeats give the from-scratch outputs with the cached tokens expected; and tp=2 equals tp=1.

The reference models are built by transformers itself (tests/numerics/numerics_support.py)
with norms, dt_bias, A_log and D perturbed away from their constant inits; experts and router
are random normal.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from engine.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.models.granite_moe_hybrid import GraniteMoeHybridModel, parse_config
from engine.models.registry import load_model_config
from engine.parallel.tensor_parallel import TensorParallel
from tests.engine.exactness import Tally, run_workload
from tests.engine.generate_reference import check_engine_matches_generate
from tests.engine.reuse_cases import GREEDY, SYSTEM, chat, instruction_reuse, multi_turn, run
from tests.numerics.numerics_support import (
    TINY_CONFIGS,
    Case,
    PagedRunner,
    Request,
    build_random_case,
    rel_err,
)
from tests.tp import tp_support

TOLERANCE = 1e-4
PROMPT_LEN = 45
EMBEDDED_MODEL_DIR = tp_support.EMBEDDED_MODEL_DIR
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_EXPERTS = dict(intermediate_size=32, num_experts_per_tok=2)
MOE_CONFIGS = {
    "moe8_nope_mamba_heavy": dict(TINY_CONFIGS["nope_mamba_heavy"], num_local_experts=8, **_EXPERTS),
    "moe4_rope_gqa": dict(TINY_CONFIGS["rope_gqa"], num_local_experts=4, **_EXPERTS),
}
# The engine's model: the embedded model's tokenizer (2,048 tokens), so its vocabulary.
ENGINE_CONFIG = dict(
    MOE_CONFIGS["moe8_nope_mamba_heavy"], vocab_size=2048, eos_token_id=0, pad_token_id=1,
    max_position_embeddings=4096,
)


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def case(request, tmp_path_factory) -> Case:
    return build_random_case(request.param, MOE_CONFIGS[request.param], tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    """A saved random MoE model directory with the embedded model's tokenizer files."""
    if not (EMBEDDED_MODEL_DIR / "tokenizer.json").exists():
        pytest.skip(f"the embedded model's tokenizer is not at {EMBEDDED_MODEL_DIR}")
    directory = tmp_path_factory.mktemp("moe_engine")
    build_random_case("moe_engine", ENGINE_CONFIG, directory, seed=3)
    for name in TOKENIZER_FILES:
        shutil.copy(EMBEDDED_MODEL_DIR / name, directory / name)
    return directory


# -- config -------------------------------------------------------------------------------


def test_absent_expert_fields_mean_what_transformers_defaults_to():
    raw = dict(model_type="granitemoehybrid", vocab_size=97, hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, shared_intermediate_size=96, mamba_n_heads=8)
    defaults = GraniteMoeHybridConfig()
    config = parse_config(raw)
    assert config.num_local_experts == defaults.num_local_experts == 8
    assert config.num_experts_per_tok == defaults.num_experts_per_tok == 2
    assert config.intermediate_size == defaults.intermediate_size
    dense = parse_config(dict(raw, num_local_experts=0, num_experts_per_tok=0))
    assert dense.num_local_experts == 0 and dense.num_experts_per_tok == 0
    assert GraniteMoeHybridModel(dense).layers[0].block_sparse_moe is None


@pytest.mark.parametrize("change, key", [
    ({"num_local_experts": None}, "num_local_experts"),
    ({"num_local_experts": -1}, "num_local_experts"),
    ({"num_local_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_local_experts": 4, "num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"num_local_experts": 4, "intermediate_size": 0}, "intermediate_size"),
])
def test_unsupported_expert_fields_are_refused_by_name(change, key):
    raw = dict(model_type="granitemoehybrid", vocab_size=97, hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, shared_intermediate_size=96, mamba_n_heads=8, **change)
    with pytest.raises(ValueError, match=key):
        parse_config(raw)


def test_checkpoint_tensors_keep_their_stacked_names(case: Case):
    names = dict(case.model.named_parameters())
    E, I, D = case.config.num_local_experts, case.config.intermediate_size, case.config.hidden_size
    assert names["layers.0.block_sparse_moe.input_linear.weight"].shape == (E, 2 * I, D)
    assert names["layers.0.block_sparse_moe.output_linear.weight"].shape == (E, D, I)
    assert names["layers.0.block_sparse_moe.router.layer.weight"].shape == (E, D)


# -- numerics against transformers ------------------------------------------------------------


def test_one_chunk_matches_reference(case: Case):
    prompt = case.prompt(PROMPT_LEN, seed=1)
    logits = PagedRunner(case.model).run_in_chunks(Request(state_slot=0), prompt, [])
    error = rel_err(logits, case.reference_logits(prompt))
    print(f"{case.name}: one chunk, max rel err {error:.2e}")
    assert error < TOLERANCE


def test_odd_chunks_match_reference(case: Case):
    prompt = case.prompt(PROMPT_LEN, seed=2)
    logits = PagedRunner(case.model, seed=1).run_in_chunks(Request(state_slot=2), prompt, [3, 5, 7, 1, 3, 5, 7])
    error = rel_err(logits, case.reference_logits(prompt))
    print(f"{case.name}: chunks of 3, 5, 7, 1, 3, 5, 7, 14; max rel err {error:.2e}")
    assert error < TOLERANCE


def test_mixed_batch_matches_reference(case: Case):
    a, b, c = case.prompt(34, seed=3), case.prompt(23, seed=4), case.prompt(20, seed=5)
    runner = PagedRunner(case.model, num_slots=4)
    req_a, req_b, req_c = Request(state_slot=0), Request(state_slot=1), Request(state_slot=2)
    got_a = runner.step([(req_a, a[:12]), (req_b, b[:21])])
    got_a, got_b = got_a[:1], got_a[1:]
    mixed = runner.step([(req_a, a[12:30]), (req_b, b[21:22]), (req_c, c[:9])])
    got_a, got_b, got_c = got_a + mixed[:1], got_b + mixed[1:2], mixed[2:]
    last = runner.step([(req_b, b[22:23]), (req_c, c[9:]), (req_a, a[30:31])])
    got_a, got_b, got_c = got_a + last[2:], got_b + last[:1], got_c + last[1:2]
    errors = []
    for tokens, got in ((a[:31], got_a), (b, got_b), (c, got_c)):
        logits = torch.cat(got)
        assert logits.shape[0] == len(tokens)
        errors.append(rel_err(logits, case.reference_logits(tokens)))
    print(f"{case.name}: mixed batch, max rel err {max(errors):.2e}")
    assert max(errors) < TOLERANCE


def test_greedy_tokens_match_generate(case: Case):
    prompt = case.prompt(19, seed=7)
    num_new = 32
    with torch.no_grad():
        reference = case.reference.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=num_new, min_new_tokens=0,
            eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
    reference_tokens = reference.sequences[0, len(prompt):].tolist()
    reference_logits = [step[0].float() for step in reference.logits]
    assert len(reference_tokens) == num_new
    runner, request = PagedRunner(case.model), Request(state_slot=1)
    step_logits = runner.step([(request, prompt)])[0][-1]
    worst, near_ties = 0.0, 0
    for i, expected in enumerate(reference_tokens):
        worst = max(worst, rel_err(step_logits, reference_logits[i]))
        assert worst < TOLERANCE, f"logits differ at step {i}"
        token = int(step_logits.argmax())
        if token != expected:
            top2 = reference_logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TOLERANCE, f"step {i}: got {token}, reference {expected} (gap {gap})"
            near_ties += 1
            print(f"{case.name}: near-tie at step {i} (top-2 gap {gap:.2e}); rest not compared")
            break
        step_logits = runner.step([(request, [token])])[0][-1]
    print(f"{case.name}: {num_new} greedy tokens, near-ties {near_ties}, max rel err {worst:.2e}")


# -- checkpoint exactness through the engine ---------------------------------------------------


def test_checkpoints_give_from_scratch_outputs(engine_dir):
    engine = LLMEngine(EngineConfig(model_dir=str(engine_dir), max_num_batched_tokens=128, max_num_seqs=8))
    assert engine.executor.model.config.num_local_experts == 8

    first, second, scratch = instruction_reuse(engine, "moe-instructions")
    assert second.boundary is not None
    assert first.cached == 0 and second.cached == second.boundary
    assert scratch.cached == 0 and scratch.tokens == second.tokens

    first, second, scratch = multi_turn(engine, "moe-multi-turn")
    assert second.cached >= len(first.prompt)
    assert scratch.cached == 0 and scratch.tokens == second.tokens

    conversation = chat(SYSTEM, "Repeat after me: seven rivers.")
    once = run(engine, "r1", conversation, "moe-repeat")
    again = run(engine, "r2", conversation, "moe-repeat")
    assert again.cached == len(again.prompt) and again.chunk_sizes[0] == 0
    assert again.tokens == once.tokens and len(once.tokens) == GREEDY.max_tokens

    tally = Tally()
    run_workload(engine, seed=5, num_requests=8, tally=tally)
    print(f"moe engine: workload requests={tally.requests} hits={tally.hits} "
          f"cached_tokens={tally.cached_tokens} near_ties={tally.near_ties}")
    assert tally.hits > 0
    assert engine.pool_usage().idle


def test_engine_greedy_output_equals_generate(engine_dir):
    """LLMEngine's own greedy output on the MoE model equals transformers' generate()
    (tests/engine/generate_reference.py)."""
    reference = GraniteMoeHybridForCausalLM.from_pretrained(
        engine_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
    engine = LLMEngine(EngineConfig(model_dir=str(engine_dir), max_num_batched_tokens=40, max_num_seqs=8))
    assert engine.executor.model.config.num_local_experts == 8
    check_engine_matches_generate(engine, reference, "granite moe engine")


# -- tensor parallelism -------------------------------------------------------------------------


def test_tp2_matches_tp1(engine_dir, tmp_path):
    torch.set_num_threads(1)
    single = tp_support.run_model(engine_dir, TensorParallel.single())
    ranks = tp_support.run_world(2, {"moe": engine_dir}, tmp_path)["moe"]
    config = load_model_config(engine_dir)
    assert single["tokens"].unique().numel() > 5, "degenerate greedy outputs test nothing"
    experts_per_layer = lambda world: config.num_local_experts * (  # noqa: E731
        config.hidden_size + 3 * config.hidden_size * config.intermediate_size // world)
    for rank, got in enumerate(ranks):
        assert torch.equal(got["tokens"], single["tokens"]), f"rank {rank}"
        error = rel_err(got["logits"], single["logits"])
        print(f"moe tp=2 rank {rank}: logits max rel err {error:.2e}")
        assert error < TOLERANCE
        assert rel_err(got["restored"], single["whole"]) < TOLERANCE
        expected = tp_support.expected_rank_elements(config, 2, rank)
        assert got["num_elements"] == expected + config.num_hidden_layers * experts_per_layer(2)
    assert single["num_elements"] == (
        tp_support.expected_rank_elements(config, 1, 0) + config.num_hidden_layers * experts_per_layer(1)
    )
