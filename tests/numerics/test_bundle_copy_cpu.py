"""The batched checkpoint copies on CPU (the device test's body: tests/gpu/test_bundle_copy.py)."""

import torch

from tests.gpu.test_bundle_copy import check_bundle_copies


def test_bundle_copies_cpu():
    check_bundle_copies("cpu", torch.float32)
