"""Worker-side checkpoint tensors: capture a request's state at a position, restore it later.

A bundle (docs/design.md section 2) holds, for a prefix of p tokens:
- every Mamba layer's conv state and SSM state at p;
- every attention layer's "attention tail": a private copy of the K/V of positions
  p - p % B .. p - 1 (the partial last block), so a hit is possible at any position; the full
  blocks before it stay in the shared block pool, referenced by the scheduler's ledger;
- the final hidden row at p - 1, so a hit covering the whole prompt samples with no forward.

The scheduler decides what to capture and restore; this store only copies tensors and knows
bundles by id. The copies move a whole bundle in three launches each way
(engine/kernels/bundle_copy.py). It lives with the caches it copies from (one per tensor-parallel rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.interfaces.forward_batch import ModelCaches
from engine.kernels.bundle_copy import gather_bundle, gather_tail, scatter_bundle


@dataclass(frozen=True)
class BundleTensors:
    """Layouts of engine/kernels/bundle_copy_reference.py (layers in increasing order)."""

    conv_state: torch.Tensor  # (L_mamba, conv_dim, K - 1)
    ssm_state: torch.Tensor  # (L_mamba, H, P, N) fp32
    tail_kv: torch.Tensor | None  # (2, L_attention, p % B, Hkv, Dh): keys, values; None if p % B == 0
    hidden_row: torch.Tensor  # (D,) final hidden row at p - 1

    @property
    def nbytes(self) -> int:
        tensors = [self.conv_state, self.ssm_state, self.hidden_row]
        if self.tail_kv is not None:
            tensors.append(self.tail_kv)
        return sum(t.numel() * t.element_size() for t in tensors)


class CheckpointStore:
    def __init__(self, caches: ModelCaches) -> None:
        self.caches = caches
        self._bundles: dict[int, BundleTensors] = {}

    def __contains__(self, bundle_id: int) -> bool:
        return bundle_id in self._bundles

    def __len__(self) -> int:
        return len(self._bundles)

    def capture(
        self,
        bundle_id: int,
        state_slot: int,
        num_tokens: int,
        tail_block: int | None,
        hidden_row: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> int:
        """Copy the state of `state_slot` and the tail of `tail_block` (positions
        num_tokens - num_tokens % B .. num_tokens - 1; None when num_tokens % B == 0) into a
        new bundle. Returns its size in bytes. Reads the caches; changes only the store.

        state: (conv (L_m, C, K-1), ssm (L_m, H, P, N)) taken elsewhere (an in-pass capture);
        kept as given, and the slot is not read."""
        tail_len = num_tokens % self.caches.block_size
        if (tail_block is None) != (tail_len == 0):
            raise ValueError(f"tail_block {tail_block} does not fit a tail of {tail_len} tokens")
        if state is None:
            conv, ssm, tail_kv = gather_bundle(self.caches, state_slot, tail_block, tail_len)
        else:
            (conv, ssm), tail_kv = state, gather_tail(self.caches, tail_block, tail_len)
        bundle = BundleTensors(conv, ssm, tail_kv, hidden_row.detach().clone())
        self._bundles[bundle_id] = bundle
        return bundle.nbytes

    def get(self, bundle_id: int) -> BundleTensors | None:
        """The tensors of bundle `bundle_id` (read them, do not change them), or None."""
        return self._bundles.get(bundle_id)

    def insert(self, bundle_id: int, bundle: BundleTensors) -> None:
        """Keep `bundle` (tensors on the caches' device) as bundle `bundle_id`, a new id: a
        checkpoint imported from another engine (engine/checkpoints/shards.py)."""
        if bundle_id in self._bundles:
            raise ValueError(f"bundle {bundle_id} is already held")
        self._bundles[bundle_id] = bundle

    def restore(self, bundle_id: int, state_slot: int, tail_block: int | None) -> torch.Tensor:
        """Copy a bundle's state into `state_slot` and its tail into offsets [0, tail) of the
        fresh block `tail_block`. Returns the bundle's hidden row. Mutates the caches only."""
        bundle = self._bundles[bundle_id]
        if bundle.tail_kv is not None and tail_block is None:
            raise ValueError(f"bundle {bundle_id} has an attention tail but no block was given")
        scatter_bundle(
            self.caches, state_slot, tail_block, bundle.conv_state, bundle.ssm_state, bundle.tail_kv
        )
        return bundle.hidden_row

    def drop(self, bundle_ids: tuple[int, ...] | list[int]) -> None:
        for bundle_id in bundle_ids:
            self._bundles.pop(bundle_id, None)
