"""Which GPU path Mamba2Mixer.mix_batch_gpu takes for a step (the paths themselves are device
tests in tests/gpu/test_mamba_decode.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.config import DEFAULT_MODEL_DIR
from engine.layers.mamba2 import FUSED_DECODE_MAX_ROWS
from engine.loader import load_model


@pytest.fixture(scope="module")
def mixer():
    model, _ = load_model(DEFAULT_MODEL_DIR)
    return next(layer.mamba for layer in model.layers if layer.mamba is not None)


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
    plan = SimpleNamespace(num_decode=num_decode, num_prefill=num_prefill, in_pass=in_pass)
    mixer.mix_batch_gpu(None, None, None, None, plan)
    assert taken == [expected]


@pytest.mark.parametrize("rows, num_prefill, in_pass, out_proj_takes_it, folds", [
    (1, 0, None, True, True),  # batch-1 decode: the gated norm folds into its neighbours
    (2, 0, None, True, False),  # two rows: the norm's own kernel (the GEMM is cuBLAS's)
    (1, 1, None, True, False),  # a one-token prefill chunk
    (1, 0, "capture", True, False),
    (1, 0, None, False, False),  # out_proj's GEMM cannot take it (CPU, world size > 1)
])
def test_gated_norm_folds_only_into_one_decode_row(mixer, monkeypatch, rows, num_prefill, in_pass,
                                                   out_proj_takes_it, folds):
    import torch

    monkeypatch.setattr(mixer.out_proj, "supports_row_rms", lambda x: out_proj_takes_it)
    plan = SimpleNamespace(num_prefill=num_prefill, in_pass=in_pass)
    normed = mixer._folded_norm_row(torch.zeros(rows, 4), plan)
    assert (normed is not None) == folds
    if folds:
        assert normed.shape == (1, mixer.intermediate_size)


def test_out_proj_takes_no_folded_norm_on_the_cpu(mixer):
    import torch

    assert not mixer.out_proj.supports_row_rms(torch.zeros(1, mixer.intermediate_size))
