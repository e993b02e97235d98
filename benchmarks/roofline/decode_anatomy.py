"""Where a batch-1 decode step's GPU time goes around its CUDA graph: the graph replayed alone,
with the input and token copies the worker adds, with the input copy inside the graph, and the
graph captured without two of its optimisations (the gated norm folded into its neighbours, q,
k and v in one GEMM), each timed on the GPU alone; then the worker's own async steps under
torch.profiler."""

from __future__ import annotations

from unittest import mock

import torch

from engine.execution.worker import Worker
from engine.interfaces.request import PENDING_TOKEN
from engine.interfaces.step_io import SchedulerOutput
from engine.layers.attention import PagedAttention
from gpu_timing import keep_gpu_busy
from harness import middle
from roofline.instruments import critical_path, gpu_events, kernel_span
from roofline.model import chunk


def decode_step_anatomy(worker: Worker, request: int, position: int, blocks_per_seq: int,
                        chain: int = 16, rounds: int = 8, profiled_steps: int = 8) -> dict:
    """Where a batch-1 decode step's GPU time goes around its graph. Chains of `chain` steps of
    request `request` (decoding on from `position`), each chain queued behind a GPU sleep so
    that the host's submission does not show, timed per step from an event after the sleep to
    one after the chain; the variants run round robin, `rounds` chains each:
      replay: the graph replayed again and again on the inputs last staged;
      input copy + replay: DecodeGraphRunner.forward (the staged inputs' host-to-device copy,
        then the replay);
      input copy + replay + token copy: and the argmax's device-to-host copy, as the worker's
        async step launches them;
      copy inside the graph + token copy: a batch-1 graph captured afresh with the input copy
        (from one pinned buffer) as its first node;
      and the graph captured afresh without two of its optimisations (graph_without):
        the gated norm in its own kernel (not folded into the Mamba decode kernel and
        out_proj), and q, k and v in three GEMMs (not one over the stacked weight).
    Then `profiled_steps` of the worker's own async steps under torch.profiler: the critical
    path per step, copies included (each GPU event charged the time from the previous one's
    end to its own). Returns {"chain", "chains": [{name, gpu_s}], "profiled_steps",
    "async_critical_path": [...], "async_span_s"} ({} without decode graphs). Every step
    decodes the same position again (timing only)."""
    from torch.profiler import ProfilerActivity, profile

    graphs = worker.decode_graphs
    if graphs is None:
        return {}
    readback = worker._token_readback  # a benchmark's look inside the worker
    one_step = lambda: [chunk(request, (5,), position, blocks_per_seq, False)]  # noqa: E731
    graphs.forward(one_step())  # stages both pinned buffers' fields for batch 1
    graphs.forward(one_step())
    torch.cuda.synchronize()
    used = graphs._stagings[0].used_length(1)
    inner = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(inner):
        graphs._inputs[:used].copy_(graphs._hosts[0][:used], non_blocking=True)
        _, _, inner_argmax = graphs._forward(1)
    replay = graphs._graphs[1]
    unfolded = graph_without(graphs, mock.patch.object(graphs, "fold_gated_norm", False))
    three_gemms = graph_without(graphs, mock.patch.object(PagedAttention, "project_qkv", three_projections))
    variants = {
        "replay": lambda: replay.replay(),
        "replay, the gated norm in its own kernel": lambda: unfolded.replay(),
        "replay, q, k and v in three GEMMs": lambda: three_gemms.replay(),
        "input copy + replay": lambda: graphs.forward(one_step()),
        "input copy + replay + token copy": lambda: readback.start(graphs.forward(one_step())[2]),
        "copy inside the graph + token copy": lambda: (inner.replay(), readback.start(inner_argmax)),
    }
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {name: [] for name in variants}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, launch in variants.items():
                torch.cuda.synchronize()
                keep_gpu_busy(4e-3)
                start.record()
                for _ in range(chain):
                    launch()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3 / chain)
    chains = [{"name": name, "gpu_s": middle(t)} for name, t in times.items()]

    def step(token: int) -> SchedulerOutput:
        return SchedulerOutput((chunk(request, (token,), position, blocks_per_seq, False),))

    worker.execute(step(5))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        worker.submit(step(5))
        for _ in range(profiled_steps - 1):
            worker.submit(step(PENDING_TOKEN))
            worker.collect()
        worker.collect()
        torch.cuda.synchronize()
    on_gpu = gpu_events(list(prof.events()))
    path = [{**k, "seconds": k["seconds"] / profiled_steps} for k in critical_path(on_gpu)[:12]]
    return {"chain": chain, "chains": chains, "profiled_steps": profiled_steps,
            "async_critical_path": path, "async_span_s": (kernel_span(on_gpu) or 0.0) / profiled_steps}


def graph_without(graphs, patch) -> torch.cuda.CUDAGraph:
    """The batch-1 decode graph's forward pass (no input copy) captured afresh inside `patch`
    (a mock.patch that turns one optimisation off), after one eager run of it (Triton compiles
    and tunes outside the capture): the step without that optimisation, for a ratio in the
    same run."""
    graph = torch.cuda.CUDAGraph()
    with patch, torch.inference_mode():
        graphs._forward(1)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            graphs._forward(1)
    torch.cuda.synchronize()
    return graph


def three_projections(self: PagedAttention, hidden: torch.Tensor, stacked: bool = False):
    """PagedAttention.project_qkv as three GEMMs over the q, k and v weights (instead of one
    over the stacked weight)."""
    from engine.layers.parallel_linear import linear

    num_tokens = hidden.shape[0]
    return tuple(
        linear(hidden, proj.weight, proj.bias).view(num_tokens, heads, self.head_dim)
        for proj, heads in ((self.q_proj, self.num_heads), (self.k_proj, self.num_kv_heads),
                            (self.v_proj, self.num_kv_heads))
    )

