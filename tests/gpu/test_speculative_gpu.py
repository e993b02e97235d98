"""Speculative verification on one CUDA device (engine/speculative/verify_gpu.py; issue 25).

- The Mamba2 mixer's verification path (mix_verification_gpu, the one-pass kernel
  engine/kernels/gpu/mamba_verify.py) against the mixer's one-token decode step chained token by token in PyTorch
  (the CPU verification path): y, the states in the scratch slots, the request slots only read.
- The worker: a step that mixes a verification chunk with a decode chunk and a fresh prefill
  chunk (GpuVerifyPass, rows reordered) gives the argmax plain decoding gives, leaves the
  request's slot alone until the commit, and then the states and KV of plain decoding; a step
  of verification chunks only replays a verification CUDA graph (verify_graphs.py) and gives
  what the eager route gives; neither route, nor the commit, waits for the device in submit.
- The engine: greedy outputs with speculation on equal those with it off over the exactness
  workload (chat requests with shared system prompts, each also from scratch, multi-turn
  follow-ups, repeating prompts) in fp32 and bf16, and drafts are accepted on the repeating
  prompts. A divergence is allowed only at a near-tie of the spec-off logits, counted: in
  fp32 NEAR_TIE (tests/engine/exactness.py) and check_near_ties' bound, in bf16 a gap of at
  most BF16_NEAR_TIE_ULPS bf16 steps at the top logit's magnitude (the verification's GEMMs
  round k + 1 rows another way than a decode step's single-row GEMMs, and the tiny random
  model's logits are nearly flat: on the H200 a third of the MTP requests met a gap of 0 to 3
  steps), at most BF16_MAX_NEAR_TIE_FRACTION of the requests.

The host side (chunk order, indices, the glue with the kernel's PyTorch reference) is
checked on the CPU in tests/engine/test_verify_gpu_host.py, the kernel against its reference
in tests/gpu/test_verify_kernels.py (also under Triton's interpreter). Every test here needs
the GPU.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import CommitOp, ScheduledChunk, SchedulerOutput
from tests.engine.exactness import NEAR_TIE, Tally, check_near_ties, run_round, tight_config
from tests.gpu.conftest import relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the engine's CUDA route, "
                       "fla-core's kernels among them)"),
]

K = 4
GREEDY = SamplingParams(max_tokens=24, temperature=0)
BF16_NEAR_TIE_ULPS = 4  # bf16 steps (8 significant bits) at the top logit's magnitude
BF16_MAX_NEAR_TIE_FRACTION = 0.5
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # kernel vs PyTorch, over 5 chained positions


# ----------------------------------------------------------------- the mixer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixer_verification_equals_the_chained_decode_step(dtype):
    """Chunks of 5, 2 and 4 tokens (k = 4): y + D x at every position and the scratch slots'
    states match mix_decode chained in PyTorch; every slot but the scratch slots unchanged."""
    from engine.execution.loader import load_model
    from engine.speculative.verify import VerificationScratch
    from engine.kernels.gpu.batch_plan import build_verification_plan
    from engine.layers.verification import mix_verification_gpu
    from engine.speculative.verify_gpu import verification_index

    device = torch.device("cuda")
    model, _ = load_model(DEFAULT_MODEL_DIR, dtype=dtype, device=device)
    mixer = next(layer.mamba for layer in model.layers if layer.mamba is not None)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # the checkpoint's D is 1 in every head: draw one per head
        mixer.D.copy_(2 * torch.randn(mixer.num_heads, generator=g))
    lengths, slots, firsts = [5, 2, 4], [2, 0, 1], [3, 8, 10]  # rows 0..2: another chunk's
    scratch = VerificationScratch(None, 4, K)
    total = 4 + 3 * (K + 1)
    (conv_dim, taps), ssm_shape = model.mamba_state_shape()
    conv_state = torch.randn(total, conv_dim, taps, generator=g).to(device, dtype)
    ssm_state = torch.randn(total, *ssm_shape, generator=g).to(device)
    T = 3 + sum(lengths)
    hidden = torch.randn(T, model.config.hidden_size, generator=g).to(device, dtype)
    plan = build_verification_plan(verification_index(firsts, lengths, slots, scratch), None, 3, device)
    got_conv, got_ssm = conv_state.clone(), ssm_state.clone()
    with torch.inference_mode():
        _, xBC, dt_raw = mixer.in_proj(hidden).split([mixer.intermediate_size, conv_dim, mixer.num_heads], dim=-1)
        y, x = mix_verification_gpu(mixer, xBC, dt_raw, got_conv, got_ssm, plan)
        torch.cuda.synchronize()
        written = {s for slot in slots for s in scratch.slots(slot, K + 1)}
        tol = TOL[dtype]
        for first, length, slot in zip(firsts, lengths, slots):
            conv, ssm = conv_state[slot : slot + 1], ssm_state[slot : slot + 1]
            for i, scratch_slot in enumerate(scratch.slots(slot, length)):
                row = first + i
                want_y, conv, ssm = mixer.mix_decode(xBC[row : row + 1], dt_raw[row : row + 1], conv, ssm)
                conv = conv.to(dtype)  # the cache holds the window in the model dtype
                got_y = y[row] + mixer.D[:, None] * x[row].view(mixer.num_heads, mixer.head_dim).float()
                assert relative_error(got_y, want_y[0]) < tol, f"y, chunk at {first}, position {i}"
                assert torch.equal(got_conv[scratch_slot], conv[0]), f"conv window, chunk at {first}, position {i}"
                assert relative_error(got_ssm[scratch_slot], ssm[0]) < tol, f"ssm, chunk at {first}, position {i}"
    untouched = [s for s in range(total) if s not in written]
    assert set(slots) <= set(untouched)
    assert torch.equal(got_conv[untouched], conv_state[untouched])
    assert torch.equal(got_ssm[untouched], ssm_state[untouched])


# ----------------------------------------------------------------- the worker


def _state(worker, slot: int) -> list[torch.Tensor]:
    caches = worker.caches
    return [t.clone() for layer in sorted(caches.conv_state)
            for t in (caches.conv_state[layer][slot], caches.ssm_state[layer][slot])]


def _kv(worker, block: int, offsets: slice) -> list[torch.Tensor]:
    caches = worker.caches
    return [cache[layer][block, offsets].clone() for cache in (caches.key_cache, caches.value_cache)
            for layer in sorted(cache)]


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest relative error of a's tensors against b's (fp32 model: within 1e-4 is
    rounding)."""
    return max(relative_error(x, y) for x, y in zip(a, b, strict=True))


def test_worker_verifies_beside_decode_and_prefill_chunks():
    """Request r verifies [g0, g1, wrong, 5] in a step that also decodes q and prefills p
    (fresh): r's argmax is plain decoding's up to the wrong draft, q's and p's sampled tokens
    are plain decoding's, r's slot is untouched until the commit of position 1, which gives
    plain decoding's state and KV; q's and p's slots match too."""
    from engine.execution.worker import Worker

    spec = Worker(EngineConfig(device="cuda", num_speculative_tokens=3))
    plain = Worker(EngineConfig(device="cuda"))
    rng = random.Random(7)
    prompts = {rid: tuple(rng.randrange(100, 2000) for _ in range(n)) for rid, n in (("r", 20), ("q", 12), ("p", 9))}
    slots, blocks = {"r": 0, "q": 1, "p": 2}, {"r": (0, 1, 2), "q": (3, 4), "p": (5, 6)}

    def chunk(rid, tokens, start, drafts=0):
        return ScheduledChunk(rid, tuple(tokens), start, blocks[rid], slots[rid], start == 0, True, GREEDY,
                              num_draft_tokens=drafts)

    def step(worker, *chunks, commits=()):
        return worker.execute(SchedulerOutput(tuple(chunks), commits=commits))

    first = {w: step(w, chunk("r", prompts["r"], 0), chunk("q", prompts["q"], 0)).sampled_token_ids for w in (spec, plain)}
    assert first[spec] == first[plain]
    g0, q0 = first[plain]["r"], first[plain]["q"]
    out = step(plain, chunk("r", [g0], 20), chunk("q", [q0], 12), chunk("p", prompts["p"], 0))
    g1, q1, p0 = out.sampled_token_ids["r"], out.sampled_token_ids["q"], out.sampled_token_ids["p"]
    g2 = step(plain, chunk("r", [g1], 21)).sampled_token_ids["r"]
    wrong = (g2 + 1) % 2000
    before = _state(spec, slots["r"])
    out = step(spec, chunk("q", [q0], 12), chunk("r", [g0, g1, wrong, 5], 20, drafts=3), chunk("p", prompts["p"], 0))
    assert out.verified_token_ids["r"][:2] == (g1, g2)
    assert out.sampled_token_ids == {"q": q1, "p": p0}
    assert all(torch.equal(a, b) for a, b in zip(_state(spec, slots["r"]), before)), "r's slot written"
    for rid in ("q", "p"):
        assert (err := _worst(_state(spec, slots[rid]), _state(plain, slots[rid]))) <= 1e-4, f"{rid}'s state: {err:.2e}"
    step(spec, commits=(CommitOp("r", slots["r"], 1),))
    assert (err := _worst(_state(spec, slots["r"]), _state(plain, slots["r"]))) <= 1e-4, f"r's state: {err:.2e}"
    assert (err := _worst(_kv(spec, 1, slice(0, 6)), _kv(plain, 1, slice(0, 6)))) <= 1e-4, f"K/V 16..21: {err:.2e}"
    # a lone verification chunk (which a prefill graph would also fit) replays a verification
    # graph, padded to k + 1 rows and to the graph's batch, and goes on exactly
    g3 = step(plain, chunk("r", [g2], 22)).sampled_token_ids["r"]
    g4 = step(plain, chunk("r", [g3], 23)).sampled_token_ids["r"]
    replays = spec.verify_graphs.replays
    assert step(spec, chunk("r", [g2, g3], 22, drafts=1)).verified_token_ids["r"] == (g3, g4)
    assert spec.verify_graphs.replays == replays + 1
    step(spec, commits=(CommitOp("r", slots["r"], 1),))
    assert (err := _worst(_state(spec, slots["r"]), _state(plain, slots["r"]))) <= 1e-4, f"r's state: {err:.2e}"
    assert (err := _worst(_kv(spec, 1, slice(0, 8)), _kv(plain, 1, slice(0, 8)))) <= 1e-4, f"K/V 16..23: {err:.2e}"


def test_verification_graphs_equal_the_eager_route():
    """Three verification chunks of 5, 3 and 2 tokens (k = 4; a graph of 4 chunks: padded rows
    and a padding chunk) through the worker's verification graphs, then the same step through
    the eager route (graphs detached): the same argmax at every position, scratch states and
    K/V within rounding, the requests' own slots untouched by either."""
    from engine.execution.worker import Worker

    worker = Worker(EngineConfig(device="cuda", num_speculative_tokens=K))
    assert worker.verify_graphs is not None and worker.verify_graphs.batch_sizes == (1, 2, 4, 8, 16)
    rng = random.Random(9)
    requests = {"a": (0, (0, 1, 2)), "b": (1, (3, 4)), "c": (2, (5, 6))}  # slot, blocks
    prompts = {rid: tuple(rng.randrange(100, 2000) for _ in range(n)) for rid, n in (("a", 30), ("b", 14), ("c", 9))}

    def chunk(rid, tokens, start, drafts=0):
        slot, blocks = requests[rid]
        return ScheduledChunk(rid, tuple(tokens), start, blocks, slot, start == 0, True, GREEDY,
                              num_draft_tokens=drafts)

    first = worker.execute(SchedulerOutput(tuple(chunk(rid, p, 0) for rid, p in prompts.items()))).sampled_token_ids
    lengths = {"a": 5, "b": 3, "c": 2}
    verifying = tuple(
        chunk(rid, [first[rid], *(rng.randrange(100, 2000) for _ in range(n - 1))], len(prompts[rid]), drafts=n - 1)
        for rid, n in lengths.items()
    )
    own = {rid: _state(worker, slot) for rid, (slot, _) in requests.items()}

    def verify():
        out = worker.execute(SchedulerOutput(verifying))
        states = {rid: [_state(worker, s) for s in worker.verification.slots(requests[rid][0], n)]
                  for rid, n in lengths.items()}
        kv = {rid: _kv(worker, requests[rid][1][-1], slice(0, 16)) for rid in lengths}
        return out.verified_token_ids, states, kv

    replays = worker.verify_graphs.replays
    graph_tokens, graph_states, graph_kv = verify()
    assert worker.verify_graphs.replays == replays + 1
    graphs, worker.verify_graphs = worker.verify_graphs, None
    eager_tokens, eager_states, eager_kv = verify()
    worker.verify_graphs = graphs
    assert graph_tokens == eager_tokens
    for rid in lengths:
        for i, (got, want) in enumerate(zip(graph_states[rid], eager_states[rid])):
            assert (err := _worst(got, want)) <= 1e-4, f"{rid} scratch state of position {i}: {err:.2e}"
        assert (err := _worst(graph_kv[rid], eager_kv[rid])) <= 1e-4, f"{rid} K/V: {err:.2e}"
        assert all(torch.equal(a, b) for a, b in zip(_state(worker, requests[rid][0]), own[rid])), f"{rid}'s slot"


@pytest.mark.parametrize("route", ["graph", "eager"])
def test_verification_steps_do_not_wait(route):
    """A step of verification chunks (graph) and one that mixes a verification chunk with a
    decode chunk (eager route) submit without a host synchronisation (tests/gpu/test_host_sync.py's
    check: the second submit under sync debug mode "error"), and the commit of the step after."""
    from engine.execution.worker import Worker
    from tests.gpu.test_host_sync import sync_is_an_error

    worker = Worker(EngineConfig(device="cuda", num_speculative_tokens=K))
    blocks = {0: (0, 1, 2), 1: (3, 4, 5)}

    def chunk(slot, tokens, start, drafts=0):
        return ScheduledChunk(f"r{slot}", tuple(tokens), start, blocks[slot], slot, start == 0, True, GREEDY,
                              num_draft_tokens=drafts)

    worker.execute(SchedulerOutput((chunk(0, range(100, 120), 0), chunk(1, range(200, 217), 0))))
    verify = chunk(0, [7, 8, 9, 10, 11], 20, drafts=4)
    step = SchedulerOutput((verify, chunk(1, [5, 6, 7], 17, drafts=2)) if route == "graph"
                           else (verify, chunk(1, [5], 17)))
    commit = SchedulerOutput((), commits=(CommitOp("r0", 0, 2),))
    replays = worker.verify_graphs.replays
    for run in range(2):
        worker.execute(step)
        torch.cuda.synchronize()
        with sync_is_an_error() if run else contextlib.nullcontext():
            worker.submit(commit)
        worker.collect()
        torch.cuda.synchronize()
        with sync_is_an_error():
            worker.submit(step)
        out = worker.collect()
        assert len(out.verified_token_ids["r0"]) == 5
    assert (worker.verify_graphs.replays > replays) == (route == "graph")


# ----------------------------------------------------------------- the engine


def _bf16_step(magnitude: float) -> float:
    """The spacing of bf16 values at `magnitude` (> 0): 2^(exponent - 7)."""
    return 2.0 ** (math.floor(math.log2(max(magnitude, 1e-30))) - 7)


def _compare(got: list[int], want, tally: Tally, label: str, dtype: torch.dtype) -> None:
    """Speculation on (`got`) against off (`want`, an exactness Outcome with logits): tokens
    identical; a divergence only at a near-tie of the spec-off logits (counted, rest not
    compared)."""
    tally.requests += 1
    for position, (a, b) in enumerate(zip(got, want.token_ids)):
        if a != b:
            logits = want.logits[position]
            top2 = torch.topk(logits, 2).values
            gap = float(top2[0] - top2[1])
            bound = NEAR_TIE if dtype == torch.float32 else BF16_NEAR_TIE_ULPS * _bf16_step(float(top2.abs().max()))
            assert gap < bound, f"{label}: output position {position}: {a} with speculation, {b} without (gap {gap:.2e})"
            tally.near_ties += 1
            print(f"near-tie in {label} at output position {position} (gap {gap:.2e})")
            return
    assert len(got) == len(want.token_ids), f"{label}: lengths differ"


def compare_chat_rounds_on_cuda(
    off: LLMEngine, on: LLMEngine, seed: int, dtype: str, label: str,
    extra_jobs: Callable[[int], list[tuple]] = lambda round_index: [],
) -> Tally:
    """tests/engine/test_speculative.py's rounds of chat requests (_chat_jobs(seed), 16
    requests, each round with extra_jobs(round index) added) through `off` (with logits) and
    `on` (greedy, 12 tokens): every output of `on` must be `off`'s (_compare, near-ties by
    dtype); the near-ties checked (fp32: check_near_ties; bf16: at most
    BF16_MAX_NEAR_TIE_FRACTION of the requests). Prints the speculation counters; returns the
    tally."""
    from tests.engine.test_speculative import _chat_jobs

    with_logits = replace(GREEDY, max_tokens=12, return_logits=True)
    tally, torch_dtype = Tally(), getattr(torch, dtype)
    rounds = _chat_jobs(off.tokenizer, seed=seed, num_requests=16)
    jobs = next(rounds)
    round_index = 0
    while True:
        jobs = jobs + extra_jobs(round_index)
        want = run_round(off, jobs, with_logits)
        got = run_round(on, jobs, replace(with_logits, return_logits=False))
        for request_id, *_ in jobs:
            _compare(got[request_id].token_ids, want[request_id], tally, f"{label} {dtype} {request_id}", torch_dtype)
        try:
            jobs = rounds.send({rid: got[rid].text for rid, *_ in jobs})
        except StopIteration:
            break
        round_index += 1
    stats = on.stats().speculation
    print(f"\n[{label} {dtype}] requests={tally.requests} near_ties={tally.near_ties} "
          f"proposed={stats.draft_tokens_proposed} accepted={stats.draft_tokens_accepted} "
          f"acceptance={stats.acceptance_rate:.2f} lengths={stats.acceptance_lengths}")
    if torch_dtype == torch.float32:
        check_near_ties(tally, f"{label} {dtype}")
    else:
        assert tally.near_ties <= BF16_MAX_NEAR_TIE_FRACTION * tally.requests, f"{tally.near_ties} near-ties"
    return tally


def compare_with_repeating_prompts_on_cuda(off: LLMEngine, on: LLMEngine, seed: int, dtype: str, label: str) -> None:
    """compare_chat_rounds_on_cuda with three span-repeating prompts added to every round
    (_repeating_prompts), then: drafts were verified and accepted, one acceptance length per
    verification chunk, both engines' pools idle."""
    repeating = _repeating_prompts(off, 3)
    compare_chat_rounds_on_cuda(
        off, on, seed, dtype, label,
        extra_jobs=lambda round_index: [(f"rep-{round_index}-{i}", p, None, "") for i, p in enumerate(repeating)])
    stats = on.stats().speculation
    assert stats.verification_chunks > 0 and stats.draft_tokens_accepted > 0
    assert sum(stats.acceptance_lengths) == stats.verification_chunks
    assert on.pool_usage().idle and off.pool_usage().idle


def _repeating_prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    """P + C + P for random spans P, C the engine's greedy continuation of P (which the
    n-gram drafter then proposes after the second P)."""
    rng = random.Random(25)
    spans = [[rng.randrange(100, 2000) for _ in range(rng.randint(12, 24))] for _ in range(count)]
    jobs = [(f"span-{i}", p, None, "spans") for i, p in enumerate(spans)]
    continued = run_round(engine, jobs, GREEDY)
    return [p + continued[f"span-{i}"].token_ids + p for i, p in enumerate(spans)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("label", ["tight: eviction + preemption, budget 64", "roomy, budget 61, sync"])
def test_greedy_outputs_equal_speculation_off_on_cuda(dtype, label):
    if label.startswith("tight"):
        config = replace(tight_config(), device="cuda", dtype=dtype)
    else:
        config = EngineConfig(device="cuda", dtype=dtype, max_num_batched_tokens=61, async_scheduling=False,
                              max_model_len=512, kv_cache_bytes=32 << 20, state_cache_bytes=32 << 20)
    off, on = LLMEngine(config), LLMEngine(replace(config, num_speculative_tokens=K))
    assert not on.scheduler.checkpoints.in_pass_capture  # speculation turns in-pass capture off
    compare_with_repeating_prompts_on_cuda(off, on, len(label), dtype, label)


def test_repeating_prompts_accept_drafts_on_cuda():
    """On the span-repeating workload alone drafts are accepted, and the outputs are the
    spec-off ones."""
    config = EngineConfig(device="cuda", max_model_len=512, kv_cache_bytes=32 << 20, state_cache_bytes=32 << 20)
    off, on = LLMEngine(config), LLMEngine(replace(config, num_speculative_tokens=K))
    prompts = _repeating_prompts(off, 6)
    jobs = [(f"rep-{i}", p, None, "r") for i, p in enumerate(prompts)]
    want = run_round(off, jobs, replace(GREEDY, return_logits=True))
    got = run_round(on, jobs, GREEDY)
    tally = Tally()
    for request_id, *_ in jobs:
        _compare(got[request_id].token_ids, want[request_id], tally, request_id, torch.float32)
    check_near_ties(tally, "repeating prompts")
    stats = on.stats().speculation
    print(f"\nacceptance={stats.acceptance_rate:.2f} lengths={stats.acceptance_lengths}")
    assert stats.draft_tokens_accepted > 0 and stats.verification_chunks > 0
