"""The grouped expert GEMM (engine/kernels/gpu/grouped_experts.py) against its reference, the
loop over experts of engine/kernels/grouped_experts_reference.py, on the same random inputs:
gated SiLU and non-gated squared-ReLU experts (Nemotron-H's, ExpertActivation),
1, 7, 64 and 300 tokens, top-1, top-2 and top-8 of 8 experts, hidden and channel widths that
are not multiples of the kernel's tiles, a skewed routing (most pairs on one expert), the
block plan's invariants, and (GPU only) replays of a CUDA graph captured once with other
routings, which only holds if nothing in it synchronises with the host.

Under Triton's interpreter (TRITON_INTERPRET=1) the fp32 cases run on the CPU; bf16 and the
graph run on a GPU only. The kernel module is imported inside the tests: it needs triton,
which the CPU-only suite does not install.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.grouped_experts_reference import ExpertActivation
from engine.kernels.grouped_experts_reference import grouped_experts as reference
from tests.gpu.conftest import INTERPRETED, needs_device, relative_error

pytestmark = [pytest.mark.gpu, needs_device]

on_gpu_only = pytest.mark.skipif(INTERPRETED, reason="needs a CUDA device (bf16, CUDA graphs)")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=on_gpu_only)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
NUM_EXPERTS, HIDDEN, CHANNELS = 8, 96, 80


def _operands(num_tokens: int, top_k: int, dtype, device, seed: int, skewed: bool = False,
              activation: ExpertActivation = ExpertActivation.SILU_GATED):
    """hidden (T, D), gate_up (E, 2I, D) (or up (E, I, D) for RELU_SQUARED), down (E, D, I),
    ids (T, K) distinct per token (from random router logits, as top-k gives them), weights
    (T, K) softmax-normalised."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=g)
    rows = 2 * CHANNELS if activation is ExpertActivation.SILU_GATED else CHANNELS
    gate_up = torch.randn(NUM_EXPERTS, rows, HIDDEN, generator=g) / HIDDEN**0.5
    down = torch.randn(NUM_EXPERTS, HIDDEN, CHANNELS, generator=g) / CHANNELS**0.5
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=g)
    if skewed:
        logits[:, 3] += 10.0
    top, ids = logits.topk(top_k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(hidden), to(gate_up), to(down), ids.to(device), to(weights)


@pytest.mark.parametrize("activation", list(ExpertActivation))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_matches_reference(device, dtype, top_k, num_tokens, activation):
    from engine.kernels.gpu.grouped_experts import grouped_experts

    hidden, gate_up, down, ids, weights = _operands(
        num_tokens, top_k, dtype, device, seed=num_tokens + top_k, activation=activation
    )
    got = grouped_experts(hidden, gate_up, down, ids, weights, activation)
    want = reference(hidden, gate_up, down, ids, weights, activation)
    assert got.shape == want.shape and got.dtype == dtype
    assert relative_error(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_skewed_routing_matches_reference(device, dtype):
    from engine.kernels.gpu.grouped_experts import grouped_experts

    hidden, gate_up, down, ids, weights = _operands(300, 2, dtype, device, seed=5, skewed=True)
    assert (ids == 3).sum() == 300
    got = grouped_experts(hidden, gate_up, down, ids, weights)
    assert relative_error(got, reference(hidden, gate_up, down, ids, weights)) < TOL[dtype]


@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (7, 8), (300, 2)])
def test_block_plan_covers_every_pair_once(device, num_tokens, top_k):
    from engine.kernels.gpu.grouped_experts import block_rows, expert_blocks

    *_, ids, _ = _operands(num_tokens, top_k, torch.float32, device, seed=1)
    num_pairs = num_tokens * top_k
    block_m = block_rows(num_pairs, NUM_EXPERTS)
    rows, blocks = expert_blocks(ids, NUM_EXPERTS, block_m)
    rows, blocks = rows.cpu(), blocks.cpu()
    assert blocks.numel() == -(-num_pairs // block_m) + min(NUM_EXPERTS, num_pairs)
    real = rows[rows < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # each pair in exactly one row
    flat = ids.reshape(-1).cpu()
    for block, expert in enumerate(blocks.tolist()):
        block_pairs = rows[block * block_m:(block + 1) * block_m]
        block_pairs = block_pairs[block_pairs < num_pairs].long()
        if expert >= NUM_EXPERTS:
            assert block_pairs.numel() == 0
        else:
            assert block_pairs.numel() > 0 and (flat[block_pairs] == expert).all()


@on_gpu_only
@pytest.mark.parametrize("activation", list(ExpertActivation))
@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (64, 8)])
def test_replays_in_a_cuda_graph(device, num_tokens, top_k, activation):
    """Captured once, replayed with other routings: any host read of the routing would have
    been frozen into the graph (or failed the capture)."""
    from engine.kernels.gpu.grouped_experts import grouped_experts

    operands = lambda seed: _operands(  # noqa: E731
        num_tokens, top_k, torch.bfloat16, device, seed=seed, activation=activation
    )
    hidden, gate_up, down, ids, weights = operands(0)
    grouped_experts(hidden, gate_up, down, ids, weights, activation)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_experts(hidden, gate_up, down, ids, weights, activation)
    for seed in (1, 2, 3):
        new_hidden, _, _, new_ids, new_weights = operands(seed)
        hidden.copy_(new_hidden)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        want = reference(hidden, gate_up, down, ids, weights, activation)
        assert relative_error(out, want) < TOL[torch.bfloat16]


# -- the MoE model's CUDA forward ---------------------------------------------------------------

MOE_RAW = dict(
    model_type="granitemoehybrid", vocab_size=97, hidden_size=64, num_hidden_layers=4,
    layer_types=["mamba", "attention", "mamba", "mamba"], num_attention_heads=4,
    num_key_value_heads=2, position_embedding_type="nope", attention_multiplier=0.15,
    shared_intermediate_size=96, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
    mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16,
    embedding_multiplier=6.0, residual_multiplier=0.5, logits_scaling=2.5, max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A random MoE checkpoint whose router logits are far apart (router weights x10), so the
    GPU's rounding does not flip a token's experts at a near-tie."""
    from safetensors.torch import load_file, save_file

    from tests.tp.tp_support import write_random_checkpoint

    directory = write_random_checkpoint(tmp_path_factory.mktemp("moe_gpu"), MOE_RAW)
    tensors = load_file(str(directory / "model.safetensors"))
    for name in tensors:
        if name.endswith("router.layer.weight"):
            tensors[name] = tensors[name] * 10
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def _moe_chunk(request: int, tokens: list[int], start: int, reset: bool):
    from engine.interfaces.sampling_params import SamplingParams
    from engine.interfaces.step_io import ScheduledChunk

    blocks = tuple(range(request * 8, request * 8 + 8))
    return ScheduledChunk(
        request_id=f"r{request}", token_ids=tuple(tokens), start_position=start, block_table=blocks,
        state_slot=request, reset_state=reset, sample=True, sampling=SamplingParams(),
    )


def _moe_hiddens(model_dir, device: str, dtype) -> list[torch.Tensor]:
    from engine.interfaces.forward_batch import build_forward_batch
    from engine.execution.loader import load_model
    from tests.gpu.conftest import eager_forward

    model, config = load_model(model_dir, dtype=dtype, device=device)
    caches = model.allocate_caches(num_blocks=40, block_size=16, num_state_slots=4, device=device)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    steps = [
        [_moe_chunk(0, ids(40), 0, True), _moe_chunk(1, ids(9), 0, True)],
        [_moe_chunk(0, ids(1), 40, False), _moe_chunk(1, ids(30), 9, False), _moe_chunk(2, ids(1), 0, True)],
        [_moe_chunk(0, ids(1), 41, False), _moe_chunk(1, ids(1), 39, False), _moe_chunk(2, ids(1), 1, False)],
    ]
    hiddens = []
    with torch.inference_mode():
        for chunks in steps:
            batch = build_forward_batch(chunks, 16, torch.device(device))
            hiddens.append(eager_forward(model, batch, caches).float().cpu())
    return hiddens


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-2), (torch.bfloat16, 5e-2)])
def test_moe_model_gpu_forward_matches_cpu(moe_dir, dtype, tol):
    """The MoE model's CUDA forward (gpu_plan: RoutedExperts.forward_gpu, the grouped GEMM)
    against its CPU fp32 path over prefill, mixed and decode steps."""
    want = _moe_hiddens(moe_dir, "cpu", torch.float32)
    got = _moe_hiddens(moe_dir, "cuda", dtype)
    for step, (g, w) in enumerate(zip(got, want)):
        assert relative_error(g, w) < tol, f"step {step}"


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA device")
def test_moe_decode_graph_matches_eager(moe_dir):
    """DecodeGraphRunner captures the MoE model's decode forward (the grouped GEMM inside) and
    its replays give the eager pass's hidden states."""
    from dataclasses import replace

    from engine.routes.decode_graphs import DecodeGraphRunner
    from engine.interfaces.forward_batch import build_forward_batch
    from engine.routes.forward_routes import GraphScratch
    from engine.execution.loader import load_model
    from tests.gpu.conftest import eager_forward

    device = torch.device("cuda")
    model, config = load_model(moe_dir, dtype=torch.bfloat16, device=device)
    num_requests, blocks_per_seq = 6, 8
    num_blocks = num_requests * blocks_per_seq
    eager = model.allocate_caches(num_blocks + 1, 16, num_requests + 1, device=device)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    lengths = [5 + 4 * r for r in range(num_requests)]
    with torch.inference_mode():
        prefill = [_moe_chunk(r, ids(n), 0, True) for r, n in enumerate(lengths)]
        eager_forward(model, build_forward_batch(prefill, 16, device), eager)
    copy = lambda d: {k: v.clone() for k, v in d.items()}  # noqa: E731
    graphed = replace(eager, key_cache=copy(eager.key_cache), value_cache=copy(eager.value_cache),
                      conv_state=copy(eager.conv_state), ssm_state=copy(eager.ssm_state))
    runner = DecodeGraphRunner(model, graphed, (1, 4, 8),
                               GraphScratch(blocks_per_seq, scratch_slot=num_requests, scratch_block=num_blocks))
    runner.capture()
    positions = list(lengths)
    for step, n in enumerate([1, 3, 6, 4]):
        chunks = [_moe_chunk(r, ids(1), positions[r], False) for r in range(n)]
        with torch.inference_mode():
            h_eager = eager_forward(model, build_forward_batch(chunks, 16, device), eager)
            assert runner.accepts(chunks)
            h_graph, _, _ = runner.forward(chunks)
        assert relative_error(h_graph, h_eager) < 2e-2, f"step {step}"
        for r in range(n):
            positions[r] += 1
