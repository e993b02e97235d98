"""Every model family served by LLMEngine at tensor_parallel_size 2 (issue 22, point 3).

The family modules check tp=2 at the model level (gloo ranks running the model directly,
hf_reference_checks.check_tp2_matches_tp1); here the engine serves each family over its
spawned rank processes (engine/execution/multiprocess_executor.py), with checkpoints captured, split
into per-rank shards and restored, against a tp=1 engine with the same configuration.

For each family, a tiny random model of that family built as its own module builds its engine
model (hf_reference_checks.save_engine_model: the embedded model's tokenizer and vocabulary),
one tp=2 engine and one tp=1 engine (module-scoped, one family at a time, the tp=2 ranks shut
down after). Each of reuse_cases' instruction reuse, multi-turn and repeat runs on both engines
through hf_reference_checks' check_* functions (each engine's outputs equal its from-scratch
runs, cached tokens as expected), then the tp=2 runs are compared with tp=1's: same cached
tokens (tp=2 restores what tp=1 restores), same tokens, logits within 1e-4.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    FalconH1Config,
    FalconH1ForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from engine.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from hf_reference_checks import (
    check_instruction_reuse,
    check_multi_turn,
    check_repeat,
    save_engine_model,
    without_none,
)
from test_bamba import BASE as BAMBA
from test_falcon_h1 import CASES as FALCON_H1_CASES
from test_granite_moe import MOE_CONFIGS
from test_nemotron_h import BASE as NEMOTRON_H
from test_qwen3_next import BASE as QWEN3_NEXT
from test_qwen3_next import perturb_constant_init as perturb_qwen3_next
from tests.engine.reuse_cases import Alone, assert_same_as_reference

# The family modules' engine configuration (chunked prefill over several steps).
ENGINE = dict(max_num_batched_tokens=40, max_num_seqs=8)

# family -> save(directory): a random engine model from the family module's configurations.
# Falcon-H1: the case with one Mamba group normed after the gate, so the grouped norm spans both
# ranks (test_falcon_h1's engine model, BASE, greedily repeats one token at this vocabulary).
FAMILIES: dict[str, Callable[[Path], Path]] = {
    "granitemoehybrid": lambda d: save_engine_model(
        GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, without_none(MOE_CONFIGS["moe8_nope_mamba_heavy"]), d),
    "nemotron_h": lambda d: save_engine_model(NemotronHConfig, NemotronHForCausalLM, without_none(NEMOTRON_H), d),
    "bamba": lambda d: save_engine_model(BambaConfig, BambaForCausalLM, without_none(BAMBA), d),
    "falcon_h1": lambda d: save_engine_model(
        FalconH1Config, FalconH1ForCausalLM, FALCON_H1_CASES["norm_after_gate"], d),
    "qwen3_next": lambda d: save_engine_model(
        Qwen3NextConfig, Qwen3NextForCausalLM, without_none(QWEN3_NEXT), d, perturb=perturb_qwen3_next),
}


class Engines:
    """One family's tp=2 engine and its tp=1 reference."""

    def __init__(self, family: str, model_dir: Path) -> None:
        self.family = family
        self.tp1 = LLMEngine(EngineConfig(model_dir=str(model_dir), **ENGINE))
        self.tp2 = LLMEngine(EngineConfig(model_dir=str(model_dir), tensor_parallel_size=2, **ENGINE))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for the tp=1 engine, as each of the two ranks runs on a 2-core box."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=list(FAMILIES))
def engines(request, tmp_path_factory):
    family = request.param
    built = Engines(family, FAMILIES[family](tmp_path_factory.mktemp(f"{family}_engine")))
    assert built.tp1.executor.model.config.model_type == family
    yield built
    built.tp2.shutdown()
    built.tp1.shutdown()


def assert_tp2_as_tp1(got: tuple[Alone, ...], want: tuple[Alone, ...], labels: tuple[str, ...]) -> None:
    for label, g, w in zip(labels, got, want, strict=True):
        assert_same_as_reference(g, w, label)


def test_instruction_reuse_restores_what_tp1_restores(engines: Engines):
    got = check_instruction_reuse(engines.tp2, engines.family)
    want = check_instruction_reuse(engines.tp1, engines.family)
    assert len({t for run in want for t in run.tokens}) > 5, "degenerate greedy outputs test nothing"
    assert_tp2_as_tp1(got, want, ("first", "second", "scratch"))


def test_multi_turn_restores_what_tp1_restores(engines: Engines):
    got = check_multi_turn(engines.tp2, engines.family)
    want = check_multi_turn(engines.tp1, engines.family)
    assert_tp2_as_tp1(got, want, ("turn 1", "turn 2", "turn 2 scratch"))


def test_repeat_restores_the_whole_prompt_as_tp1(engines: Engines):
    got = check_repeat(engines.tp2, engines.family)
    want = check_repeat(engines.tp1, engines.family)
    assert_tp2_as_tp1(got, want, ("first", "repeat"))
    assert engines.tp2.pool_usage().idle
