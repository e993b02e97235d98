"""engine/execution/worker.py samples a decode-graph step from the logits the graph computed, and falls
back to the eager LM head for the whole step when a sampled request was not in the graph's
step (a request restored from a checkpoint that samples from the bundle's hidden row).

CPU only: a stand-in for DecodeGraphRunner runs the model eagerly and returns the negated
logits, so a token sampled from the "graph" logits (their argmax is the eager argmin) is told
apart from one sampled from the eager LM head. Its argmax output is the eager argmin plus one,
so a greedy token taken from the graph's argmax (what the worker does unless min_tokens masks
the row) is told apart from one recomputed from the graph's logits.
"""

from __future__ import annotations

import torch

from engine.engine_config import EngineConfig
from engine.routes.decode_graphs import DecodeGraphRunner
from engine.interfaces.forward_batch import build_forward_batch
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import CaptureOp, RestoreOp, ScheduledChunk, SchedulerOutput
from engine.execution.worker import Worker

BLOCKS = 4


class NegatedLogitsGraphs:
    """accepts/forward as DecodeGraphRunner's, and its run (the route the worker calls);
    forward returns (hidden, -logits, the eager argmin + 1) and remembers the eager argmax
    and argmin of each row."""

    run = DecodeGraphRunner.run

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.eager_argmax: list[int] = []
        self.eager_argmin: list[int] = []

    def accepts(self, chunks: list[ScheduledChunk], in_pass=()) -> bool:
        return all(len(c.token_ids) == 1 for c in chunks)

    def forward(self, chunks: list[ScheduledChunk], pending_rows=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w = self.worker
        hidden = w.model(build_forward_batch(chunks, w.capacity.block_size, w.device), w.caches)
        logits = w.model.compute_logits(hidden)
        self.eager_argmax, self.eager_argmin = logits.argmax(-1).tolist(), logits.argmin(-1).tolist()
        return hidden.clone(), -logits, logits.argmin(-1) + 1


def _chunk(request: int, tokens: tuple[int, ...], start: int, slot: int, sample: bool = True,
           sampling: SamplingParams = SamplingParams(temperature=0.0), generated: int = 0) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=f"r{request}", token_ids=tokens, start_position=start,
        block_table=tuple(range(slot * BLOCKS, (slot + 1) * BLOCKS)), state_slot=slot,
        reset_state=start == 0, sample=sample, sampling=sampling, num_output_tokens=generated,
    )


def test_graph_step_samples_the_graph_logits_unless_a_sampled_request_was_not_in_it():
    worker = Worker(EngineConfig(max_num_seqs=4))
    graphs = NegatedLogitsGraphs(worker)
    worker.decode_graphs = graphs
    prompt = tuple(range(3, 19))  # 16 tokens: a whole block, so a capture there has no tail
    out = worker.execute(SchedulerOutput((_chunk(0, prompt, 0, 0), _chunk(1, prompt[:5], 0, 1))))
    assert set(out.sampled_token_ids) == {"r0", "r1"}  # multi-token chunks: eager, no graph

    # r1 decodes through the "graph"; r2, restored from r0's checkpoint, samples with no tokens
    capture = CaptureOp(bundle_id=1, request_id="r0", state_slot=0, num_tokens=16, tail_block=None)
    restore = RestoreOp(bundle_id=1, request_id="r2", state_slot=2, tail_block=None)
    out = worker.execute(SchedulerOutput(
        (_chunk(1, (7,), 5, 1), _chunk(2, (), 16, 2)), captures=(capture,), restores=(restore,),
    ))
    assert out.confirmed_captures.keys() == {1}
    assert out.sampled_token_ids["r1"] == graphs.eager_argmax[0]  # the eager LM head for all

    out = worker.execute(SchedulerOutput((_chunk(1, (7,), 6, 1), _chunk(2, (9,), 16, 2))))
    assert [out.sampled_token_ids[r] for r in ("r1", "r2")] == [t + 1 for t in graphs.eager_argmin]  # the graph's argmax
    assert graphs.eager_argmin != graphs.eager_argmax

    # min_tokens masks r2's stop token: the argmax is taken again, from the graph's logits
    unbanned = SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=(0,))
    out = worker.execute(SchedulerOutput((_chunk(1, (7,), 7, 1), _chunk(2, (9,), 17, 2, sampling=unbanned))))
    assert [out.sampled_token_ids[r] for r in ("r1", "r2")] == graphs.eager_argmin
    assert 0 not in graphs.eager_argmin
