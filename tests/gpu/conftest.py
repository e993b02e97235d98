"""Device tests: run on a CUDA device; on CPU they are skipped with the reason printed.

With TRITON_INTERPRET=1 (and triton installed) our own Triton kernels also run on the CPU
through Triton's interpreter, for debugging without a GPU; fla-core's kernels are skipped there.
The interpreter (Triton 3.3 to 3.6) needs numpy below 2.4, which refuses int() of the
one-element arrays it keeps scalars in; for example, beside .venv's packages:
  pip install --target /tmp/trsite --no-deps triton==3.5.1 numpy==2.2.6
  PYTHONPATH=/tmp/trsite TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/gpu/test_draft_graphs.py
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_DEVICE = torch.cuda.is_available() or INTERPRETED
needs_device = pytest.mark.skipif(not HAS_DEVICE, reason="needs a CUDA device")
# Kernels that call libdevice.log1p (dt's softplus) cannot run under Triton's interpreter.
needs_log1p = pytest.mark.skipif(
    INTERPRETED, reason="the kernel calls libdevice.log1p, which Triton's interpreter does not emulate"
)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in fp64; NaN anywhere gives NaN."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def eager_forward(model, batch, caches):
    """model(batch, caches) as the eager forward route runs it (engine/routes/forward_routes.py
    EagerPass): on CUDA with the batch's GpuBatchPlan and the model's gated-norm fold, on the
    CPU (Triton's interpreter) the PyTorch path."""
    from engine.kernels.gpu.batch_plan import build_gpu_batch_plan

    device = batch.input_ids.device
    plan = None
    if device.type == "cuda":
        plan = build_gpu_batch_plan(batch, caches.block_size, device, fold_gated_norm=model.folds_gated_norm())
    return model(batch, caches, gpu_plan=plan)
