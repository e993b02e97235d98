"""The model's CUDA path (Triton kernels, batched decode) against its CPU fp32 path.

The embedded tiny model runs three steps that mix fresh prefills, continued prefills, a 1-token
prefill and decodes, on the CPU in fp32 and on CUDA in fp32 and bf16; the hidden states of every
step and the state slots afterwards must agree within the dtype's tolerance.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import DEFAULT_MODEL_DIR
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from engine.step_io import ScheduledChunk, SchedulerOutput
from engine.worker import build_forward_batch
from tests.gpu.conftest import INTERPRETED, relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA device"),
]

BLOCK_SIZE = 16


def _chunk(request: int, tokens: list[int], start: int, reset: bool) -> ScheduledChunk:
    blocks = tuple(range(request * 8, request * 8 + 8))  # 128 positions per request
    return ScheduledChunk(
        request_id=f"r{request}", token_ids=tuple(tokens), start_position=start, block_table=blocks,
        state_slot=request + 1, reset_state=reset, sample=True, sampling=SamplingParams(),
    )


def _steps(vocab: int) -> list[SchedulerOutput]:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    return [
        SchedulerOutput((_chunk(0, ids(20), 0, True), _chunk(1, ids(7), 0, True))),
        SchedulerOutput((_chunk(1, ids(70), 7, False), _chunk(0, ids(1), 20, False),
                         _chunk(2, ids(1), 0, True))),
        SchedulerOutput((_chunk(2, ids(1), 1, False), _chunk(0, ids(1), 21, False),
                         _chunk(1, ids(1), 77, False))),
    ]


def _run(device: str, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    model, config = load_model(DEFAULT_MODEL_DIR, dtype=dtype, device=device)
    caches = model.allocate_caches(num_blocks=32, block_size=BLOCK_SIZE, num_state_slots=5, device=device)
    for layer in caches.ssm_state:  # slots start as garbage: reset chunks must not read them
        caches.ssm_state[layer].fill_(float("nan"))
        caches.conv_state[layer].fill_(float("nan"))
    hiddens = []
    with torch.inference_mode():
        for step in _steps(config.vocab_size):
            batch = build_forward_batch(list(step.chunks), BLOCK_SIZE, torch.device(device))
            hiddens.append(model(batch, caches).float().cpu())
    first_mamba = min(caches.ssm_state)
    return hiddens, caches.ssm_state[first_mamba][1:4].cpu()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-2), (torch.bfloat16, 5e-2)])
def test_gpu_forward_matches_cpu(dtype, tol):
    ref_hiddens, ref_state = _run("cpu", torch.float32)
    hiddens, state = _run("cuda", dtype)
    for i, (h, ref) in enumerate(zip(hiddens, ref_hiddens)):
        assert relative_error(h, ref) < tol, f"step {i} hidden"
    assert relative_error(state, ref_state) < tol, "ssm state after the last step"
