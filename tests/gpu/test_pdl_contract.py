"""engine/kernels/gpu/pdl.py's contract, checked in the PTX the compiler emitted for every
kernel a model's forward pass compiled: with PDL, a kernel first releases its successor
(griddepcontrol.launch_dependents), then touches no global or shared memory until it waits
for its predecessor (griddepcontrol.wait). A load or store hoisted above the wait would read
what the previous kernel has not yet written: a race that numeric tests catch only by luck.

The exceptions, by design: the single-row GEMM loads its first weight tiles before the wait,
the two norms their weights (weights are never written by the pass), the fused Mamba decode
kernel its plan inputs, weights and its own layer's old state, and the conv-window shift the
plan and the old window (pdl.py says why). PTX
does not say which tensor a load reads, so for these the check is narrower: loads only, no
store, atomic or asynchronous copy before the wait.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest
import torch

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.execution.loader import load_model
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import ScheduledChunk
from engine.interfaces.forward_batch import build_forward_batch
from tests.gpu.conftest import INTERPRETED, eager_forward

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA device")

# a (predicated) load, store, atomic or asynchronous copy of any state space
MEMORY_ACCESS = re.compile(r"^\s*(@!?%p\d+\s+)?(ld|st|atom|red|cp\.async|cp\.reduce)\.")


# kernels that load before their wait (the module docstring says what and why)
LOADS_BEFORE_WAIT = {
    "skinny_gemm._row_kernel", "fused_norm._add_rms_norm_kernel", "fused_norm._gated_rms_norm_kernel",
    "mamba_decode._conv_ssd_decode_kernel", "conv._state_kernel",
}


def _accesses_before_wait(ptx: str, loads_allowed: bool = False) -> list[str]:
    """The memory instructions of a kernel's PTX ahead of its griddepcontrol.wait (parameter
    loads are not memory accesses here). With loads_allowed, global loads are not either, nor
    is shared memory: it belongs to the block alone (no other grid can write it), and the
    compiler may stage the early loads' values through it (the conv-window shift's layout
    change does, seen on the H200)."""
    lines = ptx.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    return [
        line.strip() for line in lines[:wait]
        if MEMORY_ACCESS.search(line) and "ld.param" not in line
        and not (loads_allowed and ("ld.global" in line or ".shared" in line))
    ]


def _compiled_pdl_kernels() -> dict[str, list[str]]:
    """Kernel name -> the PTX of each compiled variant that uses PDL, over every Triton kernel
    defined in engine.kernels.gpu (an autotuned kernel under its JIT function's name)."""
    import triton

    import engine.kernels.gpu as package

    found: dict[str, list[str]] = {}
    seen: set[int] = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for obj in vars(module).values():
            fn = obj.fn if isinstance(obj, triton.runtime.Autotuner) else obj
            if not isinstance(fn, triton.runtime.JITFunction) or fn.__module__ != module.__name__:
                continue
            if id(fn) in seen:
                continue
            seen.add(id(fn))
            for kernel_cache, *_ in fn.device_caches.values():
                for compiled in kernel_cache.values():
                    ptx = compiled.asm["ptx"]
                    if "griddepcontrol" in ptx:
                        found.setdefault(f"{info.name}.{fn.__name__}", []).append(ptx)
    return found


def _run_model_steps() -> None:
    """A bf16 prefill of three sequences, then decode steps of one and of three sequences, on
    the GPU path: compiles the forward pass's kernels, the single-row GEMM among them."""
    model, _ = load_model(DEFAULT_MODEL_DIR, dtype=torch.bfloat16, device=torch.device("cuda"))
    caches = model.allocate_caches(num_blocks=12, block_size=16, num_state_slots=3)

    def chunk(r: int, tokens: list[int], start: int) -> ScheduledChunk:
        return ScheduledChunk(
            request_id=f"r{r}", token_ids=tuple(tokens), start_position=start,
            block_table=tuple(range(4 * r, 4 * r + 4)), state_slot=r, reset_state=start == 0,
            sample=True, sampling=SamplingParams(),
        )

    with torch.inference_mode():
        for step in (
            [chunk(r, list(range(2, 40 + r)), 0) for r in range(3)],
            [chunk(0, [5], 38)],
            [chunk(r, [5], 39 + r) for r in range(3)],
        ):
            eager_forward(model, build_forward_batch(step, 16, torch.device("cuda")), caches)
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
def test_every_pdl_kernel_releases_then_waits_before_touching_memory():
    from engine.kernels.gpu import pdl

    if not pdl.enabled():
        pytest.skip("PDL is off on this device (compute capability below 9.0 or HYBRID_SERVE_PDL=0)")
    _run_model_steps()
    kernels = _compiled_pdl_kernels()
    # norms, conv, SSD, paged attention, KV write, the single-row GEMM at the least
    assert len(kernels) >= 8, sorted(kernels)
    assert any("skinny" in name for name in kernels), sorted(kernels)
    assert "mamba_decode._conv_ssd_decode_kernel" in kernels, sorted(kernels)
    for name, variants in kernels.items():
        allowed = name in LOADS_BEFORE_WAIT
        for ptx in variants:
            release = ptx.find("griddepcontrol.launch_dependents")
            wait = ptx.find("griddepcontrol.wait")
            assert 0 <= release < wait, f"{name}: launch_dependents must come before the wait"
            assert _accesses_before_wait(ptx, allowed) == [], f"{name} touches memory before its wait"
        if allowed:  # and its early loads are really there, in the variant the model compiled
            # (other tests may have compiled more: the GEMM with PRELOAD_TILES=0 loads nothing early)
            assert any(_accesses_before_wait(ptx) for ptx in variants), f"{name} loads nothing before its wait"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "consumer", ["linear", "gated linear", "row-RMS linear", "add_rms_norm", "gated_rms_norm", "conv_ssd_decode",
                 "conv_ssd_decode with the gated norm", "advance_conv_states"],
)
def test_a_kernel_launched_behind_a_slow_writer_reads_what_it_wrote(consumer):
    """The kernels that load before their wait, replayed in a CUDA graph right behind a PDL
    kernel that spins for 300 us and only then writes their activation input (NaN until then):
    their pre-wait part runs during the spin, so an activation load hoisted above the wait
    would read NaN. The result must equal, bit for bit, the same call on the input written
    first (for the Mamba decode kernels: their outputs and the new state, from the same old
    state; their late input is in_proj's whole row, z, xBC and dt; for the row-RMS linear,
    both x and the sums of squares, which the Mamba decode kernel writes together)."""
    from engine.kernels.gpu import pdl
    from engine.kernels.gpu.conv import advance_conv_states
    from engine.kernels.gpu.fused_norm import add_rms_norm, gated_rms_norm
    from engine.kernels.gpu.mamba_decode import GatedNormOutputs, conv_ssd_decode, num_sum_squares
    from engine.kernels.gpu.skinny_gemm import CONFIGS, RowRms, skinny_linear
    from tests.gpu.pdl_probe_kernels import copy_late

    if not pdl.enabled():
        pytest.skip("PDL is off on this device (compute capability below 9.0 or HYBRID_SERVE_PDL=0)")
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(bf16)  # noqa: E731
    if consumer in ("linear", "gated linear"):
        gated = consumer == "gated linear"
        weight = randn(2048, 1024) / 32
        late = randn(1, 2048 if gated else 1024)
        run = lambda x: skinny_linear(x, weight, gated=gated, config=CONFIGS[0])  # noqa: E731
    elif consumer == "row-RMS linear":
        # late: [x (1024 bf16) | 64 positive fp32 sums of squares, as 128 bf16 of their bits]
        weight = randn(2048, 1024) / 32
        sums = torch.rand(1, 64, device="cuda", generator=g) * 40 + 1
        late = torch.cat([randn(1, 1024), sums.view(bf16)], dim=1)
        run = lambda row: skinny_linear(  # noqa: E731
            row[:, :1024], weight, config=CONFIGS[0], row_rms=RowRms(row[0, 1024:].view(torch.float32), 1e-5))
    elif consumer == "add_rms_norm":
        delta, weight = randn(1, 2048), randn(2048)
        late = randn(1, 2048)
        run = lambda x: torch.cat(add_rms_norm(x, delta, 0.5, weight, 1e-5))  # noqa: E731
    elif consumer == "gated_rms_norm":
        gate, weight, skip_x = randn(1, 4096), randn(4096), randn(1, 4096)
        skip_d = torch.rand(64, device="cuda", generator=g)
        late = torch.randn(1, 4096, device="cuda", generator=g)  # the scan's fp32 y
        run = lambda y: gated_rms_norm(y, gate, weight, 4096, 1e-5, bf16, skip=(skip_x, skip_d))  # noqa: E731
    else:  # the Mamba decode kernels; late: in_proj's row [xBC | dt], as the model splits it
        heads, head_dim, state_size, taps = 8, 64, 128, 4
        conv_dim = heads * head_dim + 2 * state_size
        width = heads * head_dim
        late = randn(1, width + conv_dim + heads)  # [z | xBC | dt]
        norm_d, norm_w = torch.rand(heads, device="cuda", generator=g), randn(width)
        conv_w, conv_b = randn(conv_dim, taps), randn(conv_dim)
        dt_bias = torch.zeros(heads, device="cuda")
        a_log = torch.rand(heads, device="cuda", generator=g)
        old_conv = randn(3, conv_dim, taps - 1)
        old_ssm = torch.randn(3, heads, head_dim, state_size, device="cuda", generator=g)
        conv_state, ssm = old_conv.clone(), old_ssm.clone()
        rows, slots, reset = (torch.tensor([v], device="cuda") for v in (0, 1, 0))
        cu_seqlens = torch.tensor([0, 1], device="cuda")

        def run(row):
            gate, xbc, dt_raw = row[:, :width], row[:, width : width + conv_dim], row[:, width + conv_dim :]
            if consumer == "advance_conv_states":
                advance_conv_states(xbc, conv_state, cu_seqlens, slots, reset)
                return conv_state[1].float().flatten().clone()  # a copy: the state changes later
            if consumer == "conv_ssd_decode with the gated norm":
                normed = torch.empty(1, width, dtype=bf16, device="cuda")
                sum_squares = torch.empty(1, num_sum_squares(heads, head_dim), device="cuda")
                conv_ssd_decode(xbc, dt_raw, conv_state, conv_w, conv_b, dt_bias, a_log, (1e-3, 0.1), ssm,
                                None, None, rows, slots, reset,
                                gated_norm=GatedNormOutputs(gate, norm_d, norm_w, normed, sum_squares))
                return torch.cat([normed.float().flatten(), sum_squares.flatten(), ssm[1].flatten()])
            x_out = torch.empty(1, heads, head_dim, dtype=bf16, device="cuda")
            y = torch.empty(1, heads, head_dim, device="cuda")
            conv_ssd_decode(xbc, dt_raw, conv_state, conv_w, conv_b, dt_bias, a_log, (1e-3, 0.1), ssm,
                            x_out, y, rows, slots, reset)
            return torch.cat([y.flatten(), x_out.float().flatten(), ssm[1].flatten()])
    expected = run(late)  # compiles, and the reference value
    target = torch.empty_like(late)
    copy_late(late, target, spin_us=1)  # compiles
    torch.cuda.synchronize()
    # in a CUDA graph, where PDL overlaps (benchmarks/pdl_overlap.py; eager launches from
    # Python can take longer than the spin)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_late(late, target, spin_us=300)
        got = run(target)
    target.fill_(float("nan"))
    if consumer.startswith("conv_ssd_decode") or consumer == "advance_conv_states":
        conv_state.copy_(old_conv)  # the graph's step starts from the state the reference did
        ssm.copy_(old_ssm)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not INTERPRETED, reason="runs under Triton's interpreter (on a GPU the tests above cover it)")
def test_pdl_code_paths_compute_what_the_plain_paths_do_under_the_interpreter(monkeypatch):
    """The kernels' USE_PDL=True branches (the GEMM's preloaded tiles accumulated ahead of its loop,
    the norms' weights loaded before the wait) on the CPU: the interpreter has no inline
    assembly, so griddepcontrol becomes a no-op here; the results must equal the USE_PDL=False
    launches bit for bit."""
    import triton
    import torch.nn.functional as F

    from engine.kernels.gpu import fused_norm, pdl, skinny_gemm

    monkeypatch.setattr(pdl.tl.extra.cuda, "gdc_wait", lambda *args, **kwargs: None)
    monkeypatch.setattr(pdl.tl.extra.cuda, "gdc_launch_dependents", lambda *args, **kwargs: None)
    g = torch.Generator().manual_seed(0)
    config = skinny_gemm.CONFIGS[0].as_triton()
    for gated in (False, True):
        # K ends in the first 512-column tile, the second, the third, the fourth, or after them
        for features, depth in ((16, 300), (16, 700), (40, 1100), (8, 1900), (8, 2600)):
            x = torch.randn(1, 2 * depth if gated else depth, generator=g)
            weight, bias = torch.randn(features, depth, generator=g) / depth**0.5, torch.randn(features, generator=g)
            outs = []
            for use_pdl, tiles in ((False, 0), (True, 1), (True, 2), (True, 3), (True, 4)):
                out = torch.full((1, features), float("nan"))
                skinny_gemm._row_kernel[(triton.cdiv(features, config.kwargs["BLOCK_N"]),)](
                    x, weight, bias, out, out, features, depth, 1, 0.0, HAS_BIAS=True, GATED=gated,
                    ROW_RMS=False, SUM_SQ_BLOCK=1, PRELOAD_TILES=tiles, USE_PDL=use_pdl, **config.all_kwargs(),
                )
                outs.append(out)
            assert all(torch.equal(outs[0], out) for out in outs[1:]), (gated, features, depth)
            x_in = F.silu(x[:, :depth]) * x[:, depth:] if gated else x
            assert (outs[1] - F.linear(x_in, weight, bias)).abs().max() < 1e-3
    hidden, delta, weight = torch.randn(3, 2048, generator=g), torch.randn(3, 2048, generator=g), torch.randn(2048, generator=g)
    y, gate, skip_x = (torch.randn(2, 4096, generator=g) for _ in range(3))
    skip_d, gate_weight = torch.rand(64, generator=g), torch.randn(4096, generator=g)
    results = []
    for use_pdl in (False, True):
        monkeypatch.setattr(fused_norm, "launch_options", lambda on=use_pdl: {"USE_PDL": on})
        results.append((
            *fused_norm.add_rms_norm(hidden, delta, 0.5, weight, 1e-5),
            fused_norm.gated_rms_norm(y, gate, gate_weight, 4096, 1e-5, torch.float32, skip=(skip_x, skip_d)),
        ))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_the_checker_sees_a_load_before_the_wait():
    """The PTX check itself: a global load ahead of the wait is reported unless loads are
    allowed, a store always, a parameter load or anything after the wait never."""
    load = "@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd2 + 0 ];"
    store = "st.global.b16 [ %rd3 + 0 ], { %rs1 };"
    ptx = "\n".join([
        "griddepcontrol.launch_dependents;", "ld.param.u64 %rd1, [k_param_0];", load, store,
        "griddepcontrol.wait;", store,
    ])
    assert _accesses_before_wait(ptx) == [load, store]
    assert _accesses_before_wait(ptx, loads_allowed=True) == [store]
