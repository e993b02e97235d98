"""Batched checkpoint copies (engine/kernels/bundle_copy.py) against the layer-by-layer
reference, on the model's real cache layout: captured tensors equal bit for bit, restored
slots and tail offsets equal the source, every other slot, block and offset keeps its (NaN or
random) bits, and caches without stacks fall back to the reference.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.kernels.bundle_copy import gather_bundle, scatter_bundle
from engine.kernels.bundle_copy_reference import gather_bundle_reference, scatter_bundle_reference
from engine.execution.loader import load_model
from tests.gpu.conftest import needs_device

pytestmark = [pytest.mark.gpu, needs_device]


def _random_caches(device: str, dtype: torch.dtype, num_blocks=12, block_size=16, num_slots=6):
    model, _ = load_model(DEFAULT_MODEL_DIR, dtype=dtype, device=device)
    caches = model.allocate_caches(num_blocks=num_blocks, block_size=block_size,
                                   num_state_slots=num_slots, device=device)
    assert caches.conv_stack is not None and caches.kv_stack is not None
    for stack in (caches.conv_stack, caches.ssm_stack, caches.kv_stack):
        stack.normal_()
    return caches


def _all(caches) -> dict[str, torch.Tensor]:
    out = {}
    for name in ("conv_state", "ssm_state", "key_cache", "value_cache"):
        for layer, t in getattr(caches, name).items():
            out[f"{name}{layer}"] = t.clone()
    return out


def check_bundle_copies(device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(50)
    caches = _random_caches(device, dtype)
    src_slot, dst_slot, src_block, dst_block = 2, 4, 7, 3
    for tail_len, tail_block in ((5, src_block), (0, None)):
        got = gather_bundle(caches, src_slot, tail_block, tail_len)
        want = gather_bundle_reference(caches, src_slot, tail_block, tail_len)
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if g is not None:
                assert g.shape == w.shape and torch.equal(g, w)

    conv, ssm, tail = gather_bundle(caches, src_slot, src_block, 5)
    for name, fn in (("batched", scatter_bundle), ("reference", scatter_bundle_reference)):
        for stack in (caches.conv_stack, caches.ssm_stack):
            stack[:, dst_slot] = float("nan")  # the destination is poisoned
        caches.kv_stack[:, :, dst_block] = float("nan")
        before = _all(caches)
        fn(caches, dst_slot, dst_block, conv, ssm, tail)
        after = _all(caches)
        for key, t in after.items():
            kind = key.rstrip("0123456789")
            layer = int(key[len(kind):])
            if kind in ("conv_state", "ssm_state"):
                src = getattr(caches, kind)[layer][src_slot]
                assert torch.equal(t[dst_slot], src), f"{name}: {key} slot not restored"
                keep = [s for s in range(t.shape[0]) if s != dst_slot]
            else:
                src = getattr(caches, kind)[layer][src_block, :5]
                assert torch.equal(t[dst_block, :5], src), f"{name}: {key} tail not restored"
                assert torch.isnan(t[dst_block, 5:]).all(), f"{name}: {key} wrote past the tail"
                keep = [b for b in range(t.shape[0]) if b != dst_block]
            same = t[keep].view(torch.uint8) == before[key][keep].view(torch.uint8)
            assert same.all(), f"{name}: {key} changed outside the destination"

    # Caches rebuilt per layer lose their stacks and take the reference path.
    copied = replace(caches, conv_state={k: v.clone() for k, v in caches.conv_state.items()})
    assert copied.conv_stack is None and copied.ssm_stack is None and copied.kv_stack is not None
    for g, w in zip(gather_bundle(copied, src_slot, src_block, 5), (conv, ssm, tail)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bundle_copies(device, dtype):
    check_bundle_copies(str(device), dtype)
