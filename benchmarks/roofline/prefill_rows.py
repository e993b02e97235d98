"""The prefill rows of the GPU roofline, driving engine.worker.Worker in process with
hand-built SchedulerOutputs, the way the scheduler would:

  * cold prefill of `prefix` tokens (time to first token) vs its matmul FLOPs at the matmul rate;
  * capture and restore of the bundle of a `prefix`-token prefix (recurrent state of every Mamba
    layer, attention tail, hidden row): time, and restore as a share of the cold prefill of
    `prefix` tokens it replaces;
  * restore of that instruction checkpoint + prefill of a `suffix`-token user message (time to
    first token) vs the cold prefill of all prefix + suffix tokens: the speed-up, with the two
    first tokens' logits compared; with the prefill CUDA graphs (engine/routes/prefill_graphs.py) and
    the same step eagerly;
  * the cold prefix + suffix prefill that also captures the checkpoint at `prefix`, as a ratio
    to the same prefill without capture: the split path (the chunk cut at the boundary, two
    worker steps, the CaptureOp taken at the start of the second) and, on CUDA, the in-pass
    path (one uncut step, CaptureOp.in_pass), with the in-pass bundle's relative difference
    from the split one.

On CUDA the restore + prefill row and the in-pass row (with the same step without capture)
also list where the host waited for the device while one such step ran
(host_synchronisations): the rows' wall time beyond their kernels is host time. The restore +
prefill row also gives its step's timeline (step_timeline): when the host and the GPU reach
the restore, the prefill graph's replay and the end of the step, and where submit's host time
goes (submit_profile).

Time to first token is the time to the sampled token on the host, as serving it takes: no
timed step asks for a logits row (SamplingParams.return_logits, a copy of the row to the host
that serving does not make). The logits compared come from one more, untimed run of each of
the two steps.

checkpoint_rows uses requests 0 and 1 (state slots 0 and 1, blocks [r * blocks_per_seq,
(r + 1) * blocks_per_seq)); the caller reuses them afterwards (every later chunk resets its
state).
"""

from __future__ import annotations

import time

import torch

from engine.execution.worker import Worker
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import CaptureOp, RestoreOp, ScheduledChunk, SchedulerOutput
from roofline.floors import (CAPTURE_OVERHEAD_TARGET, COLD_PREFILL_TARGET, RESTORE_SPEEDUP_TARGET,
                             prefill_flops)
from roofline.instruments import (host_synchronisations, profile_step, step_timeline, submit_profile,
                                  synchronize)
from roofline.model import CONFIG_1P5B, chunk


def cold_prefill_row(worker: Worker, num_tokens: int, blocks_per_seq: int, matmul_rate: float,
                     params_body: int) -> dict:
    """The cold prefill of num_tokens on request 0 against its matmul FLOPs at matmul_rate
    (params_body: the parameters outside the embedding)."""
    ttft, prefill_profile = bench_prefill(worker, num_tokens, slot=0, blocks_per_seq=blocks_per_seq)
    flops = prefill_flops(CONFIG_1P5B, params_body, num_tokens)
    floor = flops / matmul_rate
    return {"name": f"cold prefill {num_tokens} (TTFT)", "seconds": ttft,
            "floor_seconds": floor, "ratio_to_floor": floor / ttft, "flops": flops,
            "tokens_per_s": num_tokens / ttft, "target": COLD_PREFILL_TARGET, "profile": prefill_profile}


def bench_prefill(worker: Worker, num_tokens: int, slot: int, blocks_per_seq: int, repeats: int = 3) -> tuple[float, dict]:
    """Seconds for one cold prefill step of num_tokens (sampling included), best of repeats, and
    the profile of one more such step."""
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



def _chunk(request: int, tokens: list[int], start: int, table: tuple[int, ...], reset: bool,
           sample: bool, logits: bool = False) -> ScheduledChunk:
    """A greedy chunk; logits: its sampled row's logits come back too (untimed runs only)."""
    return ScheduledChunk(
        request_id=f"c{request}", token_ids=tuple(tokens), start_position=start, block_table=table,
        state_slot=request, reset_state=reset, sample=sample,
        sampling=SamplingParams(temperature=0.0, max_tokens=16, return_logits=logits),
    )


def _timed(worker: Worker, steps: list[SchedulerOutput]):
    """Seconds to run the steps back to back (synchronised at both ends), and the last output."""
    synchronize(worker)
    t0 = time.perf_counter()
    for step in steps:
        out = worker.execute(step)
    synchronize(worker)
    return time.perf_counter() - t0, out


def checkpoint_rows(worker: Worker, blocks_per_seq: int, block_size: int, prefix: int = 8192,
                    suffix: int = 256, repeats: int = 3, profile=None) -> list[dict]:
    """The rows above, each best of `repeats`; floors are the cold prefills they are compared to.

    profile: step -> dict (one profiled execution); given, the restore + prefill row carries the
    profile of one such step."""
    total = prefix + suffix
    assert -(-total // block_size) <= blocks_per_seq
    vocab = worker.model.config.vocab_size
    tokens = torch.randint(2, vocab, (total,), generator=torch.Generator().manual_seed(7)).tolist()
    table_a = tuple(range(blocks_per_seq))
    full_blocks = prefix // block_size
    tail_block = table_a[full_blocks] if prefix % block_size else None
    # Request 1 shares request 0's full blocks and owns the rest (its tail block included).
    table_b = table_a[:full_blocks] + tuple(range(blocks_per_seq + full_blocks, 2 * blocks_per_seq))
    tail_b = table_b[full_blocks] if prefix % block_size else None

    cold = SchedulerOutput((_chunk(0, tokens, 0, table_a, True, True),))
    cold_prefix = SchedulerOutput((_chunk(0, tokens[:prefix], 0, table_a, True, False),))
    worker.execute(cold)  # compile / autotune at these lengths
    worker.execute(cold_prefix)
    cold_s = min(_timed(worker, [cold])[0] for _ in range(repeats))
    cold_prefix_s = min(_timed(worker, [cold_prefix])[0] for _ in range(repeats))
    cold_logits = worker.execute(
        SchedulerOutput((_chunk(0, tokens, 0, table_a, True, True, logits=True),))
    ).logits["c0"]

    # Split path: chunk cut at the boundary, capture at the start of the next step.
    bundle = 1000
    split_s = []
    for _ in range(repeats + 1):
        capture = CaptureOp(bundle, "c0", 0, prefix, tail_block)
        second = SchedulerOutput(
            (_chunk(0, tokens[prefix:], prefix, table_a, False, True),), captures=(capture,),
            dropped_bundle_ids=(bundle - 1,),
        )
        seconds, out = _timed(worker, [cold_prefix, second])
        assert out.confirmed_captures.get(bundle), "capture not confirmed"
        split_s.append(seconds)
        bundle += 1
    split_s = min(split_s[1:])  # the first run warms the capture path
    bundle -= 1  # the last bundle stays: the state at `prefix` of request 0

    # In-pass path (CUDA): one uncut step, the capture taken inside the forward pass.
    in_pass_s, in_pass_error, in_pass_profile, in_pass_syncs = None, None, None, None
    if worker.device.type == "cuda":
        in_pass_s = []
        for i in range(repeats + 1):
            capture = CaptureOp(bundle + 1 + i, "c0", 0, prefix, tail_block, in_pass=True)
            seconds, out = _timed(worker, [SchedulerOutput(cold.chunks, captures=(capture,))])
            assert out.confirmed_captures.get(bundle + 1 + i), "in-pass capture not confirmed"
            in_pass_s.append(seconds)
        in_pass_s = min(in_pass_s[1:])
        if profile is not None:
            capture = CaptureOp(bundle + 2 + repeats, "c0", 0, prefix, tail_block, in_pass=True)
            in_pass_profile = profile(SchedulerOutput(cold.chunks, captures=(capture,)))
        capture = CaptureOp(bundle + 3 + repeats, "c0", 0, prefix, tail_block, in_pass=True)
        in_pass_syncs = {
            "in-pass step": host_synchronisations(worker, SchedulerOutput(cold.chunks, captures=(capture,))),
            "same step without capture": host_synchronisations(worker, cold),
        }
        split_bundle, in_pass_bundle = (worker.checkpoints._bundles[b] for b in (bundle, bundle + 1))
        in_pass_error = {
            name: float((getattr(in_pass_bundle, name).float() - getattr(split_bundle, name).float()).norm()
                        / getattr(split_bundle, name).float().norm())
            for name in ("conv_state", "ssm_state", "hidden_row")
        }
        worker.execute(SchedulerOutput((), dropped_bundle_ids=tuple(range(bundle + 1, bundle + 4 + repeats))))

    capture_only = []
    for i in range(repeats):
        worker.execute(cold_prefix)
        capture = CaptureOp(bundle + 1 + i, "c0", 0, prefix, tail_block)
        seconds, out = _timed(worker, [SchedulerOutput((), captures=(capture,))])
        capture_only.append(seconds)
    worker.execute(SchedulerOutput((), dropped_bundle_ids=tuple(range(bundle + 1, bundle + 1 + repeats))))

    restore_s, hit_s = [], []
    for _ in range(repeats + 1):
        seconds, _ = _timed(worker, [SchedulerOutput((), restores=(RestoreOp(bundle, "c1", 1, tail_b),))])
        restore_s.append(seconds)
        hit = SchedulerOutput(
            (_chunk(1, tokens[prefix:], prefix, table_b, False, True),),
            restores=(RestoreOp(bundle, "c1", 1, tail_b),),
        )
        hit_s.append(_timed(worker, [hit])[0])
    restore_s, hit_s = min(restore_s[1:]), min(hit_s[1:])
    hit_logits = worker.execute(SchedulerOutput(
        (_chunk(1, tokens[prefix:], prefix, table_b, False, True, logits=True),),
        restores=(RestoreOp(bundle, "c1", 1, tail_b),),
    )).logits["c1"]
    hit_profile = profile(hit) if profile is not None else None
    hit_syncs = host_synchronisations(worker, hit) if worker.device.type == "cuda" else None
    graphed = getattr(worker, "prefill_graphs", None) is not None and worker.prefill_graphs.accepts(list(hit.chunks))
    hit_timeline = step_timeline(worker, hit) if graphed else None
    hit_submit = submit_profile(worker, hit) if worker.device.type == "cuda" else None
    # The same step with the prefill graphs detached: what they remove.
    hit_eager_s, graphs = None, getattr(worker, "prefill_graphs", None)
    if graphs is not None and graphs.accepts(list(hit.chunks)):
        worker.prefill_graphs = None
        hit_eager_s = min(_timed(worker, [hit])[0] for _ in range(repeats))
        worker.prefill_graphs = graphs
    worker.execute(SchedulerOutput((), dropped_bundle_ids=(bundle,)))

    ref, got = cold_logits, hit_logits
    agree = int(ref.argmax()) == int(got.argmax())
    logits_error = float((got - ref).norm() / ref.norm())
    model = worker.model
    nbytes = model.state_bytes_per_slot() + model.config.hidden_size * model.dtype.itemsize
    return [
        {"name": f"capture {prefix}-token bundle", "seconds": min(capture_only),
         "floor_seconds": cold_prefix_s, "ratio_to_floor": min(capture_only) / cold_prefix_s,
         "ratio_meaning": "share of the cold prefill of the prefix", "bundle_bytes": nbytes},
        {"name": f"restore {prefix}-token bundle", "seconds": restore_s,
         "floor_seconds": cold_prefix_s, "ratio_to_floor": restore_s / cold_prefix_s,
         "ratio_meaning": "share of the cold prefill it saves", "bundle_bytes": nbytes},
        {"name": f"restore {prefix} + prefill {suffix} (TTFT)", "seconds": hit_s,
         "floor_seconds": cold_s, "ratio_to_floor": cold_s / hit_s, "target": RESTORE_SPEEDUP_TARGET,
         "ratio_meaning": f"speed-up over the cold {total}-token prefill",
         "first_token_agrees_with_cold": agree, "logits_relative_error_vs_cold": logits_error,
         "host_synchronisations": hit_syncs, "timeline": hit_timeline,
         "submit_profile": hit_submit,
         **({"profile": hit_profile} if hit_profile else {})},
    ] + ([] if hit_eager_s is None else [
        {"name": f"restore {prefix} + prefill {suffix}, eager", "seconds": hit_eager_s,
         "floor_seconds": cold_s, "ratio_to_floor": cold_s / hit_eager_s,
         "ratio_meaning": "the row above without the prefill CUDA graph"},
    ]) + [
        {"name": f"cold prefill {total} (TTFT)", "seconds": cold_s, "floor_seconds": cold_s,
         "ratio_to_floor": 1.0, "ratio_meaning": "the baseline of the rows around it"},
        {"name": f"cold {total} + capture at {prefix}, split", "seconds": split_s,
         "floor_seconds": cold_s, "ratio_to_floor": split_s / cold_s, "target": CAPTURE_OVERHEAD_TARGET,
         "ratio_meaning": f"time over the cold {total}-token prefill without capture (<= target)"},
    ] + ([] if in_pass_s is None else [
        {"name": f"cold {total} + capture at {prefix}, in-pass", "seconds": in_pass_s,
         "floor_seconds": cold_s, "ratio_to_floor": in_pass_s / cold_s, "target": CAPTURE_OVERHEAD_TARGET,
         "ratio_meaning": f"time over the cold {total}-token prefill without capture (<= target)",
         "bundle_relative_error_vs_split": in_pass_error, "host_synchronisations": in_pass_syncs,
         **({"profile": in_pass_profile} if in_pass_profile else {})},
    ])

