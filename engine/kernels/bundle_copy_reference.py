"""Checkpoint bundle copies layer by layer, in pure PyTorch: the reference the batched copies
(engine/kernels/bundle_copy.py) are tested against, and the path for caches without stacks.

A bundle of one request at p tokens (docs/design.md section 2) is, as tensors:
  conv_state (L_mamba, conv_dim, K-1) and ssm_state (L_mamba, H, P, N) fp32: the state slot of
  every Mamba layer, in increasing layer order;
  tail_kv (2, L_attention, p % B, Hkv, Dh) or None when p % B == 0: keys [0] and values [1] of
  offsets [0, p % B) of the tail block of every attention layer, in increasing layer order.
"""

from __future__ import annotations

import torch

from engine.interfaces.forward_batch import ModelCaches


def gather_bundle_reference(
    caches: ModelCaches, slot: int, tail_block: int | None, tail_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Fresh copies (conv_state, ssm_state, tail_kv) of `slot` and `tail_block` (None: no tail).
    Reads the caches only."""
    conv = torch.stack([t[slot] for _, t in sorted(caches.conv_state.items())])
    ssm = torch.stack([t[slot] for _, t in sorted(caches.ssm_state.items())])
    if tail_block is None:
        return conv, ssm, None
    keys = [t[tail_block, :tail_len] for _, t in sorted(caches.key_cache.items())]
    values = [t[tail_block, :tail_len] for _, t in sorted(caches.value_cache.items())]
    return conv, ssm, torch.stack([torch.stack(keys), torch.stack(values)])


def scatter_bundle_reference(
    caches: ModelCaches, slot: int, tail_block: int | None,
    conv: torch.Tensor, ssm: torch.Tensor, tail_kv: torch.Tensor | None,
) -> None:
    """Write a gathered bundle into `slot` and offsets [0, tail) of `tail_block`. Writes
    nothing else."""
    for j, (_, t) in enumerate(sorted(caches.conv_state.items())):
        t[slot].copy_(conv[j])
    for j, (_, t) in enumerate(sorted(caches.ssm_state.items())):
        t[slot].copy_(ssm[j])
    if tail_kv is not None:
        tail_len = tail_kv.shape[2]
        for j, (_, t) in enumerate(sorted(caches.key_cache.items())):
            t[tail_block, :tail_len].copy_(tail_kv[0, j])
        for j, (_, t) in enumerate(sorted(caches.value_cache.items())):
            t[tail_block, :tail_len].copy_(tail_kv[1, j])
