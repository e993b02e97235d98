"""Graph-replayed short prefill (engine/routes/prefill_graphs.py) against the eager CUDA pass.

Two copies of the same caches: one runs each single-chunk prefill step eagerly, the other
through PrefillGraphRunner (chunks shorter than, equal to and between the captured sizes; fresh
prompts and continuations over cached keys and carried state). The last hidden row and its
logits must agree, every real state slot and KV block must hold the same values, and slots and
blocks the chunk does not own must be bit-for-bit untouched (padding writes only the scratch
slot and block, and leaves the chunk's own state as after its last real token).
"""

from __future__ import annotations

import pytest
import torch

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.execution.loader import load_model
from engine.routes.prefill_graphs import PrefillGraphRunner
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import ScheduledChunk
from engine.interfaces.forward_batch import build_forward_batch
from engine.routes.forward_routes import GraphScratch
from tests.gpu.conftest import INTERPRETED, eager_forward, relative_error
from tests.gpu.test_cuda_graphs import _clone, _real

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA device"),
]

BLOCK_SIZE = 16
BLOCKS_PER_SEQ = 48  # 768 tokens
NUM_REQUESTS = 5
CAPTURED = (64, 128, 256)


def _chunk(request: int, tokens: list[int], start: int, reset: bool) -> ScheduledChunk:
    first = request * BLOCKS_PER_SEQ
    return ScheduledChunk(
        request_id=f"r{request}", token_ids=tuple(tokens), start_position=start,
        block_table=tuple(range(first, first + BLOCKS_PER_SEQ)), state_slot=request,
        reset_state=reset, sample=True, sampling=SamplingParams(),
    )


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_graph_prefill_matches_eager(dtype, tol):
    device = torch.device("cuda")
    model, config = load_model(DEFAULT_MODEL_DIR, dtype=dtype, device=device)
    num_blocks, num_slots = NUM_REQUESTS * BLOCKS_PER_SEQ, NUM_REQUESTS
    eager = model.allocate_caches(num_blocks + 1, BLOCK_SIZE, num_slots + 1, device=device)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    with torch.inference_mode():  # request 4 holds a long prefix computed eagerly in both copies
        eager_forward(model, build_forward_batch([_chunk(4, ids(300), 0, True)], BLOCK_SIZE, device), eager)
    graphed = _clone(eager)
    runner = PrefillGraphRunner(
        model, graphed, CAPTURED, GraphScratch(BLOCKS_PER_SEQ, scratch_slot=num_slots, scratch_block=num_blocks)
    )
    runner.capture()  # warm-up and capture write only the scratch slot and block
    for a, b in zip(_real(eager, num_slots, num_blocks).values(), _real(graphed, num_slots, num_blocks).values()):
        assert torch.equal(a, b)

    # (request, tokens, start position); a start of 0 resets the state
    steps = [(0, 37, 0), (1, 64, 0), (0, 100, 37), (2, 5, 0), (2, 200, 5), (1, 2, 64), (4, 256, 300),
             (3, 129, 0), (4, 17, 556)]
    for step, (r, n, start) in enumerate(steps):
        chunk = _chunk(r, ids(n), start, start == 0)
        before = {k: v.clone() for k, v in _real(graphed, num_slots, num_blocks).items()}
        with torch.inference_mode():
            h_eager = eager_forward(model, build_forward_batch([chunk], BLOCK_SIZE, device), eager)[-1]
            assert runner.accepts([chunk])
            h_graph = runner.forward(chunk)
            l_eager, l_graph = (model.compute_logits(h[None])[0] for h in (h_eager, h_graph))
        assert relative_error(h_graph, h_eager) < tol, f"step {step} (n={n}) hidden"
        assert relative_error(l_graph, l_eager) < tol, f"step {step} (n={n}) logits"
        gap = (l_graph - l_eager).abs().max()
        top2 = l_eager.topk(2).values
        assert l_graph.argmax() == l_eager.argmax() or top2[0] - top2[1] <= 2 * gap, f"step {step} token"
        own_blocks = set(chunk.block_table[start // BLOCK_SIZE : -(-(start + n) // BLOCK_SIZE)])
        expected = _real(eager, num_slots, num_blocks)
        for name, now in _real(graphed, num_slots, num_blocks).items():
            touched = {r} if "state" in name else own_blocks
            for i in touched:  # what this step wrote, slot by slot and block by block
                assert relative_error(now[i], expected[name][i]) < tol, f"step {step}: {name}[{i}]"
            for i in range(now.shape[0]):
                if i not in touched:
                    assert torch.equal(now[i], before[name][i]), f"step {step}: {name}[{i}] written"
    assert runner.replays == len(steps)
    assert not runner.accepts([_chunk(0, ids(257), 0, True)])  # above the largest size: eager
    assert not runner.accepts([_chunk(0, ids(3), 0, True), _chunk(1, ids(3), 0, True)])


def test_worker_prefill_graph_tokens(tmp_path):
    """Worker on CUDA: a single-chunk prefill step replays a graph and samples the token the
    eager model pass gives; a two-chunk step runs eagerly."""
    from engine.engine_config import EngineConfig
    from engine.interfaces.step_io import SchedulerOutput
    from engine.execution.worker import Worker

    config = EngineConfig(model_dir=str(DEFAULT_MODEL_DIR), device="cuda", dtype="float32", max_num_seqs=4)
    worker = Worker(config)
    assert worker.prefill_graphs is not None
    cap = worker.capacity
    ref = worker.model.allocate_caches(cap.num_blocks + 1, cap.block_size, cap.num_state_slots + 1, device="cuda")
    blocks = -(-640 // cap.block_size)

    def chunk(r, tokens, start):
        return ScheduledChunk(
            request_id=f"r{r}", token_ids=tuple(tokens), start_position=start,
            block_table=tuple(range(r * blocks, (r + 1) * blocks)), state_slot=r, reset_state=start == 0,
            sample=True, sampling=SamplingParams(temperature=0.0),
        )

    g = torch.Generator().manual_seed(2)
    tokens = lambda n: torch.randint(2, 100, (n,), generator=g).tolist()  # noqa: E731
    steps = [[chunk(0, tokens(40), 0)], [chunk(0, tokens(300), 40)], [chunk(1, tokens(9), 0), chunk(2, tokens(7), 0)]]
    for step in steps:
        out = worker.execute(SchedulerOutput(tuple(step)))
        with torch.inference_mode():
            batch = build_forward_batch(step, cap.block_size, worker.device)
            hidden = eager_forward(worker.model, batch, ref)
            ends = torch.tensor(batch.cu_seqlens[1:], device="cuda") - 1
            expected = worker.model.compute_logits(hidden[ends]).argmax(-1).tolist()
        assert [out.sampled_token_ids[c.request_id] for c in step] == expected
    assert worker.prefill_graphs.replays == 2
