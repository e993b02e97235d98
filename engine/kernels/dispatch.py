"""The one explicit selection point between the PyTorch kernels and the GPU (Triton) kernels.

The model asks `plan_for_device` once per forward pass: on a CUDA device it gets a GpuBatchPlan
(the batch's metadata on the device) and passes it to every layer, which then runs its Triton
path; on any other device it gets None and the layers run exactly their PyTorch path. There is
no global switch: the choice is the device the weights live on. Importing this module on a
CPU-only machine imports neither triton nor fla (the kernel modules are imported
by the layers' GPU methods only).
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch
from engine.kernels.gpu.batch_plan import GpuBatchPlan, build_gpu_batch_plan

__all__ = ["GpuBatchPlan", "plan_for_device"]


def plan_for_device(batch: ForwardBatch, block_size: int, device: torch.device) -> GpuBatchPlan | None:
    """A GpuBatchPlan on CUDA, None elsewhere."""
    if device.type != "cuda":
        return None
    return build_gpu_batch_plan(batch, block_size, device)
