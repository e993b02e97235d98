"""Checkpoint bundle copies in a few launches: capture (gather) and restore (scatter) of a
request's state slot in every Mamba layer and its attention tail in every attention layer.

The caches keep each kind of tensor stacked over layers (ModelCaches.conv_stack, ssm_stack,
kv_stack), so a slot of every layer is one strided view: a capture is three copies (conv, SSM,
K/V tail) and a restore three, on any device, where copying layer by layer takes 2 * L_mamba +
2 * L_attention. Same layouts and results as engine/kernels/bundle_copy_reference.py (bit-exact:
copies only); caches without stacks take the reference.
"""

from __future__ import annotations

import torch

from engine.interfaces.forward_batch import ModelCaches
from engine.kernels.bundle_copy_reference import gather_bundle_reference, scatter_bundle_reference


def gather_bundle(
    caches: ModelCaches, slot: int, tail_block: int | None, tail_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Fresh copies (conv_state (L_m, conv_dim, K-1), ssm_state (L_m, H, P, N), tail_kv
    (2, L_a, tail_len, Hkv, Dh) or None) of `slot` and `tail_block`. Reads the caches only."""
    if caches.conv_stack is None or (tail_block is not None and caches.kv_stack is None):
        return gather_bundle_reference(caches, slot, tail_block, tail_len)
    conv = caches.conv_stack[:, slot].clone()
    ssm = caches.ssm_stack[:, slot].clone()
    tail = None if tail_block is None else caches.kv_stack[:, :, tail_block, :tail_len].clone()
    return conv, ssm, tail


def gather_tail(caches: ModelCaches, tail_block: int | None, tail_len: int) -> torch.Tensor | None:
    """A fresh copy (2, L_a, tail_len, Hkv, Dh) of the tail of every attention layer; None
    when tail_block is None."""
    if tail_block is None:
        return None
    if caches.kv_stack is not None:
        return caches.kv_stack[:, :, tail_block, :tail_len].clone()
    keys = [t[tail_block, :tail_len] for _, t in sorted(caches.key_cache.items())]
    values = [t[tail_block, :tail_len] for _, t in sorted(caches.value_cache.items())]
    return torch.stack([torch.stack(keys), torch.stack(values)])


def scatter_bundle(
    caches: ModelCaches, slot: int, tail_block: int | None,
    conv: torch.Tensor, ssm: torch.Tensor, tail_kv: torch.Tensor | None,
) -> None:
    """Write a gathered bundle into `slot` and offsets [0, tail) of `tail_block` of every
    layer. Writes nothing else."""
    if caches.conv_stack is None or (tail_kv is not None and caches.kv_stack is None):
        scatter_bundle_reference(caches, slot, tail_block, conv, ssm, tail_kv)
        return
    caches.conv_stack[:, slot].copy_(conv)
    caches.ssm_stack[:, slot].copy_(ssm)
    if tail_kv is not None:
        caches.kv_stack[:, :, tail_block, : tail_kv.shape[2]].copy_(tail_kv)
