"""Graph-replayed decode (engine/routes/decode_graphs.py) against the eager CUDA decode pass.

Two copies of the same caches, filled by the same eager prefill: one then decodes eagerly, the
other through DecodeGraphRunner, for batch sizes on and between the captured sizes. Hidden
states, logits (the graph's own LM head against the eager one) and greedy tokens must agree,
every real state slot and KV block must hold the same values, and slots and blocks of
requests outside the batch must be bit-for-bit untouched (padding rows write only the
scratch slot and block).
"""

from __future__ import annotations

import pytest
import torch

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.routes.decode_graphs import DecodeGraphRunner, decode_batch_sizes
from engine.execution.loader import load_model
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import ScheduledChunk
from engine.interfaces.forward_batch import build_forward_batch
from engine.routes.forward_routes import GraphScratch
from tests.gpu.conftest import INTERPRETED, eager_forward, relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA device"),
]

BLOCK_SIZE = 16
BLOCKS_PER_SEQ = 8
NUM_REQUESTS = 20
CAPTURED = (1, 4, 8, 16)  # batches of 3, 5, 13 fall between captured sizes


def _chunk(request: int, tokens: list[int], start: int, reset: bool) -> ScheduledChunk:
    first = request * BLOCKS_PER_SEQ
    return ScheduledChunk(
        request_id=f"r{request}", token_ids=tuple(tokens), start_position=start,
        block_table=tuple(range(first, first + BLOCKS_PER_SEQ)), state_slot=request,
        reset_state=reset, sample=True, sampling=SamplingParams(),
    )


def _clone(caches):
    from dataclasses import replace

    copy = lambda d: {k: v.clone() for k, v in d.items()}  # noqa: E731
    return replace(
        caches, key_cache=copy(caches.key_cache), value_cache=copy(caches.value_cache),
        conv_state=copy(caches.conv_state), ssm_state=copy(caches.ssm_state),
    )


def _real(caches, num_slots: int, num_blocks: int) -> dict[str, torch.Tensor]:
    """Every cache tensor without the scratch slot / block (the last of each)."""
    out = {}
    for name in ("conv_state", "ssm_state"):
        for layer, t in getattr(caches, name).items():
            out[f"{name}{layer}"] = t[:num_slots]
    for name in ("key_cache", "value_cache"):
        for layer, t in getattr(caches, name).items():
            out[f"{name}{layer}"] = t[:num_blocks]
    return out


def test_decode_sizes():
    assert decode_batch_sizes(1) == (1,)
    assert decode_batch_sizes(40) == (1, 2, 4, 8, 16, 32, 40)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_graph_decode_matches_eager(dtype, tol):
    device = torch.device("cuda")
    model, config = load_model(DEFAULT_MODEL_DIR, dtype=dtype, device=device)
    num_blocks, num_slots = NUM_REQUESTS * BLOCKS_PER_SEQ, NUM_REQUESTS
    eager = model.allocate_caches(num_blocks + 1, BLOCK_SIZE, num_slots + 1, device=device)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    lengths = [5 + 3 * r for r in range(NUM_REQUESTS)]  # different contexts, up to 62 tokens
    with torch.inference_mode():
        prefill = [_chunk(r, ids(n), 0, True) for r, n in enumerate(lengths)]
        eager_forward(model, build_forward_batch(prefill, BLOCK_SIZE, device), eager)
    graphed = _clone(eager)
    runner = DecodeGraphRunner(
        model, graphed, CAPTURED, GraphScratch(BLOCKS_PER_SEQ, scratch_slot=num_slots, scratch_block=num_blocks)
    )
    runner.capture()  # warm-up and capture write only the scratch slot and block
    for a, b in zip(_real(eager, num_slots, num_blocks).values(), _real(graphed, num_slots, num_blocks).values()):
        assert torch.equal(a, b)

    positions = list(lengths)
    batches = [1, 3, 4, 5, 13, 16, 2, 7]
    for step, n in enumerate(batches):
        requests = [(step * 3 + k) % NUM_REQUESTS for k in range(n)]
        # request 19 decodes its first token as a reset 1-token chunk at position 0 in step 2
        chunks = [_chunk(r, ids(1), positions[r], False) for r in requests]
        if step == 2:
            chunks[0] = _chunk(requests[0], ids(1), 0, True)
            positions[requests[0]] = 0
        before = {k: v.clone() for k, v in _real(graphed, num_slots, num_blocks).items()}
        with torch.inference_mode():
            h_eager = eager_forward(model, build_forward_batch(chunks, BLOCK_SIZE, device), eager)
            assert runner.accepts(chunks)
            h_graph, l_graph, argmax = runner.forward(chunks)  # the LM head ran inside the graph
            l_eager = model.compute_logits(h_eager)
        assert h_graph.shape == h_eager.shape and l_graph.shape == l_eager.shape
        assert relative_error(h_graph, h_eager) < tol, f"step {step} (n={n}) hidden"
        assert relative_error(l_graph, l_eager) < tol, f"step {step} (n={n}) logits"
        assert torch.equal(argmax, l_graph.argmax(-1)), f"step {step} (n={n}) the graph's argmax"
        top2 = l_eager.topk(2, dim=-1).values
        near_tie = (top2[:, 0] - top2[:, 1]) <= 2 * (l_graph - l_eager).abs().max(-1).values
        assert bool(((l_graph.argmax(-1) == l_eager.argmax(-1)) | near_tie).all()), f"step {step} tokens"
        for name, a in _real(eager, num_slots, num_blocks).items():
            assert relative_error(_real(graphed, num_slots, num_blocks)[name], a) < tol, f"step {step} {name}"
        touched_slots = {c.state_slot for c in chunks}
        touched_blocks = {c.block_table[c.start_position // BLOCK_SIZE] for c in chunks}
        for name, now in _real(graphed, num_slots, num_blocks).items():
            touched = touched_slots if "state" in name else touched_blocks
            for i in range(now.shape[0]):
                if i not in touched:
                    assert torch.equal(now[i], before[name][i]), f"step {step}: {name}[{i}] written"
        for r in requests:
            positions[r] += 1
    assert runner.replays == len(batches)


def test_worker_uses_graphs_for_decode(tmp_path):
    """Worker on CUDA: prefill eagerly, decode through the graphs, greedy tokens equal to an
    eager model run of the same steps."""
    from engine.engine_config import EngineConfig
    from engine.interfaces.step_io import SchedulerOutput
    from engine.execution.worker import Worker

    config = EngineConfig(model_dir=str(DEFAULT_MODEL_DIR), device="cuda", dtype="float32", max_num_seqs=6)
    worker = Worker(config)
    assert worker.decode_graphs is not None
    cap = worker.capacity
    model = worker.model
    ref = model.allocate_caches(cap.num_blocks + 1, cap.block_size, cap.num_state_slots + 1, device="cuda")
    blocks = -(-64 // cap.block_size)

    def chunk(r, tokens, start, reset):
        return ScheduledChunk(
            request_id=f"r{r}", token_ids=tuple(tokens), start_position=start,
            block_table=tuple(range(r * blocks, (r + 1) * blocks)), state_slot=r, reset_state=reset,
            sample=True, sampling=SamplingParams(temperature=0.0),
        )

    g = torch.Generator().manual_seed(1)
    prompts = {r: torch.randint(2, 100, (4 + r,), generator=g).tolist() for r in range(3)}
    step = [chunk(r, p, 0, True) for r, p in prompts.items()]
    lengths = {r: len(p) for r, p in prompts.items()}
    for _ in range(5):
        out = worker.execute(SchedulerOutput(tuple(step)))
        with torch.inference_mode():
            hidden = eager_forward(model, build_forward_batch(step, cap.block_size, worker.device), ref)
            ends = torch.tensor(build_forward_batch(step, cap.block_size, worker.device).cu_seqlens[1:]) - 1
            expected = model.compute_logits(hidden[ends.cuda()]).argmax(-1).tolist()
        assert [out.sampled_token_ids[f"r{r}"] for r in range(3)] == expected
        step = [chunk(r, (out.sampled_token_ids[f"r{r}"],), lengths[r], False) for r in range(3)]
        for r in range(3):
            lengths[r] += 1
    assert worker.decode_graphs.replays == 4


def test_pipelined_graph_steps_read_the_pending_token_on_the_device():
    """Worker on CUDA, steps submitted before the one before is collected, each decode chunk
    given PENDING_TOKEN: the graphs read the token the previous step sampled (its argmax, or
    a drawn row's token) from the token pool, so the tokens and logits equal those of a worker
    that is given every token."""
    from engine.engine_config import EngineConfig
    from engine.interfaces.request import PENDING_TOKEN
    from engine.interfaces.step_io import SchedulerOutput
    from engine.execution.worker import Worker

    # steps of at most 18 tokens: a budget below 64 captures no prefill graphs, whose warm-up
    # would compile and autotune fla's single-sequence scan in fp32 for nothing here
    config = EngineConfig(model_dir=str(DEFAULT_MODEL_DIR), device="cuda", dtype="float32", max_num_seqs=6,
                          max_num_batched_tokens=63)
    known, pipelined = Worker(config), Worker(config)
    assert known.prefill_graphs is None
    blocks = -(-64 // known.capacity.block_size)
    params = [SamplingParams(temperature=0.0, return_logits=True),
              SamplingParams(temperature=1.0, seed=7, return_logits=True),
              SamplingParams(temperature=0.0, return_logits=True)]

    def chunk(r, tokens, start):
        return ScheduledChunk(
            request_id=f"r{r}", token_ids=tuple(tokens), start_position=start,
            block_table=tuple(range(r * blocks, (r + 1) * blocks)), state_slot=r, reset_state=start == 0,
            sample=True, sampling=params[r],
        )

    g = torch.Generator().manual_seed(2)
    history = {r: torch.randint(2, 100, (5 + r,), generator=g).tolist() for r in range(3)}
    first = SchedulerOutput(tuple(chunk(r, history[r], 0) for r in range(3)))
    expected = known.execute(first)
    pipelined.submit(first)
    for _ in range(5):
        for r in range(3):
            history[r].append(expected.sampled_token_ids[f"r{r}"])
        pipelined.submit(SchedulerOutput(tuple(chunk(r, (PENDING_TOKEN,), len(history[r]) - 1) for r in range(3))))
        got = pipelined.collect()
        assert got.sampled_token_ids == expected.sampled_token_ids
        for request_id, logits in expected.logits.items():
            assert relative_error(got.logits[request_id], logits) < 1e-4, request_id
        expected = known.execute(SchedulerOutput(tuple(chunk(r, history[r][-1:], len(history[r]) - 1) for r in range(3))))
    assert pipelined.collect().sampled_token_ids == expected.sampled_token_ids
    assert pipelined.decode_graphs.replays == known.decode_graphs.replays == 5
