"""What speculative decoding adds to a Worker (engine/execution/worker.py), built in the two phases its
caches impose:

1. before the caches are allocated, what it needs of them (`cache_needs`): the scratch state
   slots of the verification chunks (engine/speculative/verify.py), and with the MTP drafter
   its head (attached to the model), the head's KV layer and each slot's draft scratch blocks
   (engine/speculative/mtp.py); each count past the slots and blocks the scheduler is told of;
2. after, its routes and drafter over those caches (`build`): the verification scratch, the
   verification pass (PyTorch off CUDA, engine/speculative/verify_gpu.py on it), the
   verification CUDA graphs where the decode steps replay graphs, and the MTP drafter (with
   the CUDA graphs of its draft depths there too, engine/speculative/draft_graphs.py).

With num_speculative_tokens 0 every count is 0 and every part None (the scratch holds none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.engine_config import EngineConfig
from engine.interfaces.forward_batch import ModelCaches
from engine.model_config import HybridModelConfig
from engine.models.mtp_head import MultiTokenPredictionHead
from engine.parallel.cache_capacity import CacheCapacity, drafter_kv_layers
from engine.routes.forward_routes import EagerPass, GraphScratch
from engine.speculative.checks import check_speculation
from engine.speculative.draft_graphs import DraftGraphRunner
from engine.speculative.mtp import MtpDrafter, attach_head
from engine.speculative.verify import VerificationScratch, VerifyPass
from engine.speculative.verify_gpu import GpuVerifyPass
from engine.speculative.verify_graphs import VerifyGraphRunner, verify_graph_sizes


@dataclass(frozen=True)
class CacheNeeds:
    """What the caches must hold for speculation, past the scheduler's slots and blocks."""

    num_scratch_slots: int  # state slots: VerificationScratch's
    num_draft_blocks: int  # KV blocks: the MTP drafter's scratch blocks
    drafter_layers: tuple[int, ...]  # KV layers past the model's own (the MTP head's)
    head: MultiTokenPredictionHead | None  # the MTP drafter's head, attached to the model


@dataclass(frozen=True)
class WorkerSpeculation:
    """The worker's speculative parts (None with speculation off)."""

    verification: VerificationScratch
    verify_pass: VerifyPass | GpuVerifyPass | None
    verify_graphs: VerifyGraphRunner | None
    drafter: MtpDrafter | None


def cache_needs(
    config: EngineConfig, model, model_config: HybridModelConfig, capacity: CacheCapacity,
) -> CacheNeeds:
    """Phase 1. ValueError naming the key when this model cannot speculate as configured
    (engine/speculative/checks.py check_speculation, also run at deploy time); attaches the
    MTP head to `model` when the drafter is mtp."""
    k = config.num_speculative_tokens
    if k:
        check_speculation(config, model_config)
    head = attach_head(model, config)
    draft_blocks = 0
    if head is not None:
        draft_blocks = capacity.num_state_slots * MtpDrafter.scratch_blocks_per_slot(capacity.block_size, k)
    return CacheNeeds(VerificationScratch.num_scratch_slots(capacity.num_state_slots, k), draft_blocks,
                      drafter_kv_layers(config, model_config), head)


def build(
    config: EngineConfig, model, caches: ModelCaches, needs: CacheNeeds, eager: EagerPass,
    first_scratch_slot: int, first_draft_block: int, graph_scratch: GraphScratch | None,
) -> WorkerSpeculation:
    """Phase 2, over the allocated caches: the scratch slots from first_scratch_slot and the
    draft blocks from first_draft_block are the ones cache_needs counted; graph_scratch: the
    decode graphs' padding slot and block where the worker captures graphs (None: no graphs,
    so no verification or draft graphs either)."""
    k = config.num_speculative_tokens
    device = torch.device(config.device)
    verification = VerificationScratch(caches, first_scratch_slot, k)
    route = VerifyPass if device.type != "cuda" else GpuVerifyPass
    verify_pass = route(model, caches, device, verification) if k else None
    verify_graphs = None
    if graph_scratch is not None and k:
        verify_graphs = VerifyGraphRunner(model, caches, verification, graph_scratch,
                                          verify_graph_sizes(config.max_num_seqs))
        verify_graphs.capture()
    drafter = None
    if needs.head is not None:
        draft_graphs = None
        if graph_scratch is not None:
            draft_graphs = DraftGraphRunner(model, needs.head, caches, graph_scratch, k,
                                            verify_graph_sizes(config.max_num_seqs))
            draft_graphs.capture()
        drafter = MtpDrafter(model, needs.head, caches, eager, first_draft_block, k, draft_graphs)
    return WorkerSpeculation(verification, verify_pass, verify_graphs, drafter)
