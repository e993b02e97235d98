"""The model's CUDA path (Triton kernels, batched decode) against its CPU fp32 path.

The embedded tiny model runs three steps that mix fresh prefills, continued prefills, a 1-token
prefill and decodes, on the CPU in fp32 and on CUDA in fp32 and bf16; the hidden states of every
step and the state slots afterwards must agree within the dtype's tolerance. One Mamba2 mixer
alone runs both of its paths on the same device (decode rows only also in Triton's interpreter).
The checkpoint's D is 1 in every head; the tests draw one per head, so that the D skip (inside
the gated norm on the GPU path) is checked head by head.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import DEFAULT_MODEL_DIR
from engine.kernels.gpu.batch_plan import build_gpu_batch_plan
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from engine.step_io import ScheduledChunk, SchedulerOutput
from engine.worker import build_forward_batch
from tests.gpu.conftest import INTERPRETED, needs_device, relative_error

pytestmark = [pytest.mark.gpu, needs_device]
needs_fla = pytest.mark.skipif(INTERPRETED, reason="fla-core kernels need a CUDA device")

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


def _draw_D(model) -> None:
    """A D per head of every Mamba2 mixer, the same on every device."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.layers:
            if layer.mamba is not None:
                layer.mamba.D.copy_(2 * torch.randn(layer.mamba.num_heads, generator=g))


def _run(device: str, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    model, config = load_model(DEFAULT_MODEL_DIR, dtype=dtype, device=device)
    _draw_D(model)
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


@needs_fla
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-2), (torch.bfloat16, 5e-2)])
def test_gpu_forward_matches_cpu(dtype, tol):
    ref_hiddens, ref_state = _run("cpu", torch.float32)
    hiddens, state = _run("cuda", dtype)
    for i, (h, ref) in enumerate(zip(hiddens, ref_hiddens)):
        assert relative_error(h, ref) < tol, f"step {i} hidden"
    assert relative_error(state, ref_state) < tol, "ssm state after the last step"


@pytest.mark.parametrize(
    "lengths,tol",
    [pytest.param([1, 1, 1, 1], 1e-5, marks=pytest.mark.skipif(  # decode rows only: our own kernels
        INTERPRETED, reason="the SSD decode kernel calls libdevice.log1p, which Triton's interpreter does not emulate")),
     pytest.param([5, 1, 17, 1], 1e-2, marks=needs_fla)],  # and prefill rows: fla's tf32 scan
)
def test_mixer_gpu_path_matches_its_pytorch_path(device, lengths, tol):
    """Mamba2Mixer.forward with a GpuBatchPlan (mix_batch_gpu, the D skip inside the gated
    norm) against the same mixer without one (the PyTorch path), fp32, on the same device:
    outputs and the state slots of every chunk; odd chunks reset over NaN-filled slots."""
    model, config = load_model(DEFAULT_MODEL_DIR, dtype=torch.float32, device=device)
    _draw_D(model)
    mixer = next(layer.mamba for layer in model.layers if layer.mamba is not None)
    g = torch.Generator().manual_seed(2)
    ids = lambda n: torch.randint(0, config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    resets = [i % 2 == 1 for i in range(len(lengths))]
    chunks = [_chunk(i, ids(n), 0 if reset else 3, reset) for i, (n, reset) in enumerate(zip(lengths, resets))]
    batch = build_forward_batch(chunks, BLOCK_SIZE, device)
    hidden = torch.randn(batch.num_tokens, config.hidden_size, generator=g).to(device)
    (conv_dim, taps), ssm_shape = model.mamba_state_shape()
    num_slots = len(lengths) + 1
    conv_state = torch.randn(num_slots, conv_dim, taps, generator=g).to(device)
    ssm_state = torch.randn(num_slots, *ssm_shape, generator=g).to(device)
    for c in chunks:
        if c.reset_state:
            conv_state[c.state_slot] = float("nan")
            ssm_state[c.state_slot] = float("nan")
    states = {path: (conv_state.clone(), ssm_state.clone()) for path in ("gpu", "pytorch")}

    with torch.inference_mode():
        plan = build_gpu_batch_plan(batch, BLOCK_SIZE, device)
        got = mixer(hidden, batch, *states["gpu"], gpu_plan=plan)
        want = mixer(hidden, batch, *states["pytorch"])
    assert relative_error(got, want) < tol, "output"
    for c in chunks:
        for got_state, want_state, name in zip(states["gpu"], states["pytorch"], ("conv", "ssm")):
            slot = c.state_slot
            assert relative_error(got_state[slot], want_state[slot]) < tol, f"{name} slot {slot}"
