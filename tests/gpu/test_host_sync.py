"""On CUDA a step's submit never waits for the device (issue 5: no host synchronisation inside
the step beyond reading the sampled tokens back, which collect does). Each kind of step is run
once to compile and autotune its kernels (autotuning synchronises), then submitted again under
torch's sync debug mode "error", which raises at any synchronising call: a blocking copy, a
copy to pageable memory, an .item(), a stream synchronise."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import CaptureOp, RestoreOp, ScheduledChunk, SchedulerOutput

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIG = EngineConfig(device="cuda", max_model_len=1024, max_num_batched_tokens=1024,
                      kv_cache_bytes=32 << 20, state_cache_bytes=32 << 20)
BLOCKS_PER_REQUEST = 64  # 1,024 positions at the default block size of 16


@pytest.fixture(scope="module")
def worker():
    from engine.execution.worker import Worker

    worker = Worker(CONFIG)
    assert worker.capacity.block_size * BLOCKS_PER_REQUEST >= CONFIG.max_model_len
    assert worker.capacity.num_blocks >= 4 * BLOCKS_PER_REQUEST and worker.capacity.num_state_slots >= 4
    return worker


def _chunk(request: int, num_tokens: int, start: int = 0) -> ScheduledChunk:
    """Greedy chunk of request `request` (its state slot and its own blocks), resetting its state
    when it starts the sequence."""
    blocks = tuple(range(request * BLOCKS_PER_REQUEST, (request + 1) * BLOCKS_PER_REQUEST))
    tokens = tuple(range(3 + start, 3 + start + num_tokens))
    return ScheduledChunk(
        request_id=f"r{request}", token_ids=tokens, start_position=start, block_table=blocks,
        state_slot=request, reset_state=start == 0, sample=True,
        sampling=SamplingParams(temperature=0.0, max_tokens=4),
    )


@contextlib.contextmanager
def sync_is_an_error() -> Iterator[None]:
    """Within the block, every call that synchronises the host with the device raises (sync
    debug mode "error"); back to "default" after it."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _submit_without_waiting(worker, step: SchedulerOutput):
    """Run the step once to warm up, then again with every synchronising call an error; the
    second run's output."""
    worker.execute(step)
    torch.cuda.synchronize()
    with sync_is_an_error():
        worker.submit(step)
    return worker.collect()


def test_eager_prefill_of_two_chunks_does_not_wait(worker):
    """Two prefill chunks (no CUDA graph takes them): the forward batch, its GPU plan and the
    sampled rows' gather."""
    out = _submit_without_waiting(worker, SchedulerOutput((_chunk(0, 600), _chunk(1, 300))))
    assert set(out.sampled_token_ids) == {"r0", "r1"}


@pytest.mark.parametrize("beside", [0, 1])  # with another prefill chunk: the scan's varlen path
def test_in_pass_capture_step_does_not_wait(worker, beside):
    """A prefill chunk that takes the checkpoint at token 512 inside its forward pass, alone or
    beside another request's prefill chunk."""
    chunks = (_chunk(2, 700),) + ((_chunk(0, 300),) if beside else ())
    step = lambda bundle: SchedulerOutput(  # noqa: E731
        chunks, captures=(CaptureOp(bundle, "r2", 2, 512, None, in_pass=True),),
    )
    worker.execute(step(1))
    out = _submit_without_waiting(worker, step(2))
    assert out.confirmed_captures.get(2) and "r2" in out.sampled_token_ids
    assert len(out.sampled_token_ids) == len(chunks)


def test_restore_and_graphed_prefill_do_not_wait(worker):
    """The restore of that checkpoint into a new request, then its 100-token message through a
    prefill CUDA graph."""
    worker.execute(SchedulerOutput((_chunk(2, 700),), captures=(CaptureOp(3, "r2", 2, 512, None, in_pass=True),)))
    from dataclasses import replace

    shared = BLOCKS_PER_REQUEST * 2 + 512 // worker.capacity.block_size  # request 2's blocks of the prefix
    message = _chunk(3, 100, start=512)
    message = replace(message, block_table=tuple(range(BLOCKS_PER_REQUEST * 2, shared)) + message.block_table[:32])
    replays = worker.prefill_graphs.replays
    out = _submit_without_waiting(worker, SchedulerOutput((message,), restores=(RestoreOp(3, "r3", 3, None),)))
    assert worker.prefill_graphs.replays == replays + 2 and "r3" in out.sampled_token_ids


def test_decode_step_does_not_wait(worker):
    """Two decode rows through a decode CUDA graph."""
    worker.execute(SchedulerOutput((_chunk(0, 20), _chunk(1, 20))))
    replays = worker.decode_graphs.replays
    out = _submit_without_waiting(worker, SchedulerOutput((_chunk(0, 1, start=20), _chunk(1, 1, start=20))))
    assert set(out.sampled_token_ids) == {"r0", "r1"}
    assert worker.decode_graphs.replays == replays + 2  # the warm-up run and the checked one
