"""Which GPU path a Mamba2Mixer takes for a step: the step's plan chooses (kernel_choices, when
the plan is built), the mixer follows the plan (the paths themselves are device tests in
tests/gpu/test_mamba_decode.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.kernels.gpu.batch_plan import FUSED_DECODE_MAX_ROWS, kernel_choices
from engine.execution.loader import load_model


@pytest.fixture(scope="module")
def mixer():
    model, _ = load_model(DEFAULT_MODEL_DIR)
    return next(layer.mamba for layer in model.layers if layer.mamba is not None)


def _choices(rows: int, num_decode: int, num_prefill: int, in_pass, fold_gated_norm: bool) -> dict:
    return kernel_choices(rows, num_decode, num_prefill, in_pass=in_pass is not None,
                          fold_gated_norm=fold_gated_norm)


@pytest.mark.parametrize("num_decode, num_prefill, in_pass, expected", [
    (1, 0, None, "fused"),
    (FUSED_DECODE_MAX_ROWS, 0, None, "fused"),
    (FUSED_DECODE_MAX_ROWS + 1, 0, None, "chunks"),  # large batches: the unfused pair is faster
    (3, 1, None, "chunks"),  # a prefill chunk in the step
    (2, 0, "capture", "chunks"),  # an in-pass capture (in a decode-only plan, as a guard)
    (0, 1, "capture", "chunks"),
])
def test_mix_batch_gpu_routes_by_step_shape(mixer, monkeypatch, num_decode, num_prefill, in_pass, expected):
    taken = []
    monkeypatch.setattr(mixer, "mix_decode_only_gpu", lambda *args: taken.append("fused"))
    monkeypatch.setattr(mixer, "mix_chunks_gpu", lambda *args: taken.append("chunks"))
    choices = _choices(num_decode + 5 * num_prefill, num_decode, num_prefill, in_pass, fold_gated_norm=True)
    plan = SimpleNamespace(num_decode=num_decode, num_prefill=num_prefill, in_pass=in_pass, verification=None,
                           **choices)
    mixer.mix_batch_gpu(None, None, None, None, plan)
    assert taken == [expected]


@pytest.mark.parametrize("rows, num_prefill, in_pass, out_proj_takes_it, folds", [
    (1, 0, None, True, True),  # batch-1 decode: the gated norm folds into its neighbours
    (2, 0, None, True, False),  # two rows: the norm's own kernel (the GEMM is cuBLAS's)
    (1, 1, None, True, False),  # a one-token prefill chunk
    (1, 0, "capture", True, False),
    (1, 0, None, False, False),  # out_proj's GEMM cannot take it (CPU, an odd layout)
])
def test_gated_norm_folds_only_into_one_decode_row(mixer, monkeypatch, rows, num_prefill, in_pass,
                                                   out_proj_takes_it, folds):
    monkeypatch.setattr(mixer.out_proj, "supports_row_rms", lambda x: out_proj_takes_it)
    num_decode = 0 if num_prefill else rows
    choices = _choices(rows, num_decode, num_prefill, in_pass, fold_gated_norm=mixer.folds_gated_norm())
    assert choices["folded_gated_norm"] == folds
    if folds:  # the mixer follows the plan: the folded path, over a (1, I) row
        taken = []
        monkeypatch.setattr(mixer, "mix_row_folded_gpu", lambda gate, *args: taken.append(gate.shape))
        mixer(torch.zeros(1, mixer.in_proj.weight.shape[1]), None, None, None,
              gpu_plan=SimpleNamespace(**choices))
        assert taken == [(1, mixer.intermediate_size)]


def test_gated_norm_does_not_fold_in_fp16_or_over_several_groups(mixer, monkeypatch):
    """fp16 (the row is rounded before the norm's scale: it could overflow) and a norm of
    several groups (one scale per group) keep the norm's own kernel."""
    monkeypatch.setattr(mixer.out_proj, "supports_row_rms", lambda x: True)
    assert mixer.folds_gated_norm()
    half = copy.deepcopy(mixer).half()
    monkeypatch.setattr(half.out_proj, "supports_row_rms", lambda x: True)
    assert not half.folds_gated_norm()
    monkeypatch.setattr(mixer.norm, "group_size", mixer.intermediate_size // 2)
    assert not mixer.folds_gated_norm()


def test_out_proj_takes_no_folded_norm_over_two_ranks(mixer, monkeypatch):
    """A row-parallel out_proj sums partial products over ranks: no single GEMM can scale the
    whole sum, so supports_row_rms is False at world size 2 even where the single-row GEMM
    takes the operands; and on the CPU the single-row GEMM takes nothing."""
    from engine.layers import parallel_linear

    row = torch.zeros(1, mixer.intermediate_size)
    assert not mixer.out_proj.supports_row_rms(row)  # the CPU
    monkeypatch.setattr(parallel_linear, "routes_to_skinny", lambda x, weight, bias, gated=False: True)
    assert mixer.out_proj.supports_row_rms(row)
    monkeypatch.setattr(mixer.out_proj, "tp", SimpleNamespace(world_size=2))
    assert not mixer.out_proj.supports_row_rms(row)
    assert not mixer.folds_gated_norm()
