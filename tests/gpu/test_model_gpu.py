"""The model's CUDA path (Triton kernels, batched decode) against its CPU fp32 path.

The embedded tiny model runs three steps that mix fresh prefills, continued prefills, a 1-token
prefill and decodes, on the CPU in fp32 and on CUDA in fp32 and bf16; the hidden states of every
step and the state slots afterwards must agree within the dtype's tolerance. One Mamba2 mixer
alone runs both of its paths on the same device (decode rows only also in Triton's interpreter).
The checkpoint's D is 1 in every head; the tests draw one per head, so that the D skip (inside
the gated norm on the GPU path) is checked head by head.

The gated MLP's GPU path takes the single-row GEMM's gated prologue at one row (no SiLU-and-mul
launch) and the separate activation kernel otherwise; both against its PyTorch path, also in
Triton's interpreter, where the routing rule's CUDA check is dropped so the kernels run on CPU
tensors. RowParallelLinear.forward_gated keeps forward's all-reduce and bias handling (checked
with a stand-in for two ranks).
"""

from __future__ import annotations

import pytest
import torch

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.kernels.gpu.batch_plan import build_gpu_batch_plan
from engine.layers import parallel_linear
from engine.layers.mlp import GatedMLP
from engine.layers.parallel_linear import RowParallelLinear
from engine.execution.loader import load_model
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import ScheduledChunk, SchedulerOutput
from engine.parallel.tensor_parallel import TensorParallel
from engine.interfaces.forward_batch import build_forward_batch
from tests.gpu.conftest import INTERPRETED, eager_forward, needs_device, needs_log1p, relative_error

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
            hiddens.append(eager_forward(model, batch, caches).float().cpu())
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
    [pytest.param([1, 1, 1, 1], 1e-5, marks=needs_log1p),  # decode rows only: our own kernels
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


def _route_on_any_device(monkeypatch) -> None:
    """parallel_linear.routes_to_skinny without its CUDA check (the rest of the rule kept):
    under Triton's interpreter the kernels run on CPU tensors."""
    from engine.kernels.gpu.skinny_gemm import layout_problem

    def rule(x, weight, bias, *, gated=False):
        return x.shape[0] == 1 and layout_problem(x, weight, bias, gated=gated) is None

    monkeypatch.setattr(parallel_linear, "routes_to_skinny", rule)


def _record_launches(monkeypatch) -> list[str]:
    """Wraps the single-row GEMM launcher and the SiLU-and-mul kernel; the returned list gets
    "skinny", "skinny gated" or "silu_and_mul" per call, in order."""
    from engine.kernels.gpu import activation, skinny_gemm

    launches: list[str] = []
    skinny, silu_and_mul = skinny_gemm.skinny_linear_unchecked, activation.silu_and_mul

    def recorded_skinny(*args, gated=False, **kwargs):
        launches.append("skinny gated" if gated else "skinny")
        return skinny(*args, gated=gated, **kwargs)

    def recorded_silu_and_mul(*args, **kwargs):
        launches.append("silu_and_mul")
        return silu_and_mul(*args, **kwargs)

    monkeypatch.setattr(skinny_gemm, "skinny_linear_unchecked", recorded_skinny)
    monkeypatch.setattr(activation, "silu_and_mul", recorded_silu_and_mul)
    return launches


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn at nn.Linear's scale (1 / sqrt(fan_in) for weights)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            fan_in = param.shape[-1] if param.dim() == 2 else 1
            param.copy_(torch.randn(param.shape, generator=g) / fan_in**0.5)


@pytest.mark.parametrize("rows", [1, 2])
def test_mlp_gpu_path_fuses_the_activation_at_one_row(device, monkeypatch, rows):
    """GatedMLP.forward_gpu at one row: the input GEMM, then the gated output GEMM, no
    SiLU-and-mul launch; at two rows: F.linear, the SiLU-and-mul kernel, F.linear. Both match
    forward (F.linear, norm_reference.silu_and_mul) in fp32. D = 44 and I = 100 are not
    multiples of the tile sizes."""
    hidden, intermediate = 44, 100
    mlp = GatedMLP(hidden, intermediate, (0, intermediate), TensorParallel.single(), torch.float32).to(device)
    _randomise(mlp, seed=3)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(4)).to(device)
    with torch.inference_mode():
        want = mlp(x)  # before the rule is patched: the PyTorch path throughout
        if device.type == "cpu":  # the real rule keeps CPU tensors off the kernel
            assert not mlp.output_linear.supports_gated(torch.zeros(1, 2 * intermediate))
        _route_on_any_device(monkeypatch)
        launches = _record_launches(monkeypatch)
        got = mlp.forward_gpu(x)
    assert launches == (["skinny", "skinny gated"] if rows == 1 else ["silu_and_mul"])
    assert relative_error(got, want) < 1e-5


class _TwoEqualRanks:
    """Stands in for a TensorParallel of two ranks holding equal shards: all_reduce doubles."""

    world_size = 2

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + tensor


@pytest.mark.parametrize("tp", [TensorParallel.single(), _TwoEqualRanks()], ids=["tp1", "tp2"])
def test_row_parallel_forward_gated_reduces_then_adds_bias(device, monkeypatch, tp):
    """forward_gated(gate_up) = forward(silu_and_mul(gate_up)) with a bias: at world_size 2 the
    bias goes in once, after the all-reduce, not into each rank's GEMM."""
    from engine.kernels.norm_reference import silu_and_mul

    layer = RowParallelLinear(100, 44, ((0, 100),), bias=True, dtype=torch.float32, tp=tp).to(device)
    _randomise(layer, seed=5)
    gate_up = 2 * torch.randn(1, 200, generator=torch.Generator().manual_seed(6)).to(device)
    with torch.inference_mode():
        want = layer(silu_and_mul(gate_up))  # before the rule is patched: F.linear
        _route_on_any_device(monkeypatch)
        assert layer.supports_gated(gate_up)
        got = layer.forward_gated(gate_up)
    assert relative_error(got, want) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mlp_gpu_path_on_cuda_takes_the_gated_gemm():
    """The real routing rule on CUDA in bf16, at the 1.5B model's MLP output shape (N 2048,
    K 5632): one row takes the single-row GEMM for input_linear (N 11264) and the gated one for
    output_linear, and matches forward within bf16 rounding."""
    hidden, intermediate = 2048, 5632
    mlp = GatedMLP(hidden, intermediate, (0, intermediate), TensorParallel.single(), torch.bfloat16)
    _randomise(mlp, seed=7)
    mlp = mlp.to("cuda")
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(8)).to("cuda", torch.bfloat16)
    with torch.inference_mode():
        want = mlp(x)
        with pytest.MonkeyPatch.context() as monkeypatch:
            launches = _record_launches(monkeypatch)
            got = mlp.forward_gpu(x)
    assert launches == ["skinny", "skinny gated"]
    assert relative_error(got, want) < 1e-2
