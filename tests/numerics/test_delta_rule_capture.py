"""In-pass capture for the gated delta rule on CPU (engine/kernels/gpu/delta_rule_capture.py):
the host arrays of its two calls (heads, tails), and the two calls themselves with the
reference rule (engine/kernels/gated_delta_rule_reference.py) where the GPU path passes
fla-core's chunked kernel: the captured states, outputs and final states against the split
path (the chunk cut at the capture, two steps) and against the uncut chunks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.kernels.gated_delta_rule_reference import chunk_gated_delta_rule
from engine.kernels.gpu.delta_rule_capture import (
    RULE_CHUNK, RuleCall, rule_with_captures, split_prefill, split_prefill_arrays,
)
from engine.kernels.gpu.in_pass_capture import CaptureSplit, build_in_pass_plan

CPU = torch.device("cpu")
H, K, V = 3, 8, 5
SCALE = K ** -0.5


def test_arrays_of_the_two_calls():
    prefill = [(0, 0, 10), (2, 11, 5), (3, 16, 70)]  # chunk 1 (row 10) is a decode chunk
    h_rows, h_cu, h_pairs, t_rows, t_cu, t_pairs, captured = split_prefill_arrays(prefill, [(0, 4), (3, 66)])
    assert h_rows.tolist() == [0, 1, 2, 3] + list(range(16, 82))
    assert h_cu.tolist() == [0, 4, 70]
    assert h_pairs.reshape(-1, 2).tolist() == [[0, 0], [1, 0], [1, 1]]  # 66 rows: two chunks
    assert t_rows.tolist() == list(range(4, 10)) + list(range(11, 16)) + list(range(82, 86))
    assert t_cu.tolist() == [0, 6, 11, 15]
    assert t_pairs.reshape(-1, 2).tolist() == [[0, 0], [1, 0], [2, 0]]
    assert captured.tolist() == [0, 2]
    one = split_prefill_arrays([(1, 3, 9)], [(1, 2)])
    assert [a.tolist() for a in one] == [[3, 4], [0, 2], [], list(range(5, 12)), [0, 7], [], [0]]


@pytest.mark.parametrize("captures", [
    [(0, 0)], [(0, 10)], [(0, 11)],  # not strictly inside
    [(1, 3)],  # a decode chunk
    [(3, 2), (0, 4)], [(0, 2), (0, 4)],  # out of order, two in one chunk
])
def test_arrays_refuse_a_capture_outside_a_prefill_chunk(captures):
    with pytest.raises(ValueError):
        split_prefill_arrays([(0, 0, 10), (2, 11, 5), (3, 16, 8)], captures)


@pytest.mark.parametrize("seed", range(30))
def test_arrays_partition_the_prefill_rows(seed):
    """Random steps: heads and tails rows are every prefill row once; each captured chunk's
    heads end where its tails start; the varlen chunk pairs are those of the calls' lengths."""
    rng = random.Random(seed)
    prefill, row = [], 0
    for chunk in range(rng.randint(1, 6)):
        n = rng.choice([1, rng.randint(2, 200)])
        if n > 1:
            prefill.append((chunk, row, n))
        row += n
    if not prefill:
        prefill.append((0, 0, 2))
    chosen = sorted(rng.sample(range(len(prefill)), rng.randint(1, len(prefill))))
    captures = [(prefill[j][0], rng.randint(1, prefill[j][2] - 1)) for j in chosen]
    h_rows, h_cu, h_pairs, t_rows, t_cu, t_pairs, captured = split_prefill_arrays(prefill, captures)
    all_rows = np.concatenate([np.arange(start, start + n) for _, start, n in prefill])
    assert sorted(np.concatenate([h_rows, t_rows]).tolist()) == all_rows.tolist()
    assert captured.tolist() == chosen
    for c, (j, (_, split)) in enumerate(zip(chosen, captures)):
        _, start, n = prefill[j]
        assert h_rows[h_cu[c]:h_cu[c + 1]].tolist() == list(range(start, start + split))
        assert t_rows[t_cu[j]:t_cu[j + 1]].tolist() == list(range(start + split, start + n))
    for cu, pairs in ((h_cu, h_pairs), (t_cu, t_pairs)):
        lengths = np.diff(cu)
        want = [[s, c] for s, n in enumerate(lengths) for c in range(-(-n // RULE_CHUNK))]
        assert pairs.reshape(-1, 2).tolist() == (want if len(lengths) > 1 else [])


def _reference_rule(q, k, v, g, beta, initial, call: RuleCall):
    """The varlen rule by the reference, sequence by sequence (a stand-in for
    gated_delta_rule.chunk_rule; q and k already normalised and per value head)."""
    bounds = call.cu.tolist()
    assert (call.chunk_indices is None) == (len(bounds) == 2)
    outs, finals = [], []
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        o, final = chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], initial[s], SCALE, RULE_CHUNK)
        outs.append(o)
        finals.append(final)
    return torch.cat(outs), torch.stack(finals)


def _inputs(num_tokens: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(num_tokens, H, K, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(num_tokens, H, K, generator=g), dim=-1)
    v = torch.randn(num_tokens, H, V, generator=g)
    decay = -torch.rand(num_tokens, H, generator=g) * 0.3
    beta = torch.rand(num_tokens, H, generator=g)
    return [q, k, v, decay, beta]


@pytest.mark.parametrize("lengths,cuts", [
    ([70, 20, 45], {0: 37, 2: 2}),
    ([70, 1, 20, 45], {0: 64, 2: 19}),  # 64: on a chunk edge; a decode chunk in between
    ([135], {0: 100}),  # one sequence: both calls on the fixed-length path
    ([130, 66], {0: 129, 1: 1}),  # one-row tail; one-row head
])
def test_two_calls_equal_the_split_path_and_the_uncut_chunks(lengths, cuts):
    """Through build_in_pass_plan's split: the captured states and every output and final
    state are the split path's (same reference calls on the same rows), and the outputs and
    final states the uncut chunks' up to the reference's fp32 rounding."""
    starts = [sum(lengths[:j]) for j in range(len(lengths))]
    q, k, v, g, beta = _inputs(sum(lengths), seed=len(lengths))
    prefill = [(j, starts[j], n) for j, n in enumerate(lengths) if n > 1]
    splits = [CaptureSplit(j, starts[j], split, j, False) for j, split in cuts.items()]
    plan = build_in_pass_plan(prefill, splits, {}, {}, CPU)
    initial = torch.randn(len(prefill), H, K, V, generator=torch.Generator().manual_seed(5)) * 0.3
    states_out = torch.full((len(cuts), H, K, V), float("nan"))
    out = torch.full_like(v, float("nan"))
    final = rule_with_captures(_reference_rule, q, k, v, g, beta, initial, plan.split, states_out, out)
    prefill_rows = torch.cat([torch.arange(s, s + n) for _, s, n in prefill])
    assert not out[prefill_rows].isnan().any(), "a prefill row was not written"
    rule = lambda a, b, state: chunk_gated_delta_rule(  # noqa: E731
        q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state, SCALE, RULE_CHUNK)
    for p, (j, start, n) in enumerate(prefill):
        uncut_o, uncut_final = rule(start, start + n, initial[p])
        assert torch.allclose(out[start:start + n], uncut_o, rtol=1e-4, atol=1e-5), f"chunk {j} outputs"
        assert torch.allclose(final[p], uncut_final, rtol=1e-4, atol=1e-5), f"chunk {j} final state"
        if j not in cuts:
            continue
        cut = start + cuts[j]  # the split path: two steps, the second from the state at the cut
        head_o, at_cut = rule(start, cut, initial[p])
        tail_o, split_final = rule(cut, start + n, at_cut)
        c = list(cuts).index(j)
        assert torch.allclose(states_out[c], at_cut, rtol=1e-6, atol=1e-7), f"capture {c}"
        assert torch.allclose(out[start:start + n], torch.cat([head_o, tail_o]), rtol=1e-6, atol=1e-7)
        assert torch.allclose(final[p], split_final, rtol=1e-6, atol=1e-7)


def test_split_prefill_builds_the_calls_from_the_arrays():
    arrays = split_prefill_arrays([(0, 0, 10), (1, 10, 70)], [(1, 3)])
    split = split_prefill([torch.from_numpy(a) for a in arrays])
    assert split.heads.chunk_indices is None  # one capture: the fixed-length path
    assert split.tails.chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1]]
    assert split.heads.rows.tolist() == [10, 11, 12] and split.captured.tolist() == [1]


@pytest.mark.parametrize("device,world_size,expected", [("cuda", 1, True), ("cuda:0", 1, True),
                                                        ("cuda", 2, False), ("cpu", 1, False)])
def test_size_caches_offers_in_pass_capture_for_the_gated_delta_net(device, world_size, expected):
    """The worker reports in-pass capture for a Qwen3-Next on one CUDA rank, as for Mamba2."""
    from engine.parallel.cache_capacity import size_caches
    from engine.engine_config import EngineConfig
    from engine.model_config import GATED_DELTA_NET
    from engine.models.registry import parse_model_config
    from engine.parallel.tensor_parallel import TensorParallel

    raw = dict(
        model_type="qwen3_next", vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0, max_position_embeddings=256,
    )
    config = parse_model_config(raw)
    assert config.recurrent_kind == GATED_DELTA_NET
    capacity = size_caches(EngineConfig(device=device), config, TensorParallel(0, world_size, None))
    assert capacity.in_pass_capture is expected
