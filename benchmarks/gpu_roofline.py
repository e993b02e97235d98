"""Roofline benchmark of the engine's GPU path on one device, in one process (no Ray).

Measures, in the same run: device-to-device copy bandwidth and the bf16 matmul rate (the
floors), then drives engine.worker.Worker on a ~1.5B dense GraniteMoeHybrid with random bf16
weights (written as config.json + safetensors to a temp dir) and reports each result as a ratio
to its floor:

  * numerics: bf16 GPU logits vs the fp32 CPU reference path on a short prompt + greedy tokens;
  * cold prefill of 8,192 tokens (time to first token) vs model FLOPs / matmul rate;
  * decode tokens/s at batch 1, 16, 64 with 1,024 tokens of context vs the bytes a step must
    move (weights + SSM/conv state read and written + KV read) / copy bandwidth, replaying the
    worker's CUDA graphs (engine/cuda_graphs.py), then the same steps eagerly for comparison.
    The row's time is a step of the engine's default async scheduling (each step submitted
    before the one before is collected, its token read on the device); each row also reports
    the step collected before the next is staged (sync) and the replay of its graph alone
    (the step's GPU time without the host work around it); then where a batch-1 step's GPU
    time goes around its graph (decode_step_anatomy: the input and token copies, a graph that
    copies its own inputs, a profile of the async steps);
  * checkpoint rows (benchmarks/roofline_checkpoints.py): capture and restore of an 8,192-token
    bundle, restore + 256-token prefill (a prefill CUDA graph, engine/prefill_graphs.py, and the
    same step eagerly) vs the cold 8,448-token prefill, and the cold 8,448-token prefill that
    captures at 8,192 (split and in-pass) vs the same prefill without capture;
  * for each row, one step under torch.profiler: GPU kernel time vs wall time (what dominates).

Time to first token (the cold prefill rows, restore + prefill) is the time to the sampled
token on the host, as serving it takes: no timed step asks for a logits row
(SamplingParams.return_logits, a copy of the row to the host that serving does not make).
The logits that the restore row compares with the cold prefill's come from one more, untimed
run of each of the two steps; the numerics check runs apart from every timed step. In results
up to gpu_roofline_20261203_session7_final.json the restore + prefill row, the cold
8,448-token prefill and the capture rows timed against it paid that copy; the cold
8,192-token row never did.

    python benchmarks/gpu_roofline.py --out benchmarks/results/gpu_roofline.json
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.layers.attention import PagedAttention
from engine.layers.mamba2 import Mamba2Mixer
from engine.forward_batch import build_forward_batch
from engine.loader import load_model
from engine.request import PENDING_TOKEN
from engine.sampling_params import SamplingParams
from engine.step_io import ScheduledChunk, SchedulerOutput
from engine.worker import Worker

from roofline_checkpoints import checkpoint_rows  # noqa: E402  (this script's folder)

BLOCK_SIZE = 16
# bench_decode's steps: warm-up, timed (the median is reported; 20 timed steps had let the
# batch-1 row move by 5% between runs whose steps measured the same elsewhere), then one
# profiled; host_profile and decode_step_anatomy decode on after them
DECODE_WARMUP, DECODE_TIMED = 3, 50
DECODE_STEPS_RUN = 2 * (DECODE_WARMUP + DECODE_TIMED + 1)  # bench_decode's two runs
HOST_PROFILE_STEPS = 10
CONFIG_1P5B = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
    "hidden_size": 2048, "num_hidden_layers": 24,
    "layer_types": ["attention" if i % 6 == 5 else "mamba" for i in range(24)],
    "num_attention_heads": 16, "num_key_value_heads": 4, "attention_bias": False,
    "attention_multiplier": 0.0078125, "attention_dropout": 0.0,
    "mamba_n_heads": 64, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
    "mamba_proj_bias": False, "shared_intermediate_size": 5632, "intermediate_size": 5632,
    "num_local_experts": 0, "num_experts_per_tok": 0, "vocab_size": 49152,
    "max_position_embeddings": 16384, "position_embedding_type": "nope",
    "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "hidden_act": "silu",
    "eos_token_id": 0, "pad_token_id": 1, "bos_token_id": None, "torch_dtype": "bfloat16",
}


def measure_copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return 2 * num_bytes / _cuda_time(lambda: dst.copy_(src), repeats=10)


def measure_matmul_rate(n: int = 8192) -> float:
    """FLOP/s of an n x n x n bf16 matmul on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    return 2 * n**3 / _cuda_time(lambda: a @ b, repeats=10)


def _cuda_time(fn, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def write_random_checkpoint(model_dir: Path) -> None:
    """config.json + one safetensors file of random bf16 weights (fp32 for A_log, D, dt_bias)."""
    from safetensors.torch import save_file

    from engine.model_config import HybridModelConfig, load_model_config
    from engine.models.granite_moe_hybrid import GraniteMoeHybridModel

    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(CONFIG_1P5B))
    config: HybridModelConfig = load_model_config(model_dir)
    with torch.device("meta"):
        shapes = GraniteMoeHybridModel(config, dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for name, p in shapes.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            t = torch.log(torch.empty(p.shape, device="cuda").uniform_(1, 16, generator=g))
        elif leaf == "dt_bias":
            dt = torch.exp(torch.empty(p.shape, device="cuda").uniform_(math.log(1e-3), math.log(1e-1), generator=g))
            t = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        elif leaf == "D" or "norm" in name:
            t = torch.ones(p.shape, device="cuda")
        elif leaf == "bias":
            t = torch.zeros(p.shape, device="cuda")
        else:
            t = torch.randn(p.shape, device="cuda", generator=g) * 0.02
        tensors["model." + name] = t.to(p.dtype).cpu().contiguous()
    save_file(tensors, str(model_dir / "model.safetensors"))


def parameter_counts(worker: Worker) -> dict[str, int]:
    total = sum(p.numel() for p in worker.model.parameters())
    embed = worker.model.embed_tokens.weight.numel()
    return {"total": total, "embedding": embed, "body": total - embed}


def chunk(request: int, tokens, start: int, blocks_per_seq: int, reset: bool, sample: bool = True):
    first = request * blocks_per_seq
    return ScheduledChunk(
        request_id=f"r{request}", token_ids=tuple(int(t) for t in tokens), start_position=start,
        block_table=tuple(range(first, first + blocks_per_seq)), state_slot=request,
        reset_state=reset, sample=sample, sampling=SamplingParams(temperature=0.0, max_tokens=4096),
    )


def numerics_check(worker: Worker, model_dir: Path, prompt_len: int = 32, new_tokens: int = 8) -> dict:
    """Greedy tokens on the GPU (prefill + decode steps) vs the fp32 CPU reference, teacher-forced."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, CONFIG_1P5B["vocab_size"], (prompt_len,), generator=g).tolist()
    blocks = 4
    request, tokens, gpu_logits = 0, list(prompt), []
    step = SchedulerOutput((chunk(request, prompt, 0, blocks, True),))
    for i in range(new_tokens):
        batch = build_forward_batch(list(step.chunks), BLOCK_SIZE, worker.device)
        with torch.inference_mode():
            hidden = worker.model(batch, worker.caches)
            gpu_logits.append(worker.model.compute_logits(hidden[-1:]).cpu()[0])
        tokens.append(int(gpu_logits[-1].argmax()))
        step = SchedulerOutput((chunk(request, tokens[-1:], len(tokens) - 1, blocks, False),))
    gpu_logits = torch.stack(gpu_logits)  # (new_tokens, V)

    ref_model, _ = load_model(model_dir, dtype=torch.float32, device="cpu")
    ref_caches = ref_model.allocate_caches(num_blocks=blocks, block_size=BLOCK_SIZE, num_state_slots=1)
    ref_step = SchedulerOutput((chunk(0, tokens[:-1], 0, blocks, True),))
    with torch.inference_mode():
        hidden = ref_model(build_forward_batch(list(ref_step.chunks), BLOCK_SIZE, torch.device("cpu")), ref_caches)
        ref_logits = ref_model.compute_logits(hidden[prompt_len - 1 :])  # (new_tokens, V)
    del ref_model, ref_caches
    err = (gpu_logits - ref_logits).abs().max(dim=-1).values
    top2 = ref_logits.topk(2, dim=-1).values
    near_tie = (top2[:, 0] - top2[:, 1]) <= 2 * err
    agree = gpu_logits.argmax(-1) == ref_logits.argmax(-1)
    rel = float((gpu_logits - ref_logits).norm() / ref_logits.norm())
    return {
        "prompt_tokens": prompt_len, "greedy_tokens": new_tokens,
        "logits_relative_error": rel,
        "greedy_agree": int(agree.sum()), "disagree_near_tie": int((~agree & near_tie).sum()),
        "disagree_not_tie": int((~agree & ~near_tie).sum()),
        "passed": rel < 5e-2 and int((~agree & ~near_tie).sum()) == 0,
    }


def bench_prefill(worker: Worker, num_tokens: int, slot: int, blocks_per_seq: int, repeats: int = 3) -> float:
    """Seconds for one cold prefill step of num_tokens (sampling included), best of repeats."""
    tokens = torch.randint(2, 49152, (num_tokens,)).tolist()
    step = SchedulerOutput((chunk(slot, tokens, 0, blocks_per_seq, True),))
    worker.execute(step)  # compile / autotune
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        worker.execute(step)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times), profile_step(worker, step)


STEP_LABEL = "roofline step"  # the record_function range around a profiled step


def profile_step(worker: Worker, step: SchedulerOutput, top: int = 8) -> dict:
    """One step under torch.profiler: wall time, summed GPU kernel time, the top kernels, the
    critical path, and the host's side (_host_side).

    gpu/wall near 1 means the GPU is the bottleneck; far below 1, host time and launches are."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        with record_function(STEP_LABEL):
            worker.execute(step)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [
        (e.key, getattr(e, "self_device_time_total", 0) / 1e6, e.count)
        for e in prof.key_averages()
        if str(getattr(e, "device_type", "")).endswith("CUDA") and getattr(e, "self_device_time_total", 0) > 0
        and e.key != STEP_LABEL
    ]
    kernels.sort(key=lambda k: -k[1])
    gpu = sum(k[1] for k in kernels)
    launches = sum(k[2] for k in kernels)
    events = list(prof.events())
    on_gpu = _gpu_events(events)
    return {"wall_s": wall, "gpu_kernel_s": gpu, "gpu_share": gpu / wall, "kernel_launches": launches,
            "gpu_span_s": _kernel_span(on_gpu),
            "top": [{"kernel": k[0][:90], "seconds": k[1], "count": k[2]} for k in kernels[:top]],
            "critical_path": _critical_path(on_gpu)[:top], **_host_side(events, on_gpu, top)}


def _gpu_events(events: list) -> list:
    """The timed GPU events of a trace (kernels, copies, memsets), without the GPU-side copy of
    the step's record_function range."""
    return [e for e in events
            if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start
            and e.name != STEP_LABEL]


def _host_side(events: list, on_gpu: list, top: int) -> dict:
    """Where the host's share of a profiled step goes: the time from the step's start (its
    record_function range) to the first GPU event's start (host_lead_s: what the host does
    before the GPU has work) and from the last one's end to the step's end (host_tail_s: the
    token's way back), and the CUDA runtime calls by summed host time (cudaGraphLaunch,
    cudaLaunchKernel, cudaMemcpyAsync, the synchronisations), largest first."""
    steps = [e.time_range for e in events
             if e.name == STEP_LABEL and not str(getattr(e, "device_type", "")).endswith("CUDA")]
    if not steps or not on_gpu:
        return {}
    step = steps[0]
    calls: dict[str, list] = {}
    for e in events:
        if e.name.startswith("cuda") and step.start <= e.time_range.start <= step.end:
            entry = calls.setdefault(e.name, [0.0, 0])
            entry[0] += (e.time_range.end - e.time_range.start) / 1e6
            entry[1] += 1
    ranked = sorted(calls.items(), key=lambda item: -item[1][0])[:top]
    return {"host_lead_s": (min(e.time_range.start for e in on_gpu) - step.start) / 1e6,
            "host_tail_s": (step.end - max(e.time_range.end for e in on_gpu)) / 1e6,
            "runtime_calls": [{"call": name, "seconds": seconds, "count": count}
                              for name, (seconds, count) in ranked]}


def _critical_path(on_gpu: list) -> list[dict]:
    """What each kernel adds to the GPU timeline, summed by kernel name, largest first: kernels
    in order of their end, each charged the time from the previous kernel's end to its own
    (the first its whole duration). The charges add up to the first-to-last span. Unlike
    kernel durations this stays meaningful under PDL, where a kernel starts early and its
    duration includes the wait for its predecessor."""
    kernels = sorted((e.time_range.end, e.time_range.start, e.name) for e in on_gpu)
    charged: dict[str, list] = {}
    previous_end = None
    for end, start, name in kernels:
        seconds = (end - (start if previous_end is None else previous_end)) / 1e6
        entry = charged.setdefault(name[:90], [0.0, 0])
        entry[0] += max(seconds, 0.0)
        entry[1] += 1
        previous_end = end
    ranked = sorted(charged.items(), key=lambda item: -item[1][0])
    return [{"kernel": name, "seconds": seconds, "count": count} for name, (seconds, count) in ranked]


def _kernel_span(on_gpu: list) -> float | None:
    """Seconds from the first kernel's start to the last kernel's end on the GPU timeline: the
    kernels plus the gaps between them, without the host time before and after (None if the
    trace has no timed kernels). span - kernel sum = gaps; wall - span = host at the ends."""
    if not on_gpu:
        return None
    return (max(e.time_range.end for e in on_gpu) - min(e.time_range.start for e in on_gpu)) / 1e6


def prefill_flops(config: dict, params_body: int, num_tokens: int) -> float:
    """Matmul FLOPs of a cold prefill: linear layers, causal attention, SSD chunk scan, one LM row."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    n_attn = sum(t == "attention" for t in config["layer_types"])
    n_mamba = len(config["layer_types"]) - n_attn
    heads_dim = config["num_attention_heads"] * (hidden // config["num_attention_heads"])
    linear = 2 * num_tokens * params_body
    attention = n_attn * 2 * num_tokens**2 * heads_dim  # QK^T and PV, causal half each
    H, P, N, L = config["mamba_n_heads"], config["mamba_d_head"], config["mamba_d_state"], 64
    ssd = n_mamba * num_tokens * H * (2 * L * (N + P) + 4 * P * N)
    return linear + attention + ssd + 2 * hidden * vocab


def decode_bytes(worker: Worker, batch: int, context: int) -> float:
    """Bytes one decode step must move: every weight once, each sequence's state read and
    written, its KV read."""
    weights = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    state = 2 * worker.model.state_bytes_per_slot()
    kv = worker.model.kv_bytes_per_block(BLOCK_SIZE) / BLOCK_SIZE * context
    return weights + batch * (state + kv)


def bench_decode(worker: Worker, first_request: int, batch: int, context: int, blocks_per_seq: int,
                 warmup: int = DECODE_WARMUP, steps: int = DECODE_TIMED) -> tuple[float, float, dict]:
    """Decode step seconds of `batch` sequences prefilled to `context` tokens (8K-token prefill
    steps), two ways, the same requests decoding on:
      async: as the engine runs by default (EngineConfig.async_scheduling): each step is
        submitted before the one before is collected, its tokens PENDING_TOKEN, read on the
        device; wall time of `steps` consecutive steps / steps;
      sync: each step collected before the next is staged, the GPU idle in between (the
        median of `steps` single steps, each from an idle GPU).
    Returns (async seconds, sync seconds, a profile of one more (sync) step)."""
    requests = list(range(first_request, first_request + batch))
    per_step = max(1, 8192 // context)
    for i in range(0, batch, per_step):
        chunks = tuple(
            chunk(r, torch.randint(2, 49152, (context,)).tolist(), 0, blocks_per_seq, True, sample=False)
            for r in requests[i : i + per_step]
        )
        worker.execute(SchedulerOutput(chunks))
    position, last = context, {r: 5 for r in requests}

    def step_at(tokens: dict[int, int]) -> SchedulerOutput:
        return SchedulerOutput(tuple(chunk(r, (tokens[r],), position, blocks_per_seq, False) for r in requests))

    times = []
    for s in range(warmup + steps):
        out = step_at(last)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = worker.execute(out)
        torch.cuda.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
        last = {r: result.sampled_token_ids[f"r{r}"] for r in requests}
        position += 1
    sync_s = sorted(times)[len(times) // 2]

    pending = {r: PENDING_TOKEN for r in requests}
    worker.submit(step_at(last))
    for s in range(warmup + steps):
        if s == warmup:
            t0 = time.perf_counter()
        position += 1
        worker.submit(step_at(pending))
        worker.collect()
    async_s = (time.perf_counter() - t0) / steps
    result = worker.collect()
    last = {r: result.sampled_token_ids[f"r{r}"] for r in requests}
    position += 1
    return async_s, sync_s, profile_step(worker, step_at(last), top=16)


def host_profile(worker: Worker, first_request: int, batch: int, context: int, blocks_per_seq: int,
                 steps: int = HOST_PROFILE_STEPS, top: int = 18) -> list[str]:
    """cProfile of `steps` decode steps of the requests bench_decode left behind (they decode
    on): the top functions by own time, per step, where a step's host time goes (the GPU's
    time shows up as the wait in whatever reads the sampled tokens back)."""
    import cProfile
    import io
    import pstats

    requests = list(range(first_request, first_request + batch))
    position = context + DECODE_STEPS_RUN  # after bench_decode's steps
    profiler = cProfile.Profile()
    for s in range(steps):
        out = SchedulerOutput(tuple(chunk(r, (5,), position + s, blocks_per_seq, False) for r in requests))
        torch.cuda.synchronize()
        profiler.enable()
        worker.execute(out)
        torch.cuda.synchronize()
        profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return [f"per step over {steps} steps (cProfile, seconds are totals):"] + lines[start:]


def graph_replay_seconds(worker: Worker, batch: int, replays: int = 20) -> float | None:
    """Median seconds of one replay of the decode graph for `batch` rows on its own (the last
    staged inputs again, so the requests' states advance once per replay; the rows that use
    them are done): the step's GPU time without the host work around it (staging, sampling,
    the read-back), the replay queued behind a GPU sleep so that the host's submission does
    not show. None without decode graphs."""
    graphs = worker.decode_graphs
    if graphs is None:
        return None
    size = next(s for s in graphs.batch_sizes if s >= batch)
    graph = graphs._graphs[size]  # a benchmark's look inside the runner
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        _keep_gpu_busy()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _keep_gpu_busy(seconds: float = 2e-3) -> None:
    """Queue about `seconds` of GPU sleep (at a 2 GHz clock), so that work queued right after
    it is all submitted before the GPU reaches it: events around that work then time the GPU
    alone, not the host's submission."""
    torch.cuda._sleep(int(seconds * 2e9))


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
      and the graph captured afresh as it was before two of its optimisations (_graph_without):
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
    unfolded = _graph_without(graphs, Mamba2Mixer, "_folded_norm_row", lambda self, hidden, plan: None)
    three_gemms = _graph_without(graphs, PagedAttention, "project_qkv", _three_projections)
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
                _keep_gpu_busy(4e-3)
                start.record()
                for _ in range(chain):
                    launch()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3 / chain)
    chains = [{"name": name, "gpu_s": sorted(t)[len(t) // 2]} for name, t in times.items()]

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
    on_gpu = _gpu_events(list(prof.events()))
    path = [{**k, "seconds": k["seconds"] / profiled_steps} for k in _critical_path(on_gpu)[:12]]
    return {"chain": chain, "chains": chains, "profiled_steps": profiled_steps,
            "async_critical_path": path, "async_span_s": (_kernel_span(on_gpu) or 0.0) / profiled_steps}


def _graph_without(graphs, owner: type, method: str, replacement) -> torch.cuda.CUDAGraph:
    """The batch-1 decode graph's forward pass (no input copy) captured afresh with
    owner.method replaced, after one eager run of it (Triton compiles and tunes outside the
    capture): the step as it was before an optimisation, for a ratio in the same run."""
    from unittest import mock

    graph = torch.cuda.CUDAGraph()
    with mock.patch.object(owner, method, replacement), torch.inference_mode():
        graphs._forward(1)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            graphs._forward(1)
    torch.cuda.synchronize()
    return graph


def _three_projections(self: PagedAttention, hidden: torch.Tensor):
    """PagedAttention.project_qkv as three GEMMs over the q, k and v weights (before they were
    stacked into one)."""
    from engine.layers.parallel_linear import linear

    num_tokens = hidden.shape[0]
    return tuple(
        linear(hidden, proj.weight, proj.bias).view(num_tokens, heads, self.head_dim)
        for proj, heads in ((self.q_proj, self.num_heads), (self.k_proj, self.num_kv_heads),
                            (self.v_proj, self.num_kv_heads))
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/gpu_roofline.json")
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--no-eager", action="store_true", help="skip the eager decode rows (comparison only)")
    args = parser.parse_args()
    t_start = time.perf_counter()
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def save_partial(rows: list[dict]) -> None:
        """The JSON so far, so a run cut short by its time limit still leaves its rows."""
        Path(args.out).write_text(json.dumps({**report, "rows": rows, "partial": True}, indent=2))
    try:
        import fla
        import triton

        report.update(triton=triton.__version__, fla=getattr(fla, "__version__", "?"))
    except ImportError as e:
        report["import_error"] = str(e)
    copy_bw, matmul = measure_copy_bandwidth(), measure_matmul_rate()
    report["floors"] = {"copy_bytes_per_s": copy_bw, "matmul_flop_per_s": matmul}
    print(f"copy {copy_bw / 1e12:.2f} TB/s (read+write)  matmul {matmul / 1e12:.0f} TFLOP/s", flush=True)

    batches = (1, 16, 64)
    num_requests = 1 + sum(batches)
    suffix = 256  # the user message after the instruction checkpoint
    # decode runs on past the context: bench_decode, host_profile and decode_step_anatomy take
    # about 270 steps of batch 1's request
    blocks_per_seq = -(-max(args.prefill_tokens + suffix, args.context + 512) // BLOCK_SIZE)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "granite-hybrid-1p5b-random"
        write_random_checkpoint(model_dir)
        print(f"checkpoint written ({time.perf_counter() - t_start:.0f}s)", flush=True)
        probe = EngineConfig(model_dir=str(model_dir), dtype="bfloat16", device="cuda")
        worker = Worker(_sized(probe, num_requests, blocks_per_seq))
        counts = parameter_counts(worker)
        report["parameters"] = counts
        report["numerics"] = numerics_check(worker, model_dir)
        print(f"numerics {report['numerics']}  ({time.perf_counter() - t_start:.0f}s)", flush=True)

        ttft, prefill_profile = bench_prefill(worker, args.prefill_tokens, slot=0, blocks_per_seq=blocks_per_seq)
        flops = prefill_flops(CONFIG_1P5B, counts["body"], args.prefill_tokens)
        floor = flops / matmul
        rows = [{"name": f"cold prefill {args.prefill_tokens} (TTFT)", "seconds": ttft,
                 "floor_seconds": floor, "ratio_to_floor": floor / ttft, "flops": flops,
                 "tokens_per_s": args.prefill_tokens / ttft, "target": 0.40, "profile": prefill_profile}]
        rows += checkpoint_rows(worker, blocks_per_seq, BLOCK_SIZE, args.prefill_tokens, suffix,
                                profile=lambda step: profile_step(worker, step, top=12))
        print(f"checkpoint rows done ({time.perf_counter() - t_start:.0f}s)", flush=True)
        save_partial(rows)
        prefill_graphs = worker.prefill_graphs
        if prefill_graphs is not None:
            report["prefill_graph_sizes"] = list(prefill_graphs.sizes)
            report["prefill_graph_capture_s"] = prefill_graphs.capture_seconds
            report["prefill_graph_replays"] = prefill_graphs.replays
        graphs = worker.decode_graphs
        report["decode_graph_sizes"] = list(graphs.batch_sizes) if graphs is not None else []
        report["decode_graph_capture_s"] = graphs.capture_seconds if graphs is not None else None
        # Decode through the worker's CUDA graphs, then the same steps eagerly (graphs detached;
        # the same requests, prefilled again) to show what the graphs remove.
        modes = (("graphs", graphs),) if args.no_eager else (("graphs", graphs), ("eager", None))
        for mode, runner in modes:
            worker.decode_graphs = runner
            first = 1
            for b in batches:
                step_s, sync_s, decode_profile = bench_decode(worker, first, b, args.context, blocks_per_seq)
                replay_s = graph_replay_seconds(worker, b) if mode == "graphs" else None
                host = host_profile(worker, first, b, args.context, blocks_per_seq) if b == 1 and mode == "graphs" else None
                moved = decode_bytes(worker, b, args.context)
                floor = moved / copy_bw
                suffix = "" if mode == "graphs" else " (eager)"
                rows.append({"name": f"decode batch {b} ctx {args.context}{suffix}", "mode": mode,
                             "seconds": step_s, "floor_seconds": floor, "ratio_to_floor": floor / step_s,
                             "bytes": moved, "tokens_per_s": b / step_s,
                             "sync_seconds": sync_s, "sync_ratio_to_floor": floor / sync_s,
                             **_decode_target(b), "profile": decode_profile,
                             **({"graph_replay_seconds": replay_s} if replay_s is not None else {}),
                             **({"host_profile": host} if host else {})})
                first += b
                print(f"decode batch {b} {mode}: {b / step_s:.0f} tok/s ({time.perf_counter() - t_start:.0f}s)",
                      flush=True)
                save_partial(rows)
        worker.decode_graphs = graphs
        if graphs is not None:
            report["decode_graph_replays"] = graphs.replays
        # batch 1's request after bench_decode's steps and host_profile's
        position = args.context + DECODE_STEPS_RUN + HOST_PROFILE_STEPS
        report["batch1_step_anatomy"] = decode_step_anatomy(worker, 1, position, blocks_per_seq)
        print(f"batch-1 step anatomy done ({time.perf_counter() - t_start:.0f}s)", flush=True)
        report["rows"] = rows
    report["wall_seconds"] = time.perf_counter() - t_start

    print(f"\n{'row':<40}{'time ms':>10}{'floor ms':>10}{'ratio':>8}{'target':>8}{'tok/s':>12}")
    for r in rows:
        target = f"{r['target']:>8.2f}" if "target" in r else f"{'-':>8}"
        rate = f"{r['tokens_per_s']:>12.0f}" if "tokens_per_s" in r else f"{'-':>12}"
        print(f"{r['name']:<40}{r['seconds'] * 1e3:>10.2f}{r['floor_seconds'] * 1e3:>10.2f}"
              f"{r['ratio_to_floor']:>8.2f}{target}{rate}")
    for r in rows:
        if "sync_seconds" in r:
            print(f"{r['name']}: {r['seconds'] * 1e3:.3f} ms a step with async scheduling, "
                  f"{r['sync_seconds'] * 1e3:.3f} ms ({r['sync_ratio_to_floor']:.2f} of the floor) "
                  "with each step collected before the next is staged")
    for r in rows:
        if "graph_replay_seconds" in r:
            print(f"{r['name']}: the graph replay alone {r['graph_replay_seconds'] * 1e3:.3f} ms of the "
                  f"{r['seconds'] * 1e3:.3f} ms step")
    anatomy = report.get("batch1_step_anatomy")
    if anatomy:
        print(f"\n{'decode batch 1, chains of ' + str(anatomy['chain']) + ' steps':<40}{'GPU ms a step':>14}")
        for v in anatomy["chains"]:
            print(f"{v['name']:<40}{v['gpu_s'] * 1e3:>14.3f}")
        print(f"the worker's async steps under the profiler: {anatomy['async_span_s'] * 1e3:.3f} ms a step, "
              "critical path a step:")
        for k in anatomy["async_critical_path"]:
            print(f"  {k['seconds'] * 1e3:8.3f} ms {k['count'] / anatomy['profiled_steps']:5.1f}x  {k['kernel']}")
    for r in rows:
        if "host_profile" in r:
            print(f"\n{r['name']}, host side:")
            print("\n".join(r["host_profile"]))
    for r in rows:
        if "profile" not in r:
            continue
        prof = r["profile"]
        span = f", first to last kernel {prof['gpu_span_s'] * 1e3:.2f} ms" if prof.get("gpu_span_s") else ""
        print(f"\n{r['name']}: wall {prof['wall_s'] * 1e3:.2f} ms, GPU kernels {prof['gpu_kernel_s'] * 1e3:.2f} ms "
              f"({prof['gpu_share']:.0%}){span}, {prof['kernel_launches']} launches")
        for k in prof["top"]:
            print(f"  {k['seconds'] * 1e3:8.3f} ms {k['count']:5d}x  {k['kernel']}")
        if "host_lead_s" in prof:
            print(f"  host before the first kernel {prof['host_lead_s'] * 1e3:.3f} ms, after the last "
                  f"{prof['host_tail_s'] * 1e3:.3f} ms; CUDA runtime calls by host time:")
            for c in prof["runtime_calls"]:
                print(f"  {c['seconds'] * 1e3:8.3f} ms {c['count']:5d}x  {c['call']}")
        if r["name"].startswith("decode"):
            print("  critical path (time each kernel adds after the previous one ends):")
            for k in prof["critical_path"]:
                print(f"  {k['seconds'] * 1e3:8.3f} ms {k['count']:5d}x  {k['kernel']}")
    for r in rows:
        if r.get("timeline"):
            print(f"\n{r['name']}: timeline, ms from the step's start (median of 5 runs)")
            print(f"{'point':<22}{'host':>8}{'GPU':>8}")
            for point, at in r["timeline"].items():
                gpu = f"{at['gpu_ms']:>8.3f}" if "gpu_ms" in at else f"{'':>8}"
                print(f"{point:<22}{at['host_ms']:>8.3f}{gpu}")
        if r.get("submit_profile"):
            print("\n".join(r["submit_profile"]))
    for r in rows:
        syncs = r.get("host_synchronisations")
        if not syncs:
            continue
        labelled = syncs.items() if "in-pass" in r["name"] else [(r["name"], syncs)]
        for label, found in labelled:
            print(f"\n{label}: host synchronisations (torch sync debug mode), {sum(found.values())}")
            for where, count in found.items():
                print(f"  {count:4d}x  {where}")
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


def _decode_target(batch: int) -> dict:
    """Issue 5's decode targets: batch 1 >= 0.60 of the floor, batch 64 >= 0.50; none for others."""
    targets = {1: 0.60, 64: 0.50}
    return {"target": targets[batch]} if batch in targets else {}


def _sized(config: EngineConfig, num_requests: int, blocks_per_seq: int) -> EngineConfig:
    """The engine config with KV and state budgets for num_requests sequences."""
    from dataclasses import replace

    from engine.model_config import load_model_config
    from engine.models.granite_moe_hybrid import GraniteMoeHybridModel

    with torch.device("meta"):
        model = GraniteMoeHybridModel(load_model_config(config.model_dir), dtype=torch.bfloat16)
    return replace(
        config,
        max_num_seqs=num_requests,
        max_num_batched_tokens=8192,
        kv_cache_bytes=model.kv_bytes_per_block(BLOCK_SIZE) * blocks_per_seq * num_requests,
        state_cache_bytes=model.state_bytes_per_slot() * num_requests,
    )


if __name__ == "__main__":
    main()
