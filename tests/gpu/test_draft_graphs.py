"""The MTP drafter's draft graphs (engine/speculative/draft_graphs.py; issue 25) against its
eager depths (MtpDrafter without graphs): the same drafts and the same head K/V in the
requests' scratch blocks, for three starts (at position 1, the first a head computes; at a
block boundary; in mid-block, whose partial block the drafter copies first), with one padding
row in fp32. On a CUDA device the graphs are captured and replayed; on the CPU under TRITON_INTERPRET=1
their captured body (forward_static: the decode plan over the static buffers, the paged decode
kernel with first_key 1) runs eagerly against the PyTorch path (fp32 only there). The worker
and engine tests that go through the graphs are tests/gpu/test_mtp_gpu.py's.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import ScheduledChunk
from tests.gpu.conftest import INTERPRETED, needs_device, relative_error

pytestmark = [pytest.mark.gpu, needs_device]

BLOCK_SIZE = 16
K = 3
GREEDY = SamplingParams(max_tokens=4, temperature=0)
FIRST_SCRATCH_BLOCK = 6  # slots 0..2 own scratch blocks 6..11 (two each)
GRAPH_SCRATCH_BLOCK = 12


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRETED, reason="Triton's interpreter does not emulate the kernels' bf16 dots faithfully"))])
def test_draft_graphs_draft_as_the_eager_depths(device, dtype):
    from engine.routes.forward_routes import EagerPass, GraphScratch
    from engine.execution.loader import load_model
    from engine.speculative.draft_graphs import DraftGraphRunner
    from engine.speculative.mtp import DraftStart, MtpDrafter

    model, _ = load_model(DEFAULT_MODEL_DIR, dtype=dtype, device=device)
    head = model.random_mtp_head(11)
    layer = head.layer_index
    caches = model.allocate_caches(num_blocks=GRAPH_SCRATCH_BLOCK + 1, block_size=BLOCK_SIZE, num_state_slots=4,
                                   device=device, drafter_layers=(layer,))
    g = torch.Generator().manual_seed(3)
    for cache in (caches.key_cache[layer], caches.value_cache[layer]):
        cache.copy_(torch.randn(cache.shape, generator=g).to(device, dtype))
    initial = [caches.key_cache[layer].clone(), caches.value_cache[layer].clone()]
    hidden_size, vocab = model.config.hidden_size, model.config.vocab_size
    requests = [("a", 1, (0,), 0), ("b", 16, (1, 2), 1), ("c", 37, (3, 4, 5), 2)]  # id, e, own blocks, slot
    starts = [
        DraftStart(ScheduledChunk(rid, (5,), position - 1, blocks, slot, False, True, GREEDY, propose_drafts=K),
                   position, torch.tensor(100 + 37 * i % (vocab - 100), device=device),
                   torch.randn(hidden_size, generator=g).to(device, dtype))
        for i, (rid, position, blocks, slot) in enumerate(requests)
    ]
    eager = MtpDrafter(model, head, caches, EagerPass(model, caches, device), FIRST_SCRATCH_BLOCK, K)
    assert eager.blocks_per_slot == 2
    with torch.inference_mode():
        want = eager.propose(starts).tokens
        want_kv = [caches.key_cache[layer].clone(), caches.value_cache[layer].clone()]
        caches.key_cache[layer].copy_(initial[0])
        caches.value_cache[layer].copy_(initial[1])

        scratch = GraphScratch(max_blocks_per_seq=4, scratch_slot=3, scratch_block=GRAPH_SCRATCH_BLOCK)
        # fp32: a graph of 4 rows, one of them padding; bf16: of 3, the eager rows' count, so
        # that every GEMM has the same shape on both sides and no near-tie can flip
        size = 4 if dtype == torch.float32 else 3
        runner = DraftGraphRunner(model, head, caches, scratch, K, batch_sizes=(size,))
        tables = [eager.scratch_table(start, BLOCK_SIZE) for start in starts]
        positions = [start.position for start in starts]
        tokens = torch.stack([start.token for start in starts])
        hidden = torch.stack([start.hidden for start in starts])
        assert runner.accepts(positions, tables)
        if device.type == "cuda":
            runner.capture()
            got = runner.draft(tokens, hidden, positions, tables)
            assert runner.replays == 1
        else:
            assert runner.stage(tokens, hidden, positions, tables) == size
            got = runner.forward_static(size)[: len(starts)]
    assert got.shape == (len(starts), K)
    assert torch.equal(got, want), f"graph drafts {got.tolist()} != eager {want.tolist()}"
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for got_cache, want_cache in zip((caches.key_cache[layer], caches.value_cache[layer]), want_kv):
        # every block but the graph scratch block, which only padding writes
        assert relative_error(got_cache[:GRAPH_SCRATCH_BLOCK], want_cache[:GRAPH_SCRATCH_BLOCK]) <= tolerance
    assert not runner.accepts([1] * 5, [tables[0]] * 5)  # more starts than the largest size
