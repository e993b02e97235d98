"""In-pass capture for Qwen3-Next's gated delta-net on CUDA (engine/kernels/gpu/
delta_rule_capture.py) against the split path: the chunk cut at the capture, two steps, the
captured state being what the first step leaves in the slot.

- the kernel wrapper (gated_delta_rule_prefill_with_captures) against the split path run with
  gated_delta_rule_prefill and against the pure-PyTorch reference;
- the mixer (GatedDeltaNet.forward with an in-pass plan) against two forward calls;
- the Worker on a random Qwen3-Next (tests/gpu/test_in_pass_capture.py's steps: bundles, state
  slots, KV blocks, logits);
- LLMEngine: in-pass serves what the split engine serves, and instruction reuse equals scratch.

Tolerances. In-pass against split: both run fla-core's chunked kernel over the same chunk
edges on the same inputs; only the launch differs (which sequences share it, fixed-length or
varlen path, so possibly other autotuned tile shapes), which reorders tf32 / bf16 sums: 2e-3
relative for the fp32 states and fp32 outputs (tf32's 2^-11 rounding per product, averaged over
the dot products), 1e-2 for bf16 outputs (one bf16 ulp is 2^-8 of an element). Upstream of the
rule (mixer, Worker, engine) the projections run over other row counts, so there the
tolerances are the GPU tests' usual ones. Against the reference: test_gated_delta_rule.py's.
Slots of chunks that reset are filled with NaN first: they must not be read.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.interfaces.forward_batch import build_forward_batch
from engine.kernels.gated_delta_rule_reference import chunk_gated_delta_rule, l2_normalize
from engine.kernels.gpu.batch_plan import build_gpu_batch_plan
from engine.kernels.gpu.batch_plan import with_in_pass_captures
from engine.kernels.gpu.in_pass_capture import CaptureSplit, build_in_pass_plan
from tests.gpu.conftest import relative_error
from tests.gpu.test_gated_delta_rule import (
    BLOCK_SIZE, HK, HV, K, RAW, TOLERANCES, V, _chunk, _inputs, _on, _random_model, random_model_dir,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="fla-core's kernels need a CUDA device"),
]

STATE_TOL = 2e-3  # fp32 states, in-pass against split (module doc)
OUTPUT_TOL = {torch.float32: 2e-3, torch.bfloat16: 1e-2}


def _reference(x: dict[str, torch.Tensor], a: int, b: int, state: torch.Tensor, scale: float):
    """The reference over rows [a, b) of x (q, k normalised and expanded to the value heads)."""
    expand = lambda t: l2_normalize(t[a:b]).repeat_interleave(HV // HK, dim=1)  # noqa: E731
    return chunk_gated_delta_rule(expand(x["q"]), expand(x["k"]), x["v"][a:b], x["g"][a:b],
                                  x["beta"][a:b], state, scale, chunk_size=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths,cuts", [
    ([70, 20, 45], {0: 37, 2: 2}),  # two captures, an uncaptured chunk: both calls varlen
    ([70, 1, 20, 150], {0: 64, 3: 129}),  # a capture on a chunk edge; a decode row between
    ([135], {0: 100}),  # one chunk: both calls on the fixed-length path
])
def test_prefill_with_captures_equals_split_path(dtype, lengths, cuts):
    from engine.kernels.gpu.gated_delta_rule import gated_delta_rule_prefill, gated_delta_rule_prefill_with_captures

    scale = K ** -0.5
    g = torch.Generator().manual_seed(17)
    starts = [sum(lengths[:j]) for j in range(len(lengths))]
    x = _inputs(sum(lengths), seed=len(lengths))
    prefill = [(j, starts[j], n) for j, n in enumerate(lengths) if n > 1]
    slots = [j + 1 for j, _, _ in prefill]
    resets = [p == 0 for p in range(len(prefill))]  # the first chunk resets, the others continue
    pool = torch.randn(len(lengths) + 2, HV, K, V, generator=g) * 0.1
    for s, r in zip(slots, resets):
        if r:
            pool[s] = float("nan")
    on = _on(x, dtype)
    slots_t = torch.tensor(slots, device="cuda")
    resets_t = torch.tensor(resets, device="cuda", dtype=torch.int64)

    # in-pass: one call of the wrapper, over the step's rows
    captured = [p for p, (j, _, _) in enumerate(prefill) if j in cuts]  # in the order of cuts
    splits = [CaptureSplit(j, starts[j], cuts[j], slots[p], resets[p]) for p, (j, _, _) in enumerate(prefill)
              if j in cuts]
    plan = build_in_pass_plan(prefill, splits, {}, {}, torch.device("cuda"))
    in_pass_pool = pool.cuda()
    states_out = torch.full((len(cuts), HV, K, V), float("nan"), device="cuda")
    out = torch.full_like(on["v"], float("nan"))
    gated_delta_rule_prefill_with_captures(
        **on, scale=scale, state_pool=in_pass_pool, slots=slots_t, reset=resets_t, split=plan.split,
        states_out=states_out, out=out,
    )

    # split: the captured chunks' heads, then every chunk (the captured ones from the cut)
    split_pool = pool.cuda()
    rows = lambda spans: torch.cat([torch.arange(a, b) for a, b in spans]).cuda()  # noqa: E731
    cu = lambda spans: torch.tensor([0, *torch.tensor([b - a for a, b in spans]).cumsum(0).tolist()],  # noqa: E731
                                    device="cuda")
    head_spans = [(starts[j], starts[j] + cut) for j, cut in cuts.items()]
    first = rows(head_spans)
    head_o = gated_delta_rule_prefill(
        *(t[first] for t in on.values()), scale=scale, state_pool=split_pool, slots=slots_t[captured],
        reset=resets_t[captured], cu_seqlens=cu(head_spans),
    )
    at_cuts = split_pool[slots_t[captured]].clone()
    tail_spans = [(s + cuts.get(j, 0), s + n) for j, s, n in prefill]
    second = rows(tail_spans)
    tail_o = gated_delta_rule_prefill(
        *(t[second] for t in on.values()), scale=scale, state_pool=split_pool, slots=slots_t,
        reset=resets_t * torch.tensor([p not in captured for p in range(len(prefill))], device="cuda"),
        cu_seqlens=cu(tail_spans),
    )
    assert relative_error(states_out, at_cuts) < STATE_TOL, "captured states against the split path"
    assert relative_error(out[first].float(), head_o.float()) < OUTPUT_TOL[dtype], "heads' outputs"
    assert relative_error(out[second].float(), tail_o.float()) < OUTPUT_TOL[dtype], "tails' outputs"
    for s in slots:
        assert relative_error(in_pass_pool[s], split_pool[s]) < STATE_TOL, f"slot {s} against the split path"

    # and against the reference, uncut
    tol = TOLERANCES[dtype]
    for p, (j, s, n) in enumerate(prefill):
        state = torch.zeros(HV, K, V) if resets[p] else pool[slots[p]]
        want_o, want_state = _reference(x, s, s + n, state, scale)
        assert relative_error(out[s:s + n].float().cpu(), want_o) < tol, f"chunk {j} outputs"
        assert relative_error(in_pass_pool[slots[p]].cpu(), want_state) < tol, f"chunk {j} state"
        if j in cuts:
            _, want_capture = _reference(x, s, s + cuts[j], state, scale)
            c = list(cuts).index(j)
            assert relative_error(states_out[c].cpu(), want_capture) < tol, f"chunk {j} capture"
    assert torch.equal(in_pass_pool[0].cpu(), pool[0]), "a slot no chunk owns was written"


def _layer_step(mixer, hidden: dict[int, torch.Tensor], spans: dict[int, tuple[int, int]], conv, rec,
                captures: dict[int, int] | None = None):
    """One forward of the mixer over request r's rows spans[r] = [a, b) (a chunk from position a,
    resetting at 0) on CUDA; with captures (request -> tokens of its chunk before the capture),
    in-pass. Returns the output rows per request and the captured (conv, recurrent) states."""
    chunks = [_chunk(r, [0] * (b - a), a, a == 0) for r, (a, b) in spans.items()]
    batch = build_forward_batch(chunks, BLOCK_SIZE, torch.device("cuda"))
    plan = build_gpu_batch_plan(batch, BLOCK_SIZE, torch.device("cuda"))
    buffers = None
    if captures:
        index = {r: i for i, r in enumerate(spans)}
        buffers = (conv.new_full((len(captures), *conv.shape[1:]), float("nan")),
                   rec.new_full((len(captures), *rec.shape[1:]), float("nan")))
        plan = with_in_pass_captures(plan, batch, {index[r]: k for r, k in captures.items()}, {}, {})
    rows = torch.cat([hidden[r][a:b] for r, (a, b) in spans.items()])
    y = mixer(rows, batch, conv, rec, gpu_plan=plan, captures=buffers)
    out = dict(zip(spans, y.split([b - a for a, b in spans.values()])))
    return out, buffers


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_mixer_in_pass_equals_split(dtype, tol):
    """GatedDeltaNet.forward with in-pass captures at 37 of a fresh 70-token chunk and 2 tokens
    into a continued chunk (the conv state there partly the old one), beside an uncaptured
    prefill and a decode chunk, against the split path: outputs, captured conv and recurrent
    states, and every chunk's state slots after the step."""
    model = _random_model("cuda", dtype)
    mixer = next(layer.linear_attn for layer in model.layers if layer.linear_attn is not None)
    g = torch.Generator().manual_seed(4)
    hidden = {r: torch.randn(n, RAW["hidden_size"], generator=g).to("cuda", dtype) for r, n in enumerate((70, 60, 20, 11))}
    (conv_dim, taps), rec_shape = model.recurrent_state_shape()
    conv = torch.randn(5, conv_dim, taps, generator=g).to("cuda", dtype)
    rec = 0.1 * torch.randn(5, *rec_shape, generator=g).cuda()
    conv[1], rec[1] = float("nan"), float("nan")  # request 0 (slot 1) resets
    with torch.inference_mode():
        # requests 1 and 3 hold 30 and 10 tokens already (slots 2, 4: the random states)
        paths = {}
        for path in ("split", "in_pass"):
            c, s = conv.clone(), rec.clone()
            if path == "in_pass":
                out, (conv_cap, rec_cap) = _layer_step(
                    mixer, hidden, {0: (0, 70), 1: (30, 60), 2: (0, 20), 3: (10, 11)}, c, s, {0: 37, 1: 2})
            else:
                first, _ = _layer_step(mixer, hidden, {0: (0, 37), 1: (30, 32), 2: (0, 20), 3: (10, 11)}, c, s)
                conv_cap, rec_cap = c[[1, 2]].clone(), s[[1, 2]].clone()
                second, _ = _layer_step(mixer, hidden, {0: (37, 70), 1: (32, 60)}, c, s)
                out = {r: torch.cat([first[r], second[r]]) if r in second else first[r] for r in first}
            paths[path] = out, conv_cap, rec_cap, c, s
    (out, conv_cap, rec_cap, c, s), (want_out, want_conv, want_rec, want_c, want_s) = paths["in_pass"], paths["split"]
    for r in want_out:
        assert relative_error(out[r].float(), want_out[r].float()) < tol, f"request {r} output"
    assert relative_error(conv_cap.float(), want_conv.float()) < tol, "captured conv states"
    assert relative_error(rec_cap, want_rec) < tol, "captured recurrent states"
    for slot in (1, 2, 3, 4):
        assert relative_error(c[slot].float(), want_c[slot].float()) < tol, f"conv slot {slot}"
        assert relative_error(s[slot], want_s[slot]) < tol, f"recurrent slot {slot}"


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory):
    """A dense random Qwen3-Next: no router whose top-k a rounding difference could flip
    (test_gated_delta_rule.py's engine test runs the experts with in-pass capture)."""
    return random_model_dir(tmp_path_factory.mktemp("qwen3_next_in_pass"), RAW)


@pytest.mark.parametrize("dtype,tol", [("float32", 5e-3), ("bfloat16", 5e-2)])
def test_worker_in_pass_equals_split(qwen3_next_dir, dtype, tol):
    """The Worker's in-pass capture on a random Qwen3-Next against its split
    path: bundles (every gated delta-net layer's conv and recurrent state, attention tail,
    hidden row), state slots, KV blocks, logits (tests/gpu/test_in_pass_capture.py)."""
    from engine.engine_config import EngineConfig
    from tests.gpu.test_in_pass_capture import check_in_pass_equals_split

    check_in_pass_equals_split(EngineConfig(model_dir=str(qwen3_next_dir), device="cuda", dtype=dtype,
                                            max_num_seqs=8), tol)


def test_engine_in_pass_serves_what_the_split_engine_serves(qwen3_next_dir):
    """LLMEngine on a random Qwen3-Next, in-pass on and off (tests/gpu/test_engine_in_pass.py's
    checks): the same tokens and cached_tokens, instruction reuse equal to scratch, the first
    prompt not cut at the instruction boundary."""
    from engine.engine_config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from tests.gpu.test_engine_in_pass import check_in_pass_engine_serves_what_the_split_engine_serves

    config = EngineConfig(model_dir=str(qwen3_next_dir), device="cuda", dtype="float32", max_model_len=512,
                          max_num_batched_tokens=512, kv_cache_bytes=32 << 20, state_cache_bytes=32 << 20)
    check_in_pass_engine_serves_what_the_split_engine_serves(
        LLMEngine(config), LLMEngine(replace(config, in_pass_capture=False)))


@pytest.mark.parametrize("beside", [0, 1])  # with another prefill chunk: both calls' varlen paths
def test_in_pass_step_does_not_wait(qwen3_next_dir, beside):
    """A dense random Qwen3-Next's step that captures at token 512 inside a 700-token chunk,
    alone or beside another prefill chunk, submitted under torch's sync debug mode "error"
    (tests/gpu/test_host_sync.py): the two calls' indices come with the plan, nothing is read
    back."""
    from engine.engine_config import EngineConfig
    from engine.interfaces.step_io import CaptureOp, SchedulerOutput
    from engine.execution.worker import Worker
    from tests.gpu.test_host_sync import _chunk as host_sync_chunk, _submit_without_waiting

    worker = Worker(EngineConfig(
        model_dir=str(qwen3_next_dir), device="cuda", max_model_len=1024,
        max_num_batched_tokens=1024, kv_cache_bytes=32 << 20, state_cache_bytes=32 << 20,
    ))
    chunks = (host_sync_chunk(2, 700),) + ((host_sync_chunk(0, 300),) if beside else ())
    step = lambda bundle: SchedulerOutput(  # noqa: E731
        chunks, captures=(CaptureOp(bundle, "r2", 2, 512, None, in_pass=True),),
    )
    worker.execute(step(1))
    out = _submit_without_waiting(worker, step(2))
    assert out.confirmed_captures.get(2) and "r2" in out.sampled_token_ids
