"""benchmarks/train_mtp_head.py on the CPU with the tiny model (--cpu --steps 20): it writes a
model dir whose trained MTP head the engine loads and drafts with (engine/speculative/mtp.py
load_trained_head), the acceptance by depth the speculation policy reads, and outputs equal to
plain decoding. On the prompts it was trained on the engine's drafts must be accepted about as
often as the head predicted them in training (so the engine runs the trained head, not a
random one); the held-out figure of 8 short training sequences says little and is only
bounded. Its tensors load as shards at tensor_parallel_size 2, each rank's the cut of the
full tensor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from engine.execution.loader import load_model
from engine.parallel.tensor_parallel import TensorParallel, parameter_shards
from engine.speculative.mtp import load_trained_head
from engine.speculative.policy import TRAINED_HEAD_FILE, TRAINED_HEAD_REPORT, trained_head_acceptance

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import train_mtp_head  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tiny-mtp") / "model"
    return out, train_mtp_head.main(["--cpu", "--steps", "20", "--out-dir", str(out)])


def test_training_writes_a_model_dir_the_engine_drafts_with(trained):
    out, report = trained
    assert (out / "config.json").exists() and (out / TRAINED_HEAD_FILE).exists()
    assert json.loads((out / TRAINED_HEAD_REPORT).read_text()) == json.loads(json.dumps(report))
    assert report["final_loss"] < report["first_loss"] / 2, "the head must learn the model's continuations"
    k = report["settings"]["k"]
    for run in (report, report["seen"]):
        assert len(run["acceptance_by_depth"]) == k and all(0.0 <= a <= 1.0 for a in run["acceptance_by_depth"])
        assert run["same_outputs_as_off"], "drafting with the head must not change greedy outputs"
        assert run["depth_proposed"][0] > 0
    assert report["seen"]["acceptance_by_depth"][0] >= 0.5, "the engine must draft with the trained head"
    assert trained_head_acceptance(out) == tuple(report["acceptance_by_depth"])


def test_the_head_loads_as_shards_at_two_ranks(trained):
    out, _ = trained
    full, _ = load_model(out)
    whole = load_trained_head(full, out / TRAINED_HEAD_FILE)
    for rank in range(2):
        model, _ = load_model(out, tp=TensorParallel(rank, 2))
        head = load_trained_head(model, out / TRAINED_HEAD_FILE)
        shards = parameter_shards(head)
        assert shards, "the head's decoder layer is sharded at two ranks"
        for name, parameter in head.named_parameters():
            want = dict(whole.named_parameters())[name]
            if name in shards:
                want = shards[name].cut(want.detach())
            assert torch.equal(parameter, want), name


def test_a_head_file_that_is_not_the_heads_is_refused(trained, tmp_path):
    from safetensors.torch import load_file, save_file

    out, _ = trained
    tensors = load_file(str(out / TRAINED_HEAD_FILE))
    tensors.pop("fc.weight")
    save_file(tensors, str(tmp_path / "head.safetensors"))
    model, _ = load_model(out)
    with pytest.raises(ValueError, match="the MTP head's tensors"):
        load_trained_head(model, tmp_path / "head.safetensors")
