"""In-pass capture (CaptureOp.in_pass) against the split path on the tiny model, on CUDA.

Split path (what the scheduler does today): the chunk is cut at the capture position and the
capture is taken at the start of the next step. In-pass: one uncut chunk, the state at the
position read during the pass. The bundles (conv and SSM state of every recurrent layer, attention
tail, hidden row), the final state slots, the KV blocks and the sampled logits must agree. The
in-pass step mixes a capture at 37 of a fresh 70-token chunk, a capture 2 tokens into a
continued chunk (the conv state at the split then comes partly from the old conv state), a
prefill chunk without capture and a decode chunk.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import CaptureOp, ScheduledChunk, SchedulerOutput
from engine.execution.worker import Worker
from tests.gpu.conftest import INTERPRETED, relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA device"),
]

BLOCKS = 8  # per request; block size 16: 128 positions


def _chunk(request: int, tokens: list[int], start: int, sample: bool) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=f"r{request}", token_ids=tuple(tokens[start:]), start_position=start,
        block_table=tuple(range(request * BLOCKS, (request + 1) * BLOCKS)), state_slot=request,
        reset_state=start == 0, sample=sample,
        sampling=SamplingParams(temperature=0.0, max_tokens=4, return_logits=True),
    )


def _cut(request: int, tokens: list[int], start: int, end: int, sample: bool = False):
    return _chunk(request, tokens[:end], start, sample)


def _capture(bundle: int, request: int, position: int, in_pass: bool) -> CaptureOp:
    tail = request * BLOCKS + position // 16 if position % 16 else None
    return CaptureOp(bundle, f"r{request}", request, position, tail, in_pass=in_pass)


def _run(config: EngineConfig, in_pass: bool, seqs: dict[int, list[int]]):
    worker = Worker(config)
    a, b, d, e = seqs[0], seqs[1], seqs[2], seqs[3]
    worker.execute(SchedulerOutput((_cut(1, b, 0, 30), _cut(3, e, 0, 10))))
    if in_pass:
        out = worker.execute(SchedulerOutput(
            (_cut(0, a, 0, 70, True), _cut(1, b, 30, 60, True), _cut(2, d, 0, 20, True),
             _cut(3, e, 10, 11, True)),
            captures=(_capture(1, 0, 37, True), _capture(2, 1, 32, True)),
        ))
    else:
        worker.execute(SchedulerOutput(
            (_cut(0, a, 0, 37), _cut(1, b, 30, 32), _cut(2, d, 0, 20, True), _cut(3, e, 10, 11, True))
        ))
        out = worker.execute(SchedulerOutput(
            (_cut(0, a, 37, 70, True), _cut(1, b, 32, 60, True)),
            captures=(_capture(1, 0, 37, False), _capture(2, 1, 32, False)),
        ))
    assert set(out.confirmed_captures) == {1, 2}
    bundles = {i: worker.checkpoints._bundles[i] for i in (1, 2)}
    state = {r: worker.caches.read_state_slot(r) for r in range(4)}
    kv = [t[: 4 * BLOCKS].clone() for t in (*worker.caches.key_cache.values(), *worker.caches.value_cache.values())]
    return bundles, state, kv, {k: v for k, v in out.logits.items() if k in ("r0", "r1")}


@pytest.mark.parametrize("dtype,tol", [("float32", 5e-3), ("bfloat16", 5e-2)])
def test_in_pass_equals_split(dtype, tol):
    check_in_pass_equals_split(EngineConfig(device="cuda", dtype=dtype, max_num_seqs=8), tol)


def check_in_pass_equals_split(config: EngineConfig, tol: float) -> None:
    """The steps of the module doc on a Worker of `config` (block size 16, at least 4 state
    slots, a vocabulary of at least 200 tokens), in-pass against split: every bundle, state
    slot, KV block and sampled logits row within `tol` relative."""
    g = torch.Generator().manual_seed(60)
    seqs = {r: torch.randint(2, 200, (n,), generator=g).tolist() for r, n in enumerate((70, 60, 20, 11))}
    split = _run(config, False, seqs)
    fused = _run(config, True, seqs)
    for i in (1, 2):
        s, f = split[0][i], fused[0][i]
        assert relative_error(f.conv_state, s.conv_state) < tol, f"bundle {i} conv"
        assert relative_error(f.ssm_state, s.ssm_state) < tol, f"bundle {i} ssm"
        assert relative_error(f.hidden_row, s.hidden_row) < tol, f"bundle {i} hidden row"
        assert (f.tail_kv is None) == (s.tail_kv is None)
        if s.tail_kv is not None:
            assert relative_error(f.tail_kv, s.tail_kv) < tol, f"bundle {i} tail"
        assert f.nbytes == s.nbytes
    for r in range(4):
        for layer, (conv, ssm) in split[1][r].items():
            f_conv, f_ssm = fused[1][r][layer]
            assert relative_error(f_conv, conv) < tol, f"request {r} layer {layer} conv slot"
            assert relative_error(f_ssm, ssm) < tol, f"request {r} layer {layer} ssm slot"
    for s_kv, f_kv in zip(split[2], fused[2]):
        assert relative_error(f_kv, s_kv) < tol, "KV blocks"
    for request, logits in split[3].items():
        assert relative_error(fused[3][request], logits) < tol, f"{request} logits"
