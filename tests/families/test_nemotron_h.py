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
- both block-pattern spellings, and the refusals, by name of the key.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from engine.config import DEFAULT_MODEL_DIR, EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.model_config import ATTENTION, MAMBA, MLP
from engine.models.nemotron_h import NemotronHModel
from engine.models.registry import parse_model_config
from engine.tensor_parallel import TensorParallel
from paged_runner import PagedRunner, Request
from tests.engine.reuse_cases import GREEDY, SYSTEM, chat, instruction_reuse, multi_turn, run
from tests.tp.tp_support import run_model, run_world

TOLERANCE = 1e-4
PROMPT_LEN = 45  # several KV blocks of 16 and SSD chunks of 16, with a partial tail

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


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|a - b| / max|b|."""
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


@torch.no_grad()
def perturb_constant_init(reference: NemotronHForCausalLM, seed: int) -> None:
    """transformers sets norms to 1, D and dt_bias to 1, A_log to log(1..H) and biases to 0:
    draw them, so that a per-head, per-channel or misplaced term changes the output."""
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in reference.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            param.copy_(1.0 + 0.3 * noise)
        elif name.endswith("dt_bias"):
            param.copy_(0.7 * noise)
        elif name.endswith("A_log"):
            param.copy_(torch.log(torch.rand(param.shape, generator=generator) * 8 + 0.5))
        elif name.endswith(".D"):
            param.copy_(noise)
        elif name.endswith("bias"):
            param.copy_(0.1 * noise)


def save_reference(hf_kwargs: dict, directory: Path, seed: int = 0) -> NemotronHForCausalLM:
    torch.manual_seed(seed)
    kwargs = {k: v for k, v in hf_kwargs.items() if v is not None}
    reference = NemotronHForCausalLM(NemotronHConfig(**kwargs, attn_implementation="eager")).eval()
    perturb_constant_init(reference, seed)
    reference.save_pretrained(directory)
    return reference


class Case:
    def __init__(self, hf_kwargs: dict, directory: Path) -> None:
        self.reference = save_reference(hf_kwargs, directory)
        self.model, self.config = load_model(directory)
        self.directory = directory

    def prompt(self, length: int, seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.config.vocab_size, (length,), generator=generator).tolist()

    @torch.no_grad()
    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        return self.reference(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module", params=["layers_block_type", "hybrid_override_pattern"])
def case(request, tmp_path_factory) -> Case:
    kwargs = BASE if request.param == "layers_block_type" else PATTERN
    return Case(kwargs, tmp_path_factory.mktemp(request.param))


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
    prompt = case.prompt(PROMPT_LEN, seed=1)
    logits = PagedRunner(case.model).run_in_chunks(Request(state_slot=0), prompt, [])
    error = rel_err(logits, case.reference_logits(prompt))
    print(f"one chunk: max relative error {error:.2e}")
    assert error < TOLERANCE


def test_odd_chunks_match_reference(case: Case):
    prompt = case.prompt(PROMPT_LEN, seed=2)
    sizes = [3, 5, 7, 3, 5, 7, 1, 3]  # the rest (11) in a last chunk
    logits = PagedRunner(case.model, seed=1).run_in_chunks(Request(state_slot=2), prompt, sizes)
    error = rel_err(logits, case.reference_logits(prompt))
    print(f"odd chunks: max relative error {error:.2e}")
    assert error < TOLERANCE


def test_batched_requests_match_reference(case: Case):
    a, b, c = case.prompt(34, seed=3), case.prompt(23, seed=4), case.prompt(20, seed=5)
    runner = PagedRunner(case.model, num_slots=4)
    req_a, req_b, req_c = Request(state_slot=0), Request(state_slot=1), Request(state_slot=2)
    runner.step([(Request(state_slot=2), case.prompt(9, seed=6))])  # C's slot dirty: must reset
    first = runner.step([(req_a, a[:12]), (req_b, b[:21])])
    # A mid-prefill, B decoding, C starting: one ForwardBatch
    mixed = runner.step([(req_a, a[12:30]), (req_b, b[21:22]), (req_c, c[:9])])
    last = runner.step([(req_b, b[22:23]), (req_c, c[9:]), (req_a, a[30:31])])
    got = {
        "a": (a[:31], [first[0], mixed[0], last[2]]),
        "b": (b, [first[1], mixed[1], last[0]]),
        "c": (c, [mixed[2], last[1]]),
    }
    for name, (tokens, pieces) in got.items():
        logits = torch.cat(pieces)
        assert logits.shape[0] == len(tokens)
        error = rel_err(logits, case.reference_logits(tokens))
        print(f"batched request {name}: max relative error {error:.2e}")
        assert error < TOLERANCE


def test_32_greedy_tokens_match_generate(case: Case):
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
    worst, compared = 0.0, 0
    for i, expected in enumerate(reference_tokens):
        error = rel_err(step_logits, reference_logits[i])
        worst = max(worst, error)
        assert error < TOLERANCE, f"logits differ at step {i} ({error:.2e})"
        token = int(step_logits.argmax())
        compared += 1
        if token != expected:
            top2 = reference_logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TOLERANCE, f"step {i}: got {token}, reference {expected} (gap {gap})"
            print(f"near-tie at step {i} (top-2 gap {gap:.2e}); {compared} tokens compared")
            return
        step_logits = runner.step([(request, [token])])[0][-1]
    print(f"greedy: {compared} tokens identical, 0 near-ties, max relative error {worst:.2e}")


# ---- checkpoints through LLMEngine ---------------------------------------------------------


@pytest.fixture(scope="module")
def engine_model_dir(tmp_path_factory) -> Path:
    """A saved random Nemotron-H with the embedded model's tokenizer (vocabulary sized to it)."""
    directory = tmp_path_factory.mktemp("nemotron_h_engine")
    embedded = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    save_reference(
        dict(BASE, vocab_size=embedded["vocab_size"], max_position_embeddings=1024,
             eos_token_id=embedded.get("eos_token_id"), pad_token_id=embedded.get("pad_token_id")),
        directory,
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (DEFAULT_MODEL_DIR / name).exists():
            shutil.copy(DEFAULT_MODEL_DIR / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def engine(engine_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(engine_model_dir), max_num_batched_tokens=40, max_num_seqs=8))


def test_engine_runs_nemotron_h(engine):
    assert engine.executor.model.config.model_type == "nemotron_h"


def test_instruction_reuse_matches_scratch(engine):
    first, second, scratch = instruction_reuse(engine, "nh-instruction")
    assert first.cached == 0 and second.boundary is not None
    assert second.cached == second.boundary
    assert sum(second.chunk_sizes) == len(second.prompt) - second.boundary + GREEDY.max_tokens - 1
    assert scratch.cached == 0 and scratch.tokens == second.tokens


def test_multi_turn_matches_scratch(engine):
    first, second, scratch = multi_turn(engine, "nh-multi-turn")
    assert second.cached >= len(first.prompt)
    assert scratch.cached == 0 and scratch.tokens == second.tokens


def test_repeat_runs_no_prefill(engine):
    conversation = chat(SYSTEM, "Repeat after me: seven rivers.")
    first = run(engine, "nh-r1", conversation, "nh-repeat")
    second = run(engine, "nh-r2", conversation, "nh-repeat")
    assert second.cached == len(second.prompt) and second.chunk_sizes[0] == 0
    assert second.tokens == first.tokens and second.text == first.text


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
    (dict(hybrid_override_pattern="M*E"), "hybrid_override_pattern"),
    (dict(layers_block_type=["mamba", "moe"]), "layers_block_type"),
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
