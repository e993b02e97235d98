"""The MTP drafter on Qwen3-Next (speculative_drafter mtp; docs/design.md section 10): the
checkpoint's own mtp.* head drafts, the gated delta-net verifies.

The model is test_qwen3_next_speculative's (test_qwen3_next's tiny random Qwen3-Next, its LM
head favouring four tokens) with random mtp.* tensors added to its checkpoint (one MTP layer,
its experts stored one by one as published). The LM head is shared, so the head's drafts are
mostly the favoured tokens too, and some are accepted: greedy outputs equal speculation off
over the exactness workload, a stop string inside an accepted run ends the output at the
right character (test_speculative's test, run here on this engine), and requests that restore
an instruction checkpoint draft exactly what they draft from scratch.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine.engine_config import EngineConfig
from engine.models.mtp_head import randomize
from engine.models.qwen3_next import Qwen3NextModel
from engine.models.registry import parse_model_config
from test_qwen3_next import as_published, one_thread  # noqa: F401 (one_thread: autouse fixture)
from test_qwen3_next_speculative import (  # noqa: F401 (engine_off, engine_on: fixtures, of this module's config)
    K,
    engine_off,
    engine_on,
    save_speculating_model,
)
from tests.engine.test_speculative import (  # noqa: F401 (a fixture, built with this module's engines)
    GREEDY,
    _run,
    _stop_string_index,
    check_speculation_equals_off,
    repeating_prompts,
)
from tests.engine.test_speculative import test_stop_string_inside_an_accepted_draft_run as stop_string_test
from tests.engine.test_speculative_mtp import check_restored_drafts_equal_scratch


def add_random_mtp_tensors(directory, seed: int) -> None:
    """Add one MTP layer's mtp.* tensors, drawn by engine/models/mtp_head.py randomize, to the
    checkpoint in `directory`, as a release stores them (experts one by one, the layer count
    left for the engine to read from the tensor names)."""
    raw = json.loads((directory / "config.json").read_text())
    model = Qwen3NextModel(parse_model_config({**raw, "num_nextn_predict_layers": 1}))
    randomize(model.mtp, seed)
    published = {name: value.contiguous() for parameter, tensor in model.mtp.named_parameters(prefix="mtp")
                 for name, value in as_published(parameter, tensor.detach()).items()}
    save_file({**load_file(directory / "model.safetensors"), **published}, str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    """Speculation off, the MTP drafter named; the saved model with its mtp.* tensors."""
    config = save_speculating_model(tmp_path_factory.mktemp("qwen3_next_mtp"))
    # seed 7: all three drafts accepted in the first 24 tokens of two repeating prompts (of 12
    # seeds tried, half had none: the stop-string test stops inside such a run)
    add_random_mtp_tensors(Path(config.model_dir), seed=7)
    return replace(config, speculative_drafter="mtp")


# The later stop rules the stop-string test runs with here. Not a later stop token id: it needs a
# token first seen two after the stop inside one accepted run, and this model's outputs are
# almost only its four favoured tokens (none of the six repeating prompts has one).
LATER_STOPS = (None, "max_tokens")


@pytest.fixture(scope="module")
def free_run(engine_on, repeating_prompts) -> tuple[list[int], list]:
    """test_speculative's fixture of the same name (a repeating prompt and its outputs with
    speculation on, no stop rule) for the first repeating prompt whose outputs hold a
    verification that kept K + 1 tokens (the stop-string test stops inside one, past its
    first token and two before its end) and the token the stop-string test stops inside for
    each of LATER_STOPS (prompt 0 of the six does)."""
    for i, prompt in enumerate(repeating_prompts):
        outputs = _run(engine_on, [(f"free-{i}", prompt, f"free-{i}")], GREEDY)[f"free-{i}"]
        if (any(len(out.new_token_ids) > K for out in outputs[:-1])
                and all(_stop_string_index(outputs, rule) is not None for rule in LATER_STOPS)):
            return prompt, outputs
    pytest.fail(f"no repeating prompt kept {K + 1} tokens in one verification and a token to stop inside")


@pytest.mark.parametrize("later_stop", LATER_STOPS)
def test_stop_string_inside_an_accepted_draft_run(later_stop, engine_on, engine_off, free_run):
    """test_speculative's test of the same name, on this engine (LATER_STOPS says which)."""
    stop_string_test(later_stop, engine_on, engine_off, free_run)


def test_the_checkpoints_head_drafts(engine_on):
    worker = engine_on.executor
    assert worker.drafter.head is worker.model.mtp and worker.model.config.num_mtp_layers == 1
    assert worker.drafter.head.layer_index == worker.model.config.num_hidden_layers


def test_greedy_outputs_equal_speculation_off_over_the_exactness_workload(config, repeating_prompts):
    check_speculation_equals_off(config, K, repeating_prompts, "qwen3_next mtp")


def test_drafts_after_an_instruction_restore_equal_drafts_from_scratch(config):
    """test_speculative_mtp's restore check on Qwen3-Next, where drafts are accepted: 32
    requests over three system prompts, with checkpoints (most restore their instructions)
    and without, draft the same tokens and accept the same ones."""
    stats = check_restored_drafts_equal_scratch(replace(config, num_speculative_tokens=K, async_scheduling=False))
    print(f"\n[qwen3_next mtp restore] proposed={stats.draft_tokens_proposed} accepted={stats.draft_tokens_accepted}")
    assert stats.draft_tokens_accepted > 0
