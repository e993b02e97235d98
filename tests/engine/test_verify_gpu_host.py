"""The host side of the CUDA verification route (engine/speculative/verify_gpu.py), on the CPU:
the chunk order and the verification index, and mix_verification_gpu's glue with the one-pass
kernel's PyTorch reference in its place (engine/kernels/verification_reference.py
mamba_verify_reference), against the Mamba2 mixer's one-token decode step chained token by
token (the CPU verification path). The kernel against that reference: tests/gpu/
test_verify_kernels.py; the route on a GPU: tests/gpu/test_speculative_gpu.py."""

from __future__ import annotations

import numpy as np
import torch

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.kernels.verification_reference import mamba_verify_reference
from engine.execution.loader import load_model
from engine.interfaces.sampling_params import SamplingParams
from engine.speculative.verify import VerificationScratch
from engine.kernels.gpu.batch_plan import build_verification_plan
from engine.layers.verification import mix_verification_gpu
from engine.speculative.verify_gpu import verification_index, verification_order
from engine.interfaces.step_io import ScheduledChunk

K = 3  # drafts: n = 4 positions at most


def _chunk(request_id: str, num_tokens: int, drafts: int = 0) -> ScheduledChunk:
    return ScheduledChunk(request_id, tuple(range(num_tokens)), 5, (0,), 0, False, True,
                          SamplingParams(temperature=0), num_draft_tokens=drafts)


def test_verification_chunks_go_last_in_order():
    chunks = [_chunk("v0", 4, 3), _chunk("d0", 1), _chunk("p0", 9), _chunk("v1", 2, 1), _chunk("d1", 1)]
    order, num_rest = verification_order(chunks)
    assert order == [1, 2, 4, 0, 3] and num_rest == 3
    assert verification_order([_chunk("v", 3, 2)]) == ([0], 0)


def test_verification_index_names_each_chunks_rows_and_slots():
    scratch = VerificationScratch(None, first_slot=20, num_speculative_tokens=K)  # 4 slots per request
    # chunks at rows 10.. (2 tokens, slot 1), 12.. (4 tokens, slot 0), 16.. (3 tokens, slot 3)
    index = verification_index([10, 12, 16], [2, 4, 3], [1, 0, 3], scratch)
    assert index.first_rows.tolist() == [10, 12, 16] and index.lengths.tolist() == [2, 4, 3]
    assert index.source_slots.tolist() == [1, 0, 3]
    # request slot s owns 20 + 4 s .. 20 + 4 s + 3, all n of them; (n, V)
    assert index.scratch_slots.tolist() == [[24, 20, 32], [25, 21, 33], [26, 22, 34], [27, 23, 35]]
    assert index.scratch_slots.dtype == np.int64 and index.scratch_slots.flags.c_contiguous


def test_verification_plan_is_the_index_on_the_device():
    scratch = VerificationScratch(None, first_slot=20, num_speculative_tokens=K)
    index = verification_index([0, 4], [4, 2], [2, 5], scratch)
    plan = build_verification_plan(index, None, 0, torch.device("cpu"))
    assert plan.first_rows.tolist() == [0, 4] and plan.lengths.tolist() == [4, 2]
    assert plan.source_slots.tolist() == [2, 5]
    assert plan.scratch_slots.tolist() == [[28, 40], [29, 41], [30, 42], [31, 43]]
    assert plan.scratch_slots.stride() == (2, 1) and plan.rest is None and plan.num_rest_rows == 0


def test_mix_verification_gpu_glue_equals_the_chained_decode_step():
    """Three verification chunks (4, 2 and 3 tokens) through mix_verification_gpu with the
    one-pass kernel's PyTorch reference (mamba_verify_reference) in its place: y + D x at
    every position and every scratch slot's state equal the mixer's mix_decode chained token
    by token (the CPU path); the requests' slots, the scratch slots past a chunk's length and
    every other slot are untouched."""
    model, config = load_model(DEFAULT_MODEL_DIR, dtype=torch.float32, device=torch.device("cpu"))
    mixer = next(layer.mamba for layer in model.layers if layer.mamba is not None)
    g = torch.Generator().manual_seed(5)
    lengths, slots, firsts = [4, 2, 3], [1, 0, 2], [0, 4, 6]
    num_slots, first_scratch = 3, 4
    scratch = VerificationScratch(None, first_scratch, K)
    total_slots = first_scratch + num_slots * (K + 1)
    (conv_dim, taps), ssm_shape = model.mamba_state_shape()
    conv_state = torch.randn(total_slots, conv_dim, taps, generator=g)
    ssm_state = torch.randn(total_slots, *ssm_shape, generator=g)
    T = sum(lengths)
    projected = torch.randn(T, mixer.intermediate_size + conv_dim + mixer.num_heads, generator=g)
    _, xBC, dt_raw = projected.split([mixer.intermediate_size, conv_dim, mixer.num_heads], dim=-1)
    index = verification_index(firsts, lengths, slots, scratch)
    plan = build_verification_plan(index, None, 0, torch.device("cpu"))
    conv_got, ssm_got = conv_state.clone(), ssm_state.clone()
    with torch.inference_mode():
        y, x = mix_verification_gpu(mixer, xBC, dt_raw, conv_got, ssm_got, plan, mamba_verify_reference)
        written = set()
        for first, length, slot in zip(firsts, lengths, slots):
            conv, ssm = conv_state[slot : slot + 1], ssm_state[slot : slot + 1]
            for i, scratch_slot in enumerate(scratch.slots(slot, length)):
                row = first + i
                want_y, conv, ssm = mixer.mix_decode(xBC[row : row + 1], dt_raw[row : row + 1], conv, ssm)
                got_y = y[row] + mixer.D[:, None] * x[row].view(mixer.num_heads, mixer.head_dim)
                torch.testing.assert_close(got_y, want_y[0], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(conv_got[scratch_slot], conv[0], rtol=0, atol=0)
                torch.testing.assert_close(ssm_got[scratch_slot], ssm[0], rtol=1e-5, atol=1e-5)
                written.add(scratch_slot)
    untouched = [s for s in range(total_slots) if s not in written]
    assert set(slots) <= set(untouched)
    assert torch.equal(conv_got[untouched], conv_state[untouched])
    assert torch.equal(ssm_got[untouched], ssm_state[untouched])


def test_the_route_plans_the_other_chunks_apart_and_maps_rows_back():
    """GpuVerifyPass's host side, with the plans built on the CPU: the batch laid out others
    first, the rest plan is the ordinary plan of the other chunks alone, the verification plan
    points at the verification chunks' rows and slots, and last rows map back to the step's
    order."""
    from types import SimpleNamespace

    from engine.interfaces.forward_batch import build_forward_batch
    from engine.kernels.gpu.batch_plan import build_gpu_batch_plan
    from engine.speculative.verify_gpu import GpuVerifyPass, last_rows_in_order

    def chunk(rid, n, start, slot, drafts=0):
        return ScheduledChunk(rid, tuple(range(7, 7 + n)), start, (2 * slot, 2 * slot + 1), slot, start == 0,
                              True, SamplingParams(temperature=0), num_draft_tokens=drafts)

    chunks = [chunk("a", 3, 9, 0, drafts=2), chunk("b", 1, 12, 1), chunk("c", 5, 0, 2), chunk("d", 5, 20, 3, drafts=4)]
    model = SimpleNamespace(config=SimpleNamespace(layer_types=("mamba", "attention")))
    caches = SimpleNamespace(block_size=16)
    scratch = VerificationScratch(None, first_slot=5, num_speculative_tokens=4)
    route = GpuVerifyPass(model, caches, torch.device("cpu"), scratch)
    assert route.accepts(chunks) and not route.accepts(chunks[1:3])
    order, num_rest = verification_order(chunks)
    ordered = [chunks[i] for i in order]
    batch = build_forward_batch(ordered, 16, torch.device("cpu"))
    assert batch.cu_seqlens == (0, 1, 6, 9, 14)
    plan = route.verification_plan(batch, num_rest)
    want_rest = build_gpu_batch_plan(build_forward_batch(ordered[:2], 16, torch.device("cpu")), 16, torch.device("cpu"))
    assert plan.num_rest_rows == 6 and plan.rest.num_decode == 1 and plan.rest.num_prefill == 1
    for name in ("cu_seqlens", "chunk_slot", "decode_rows", "decode_slots", "prefill_cu_seqlens", "prefill_slots"):
        assert torch.equal(getattr(plan.rest, name), getattr(want_rest, name)), name
    # a (3 tokens, slot 0) at rows 6..8, then d (5 tokens, slot 3) at rows 9..13
    assert plan.source_slots.tolist() == [0, 3]
    assert plan.first_rows.tolist() == [6, 9] and plan.lengths.tolist() == [3, 5]
    assert plan.scratch_slots[:, 0].tolist() == list(scratch.slots(0, 5))
    assert plan.scratch_slots[:, 1].tolist() == list(scratch.slots(3, 5))
    assert last_rows_in_order(order, batch.cu_seqlens) == [8, 0, 5, 13]
    only_verifying = route.verification_plan(build_forward_batch([chunks[0]], 16, torch.device("cpu")), 0)
    assert only_verifying.rest is None and only_verifying.num_rest_rows == 0


def test_verify_graph_staging_pads_chunks_and_the_batch():
    """VerifyInputStaging (engine/speculative/verify_graphs.py): two chunks (4 and 2 tokens, k
    = 3) in a graph of 3 chunks: real rows as the chunk says, a short chunk's padded rows and
    the padding chunk on the graph scratch block and slot, every position's scratch slot the
    chunk's own."""
    from dataclasses import replace

    from engine.routes.forward_routes import GraphScratch
    from engine.speculative.verify_graphs import VerifyInputStaging, verify_graph_sizes

    assert verify_graph_sizes(64) == (1, 2, 4, 8, 16) and verify_graph_sizes(6) == (1, 2, 4, 6)
    assert verify_graph_sizes(1) == (1,)
    scratch = VerificationScratch(None, first_slot=9, num_speculative_tokens=K)
    graph_scratch = GraphScratch(max_blocks_per_seq=3, scratch_slot=8, scratch_block=30)
    staging = VerifyInputStaging(3, K + 1, 3, 16, scratch, graph_scratch)
    a = ScheduledChunk("a", (11, 12, 13, 14), 30, (4, 5, 6), 2, False, True, SamplingParams(temperature=0),
                       num_draft_tokens=3)
    b = ScheduledChunk("b", (21, 22), 5, (7,), 0, False, True, SamplingParams(temperature=0), num_draft_tokens=1)
    assert staging.fits(a) and staging.fits(b)
    assert not staging.fits(replace(a, start_position=46))  # positions 46..49 pass the table's 48
    assert not staging.fits(replace(a, block_table=(4, 5)))  # 2 blocks do not cover 30..33
    staging.stage([a, b])
    ids, positions, kv, slots, starts, scratch_slots, table = staging.views(staging.buffer)
    assert ids.tolist() == [11, 12, 13, 14, 21, 22, 0, 0, 0, 0, 0, 0]
    assert positions.tolist() == [30, 31, 32, 33, 5, 6, 7, 8, 0, 1, 2, 3]
    assert kv.tolist() == [5 * 16 + 14, 5 * 16 + 15, 6 * 16 + 0, 6 * 16 + 1, 7 * 16 + 5, 7 * 16 + 6,
                           30 * 16 + 2, 30 * 16 + 3, 30 * 16 + 0, 30 * 16 + 1, 30 * 16 + 2, 30 * 16 + 3]
    assert slots.tolist() == [2, 0, 8] and starts.tolist() == [30, 5, 0]
    assert scratch_slots.tolist() == [[17, 9, 8], [18, 10, 8], [19, 11, 8], [20, 12, 8]]
    assert table.tolist() == [[4, 5, 6], [7, 30, 30], [30, 30, 30]]
    staging.stage([b])  # restaged: nothing of the step before is left
    ids, *_, table = staging.views(staging.buffer)
    assert ids.tolist()[:4] == [21, 22, 0, 0] and table.tolist()[1] == [30, 30, 30]

