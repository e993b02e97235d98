"""The MTP drafter on one CUDA device (engine/speculative/mtp.py; issue 25), with the random head
of the embedded model (random_mtp_head_seed).

- The worker: the same scripted steps (a prompt, plain decode steps, then verification chunks,
  one partly rejected) on the CPU's PyTorch path and on CUDA give the same sampled and verified
  tokens and the same proposals, and the head's K/V at the kept positions agree (fp32). On CUDA
  the head runs through its batch's plan: its attention in the Triton kernels with first_key 1;
  its draft depths replay the draft graphs (engine/speculative/draft_graphs.py).
- Drafting after a plain decode step submits without a host synchronisation (the drafts reach
  the host at collect); after a verification chunk the drafter reads how many drafts were
  accepted, the one wait it has.
- The engine: greedy outputs with MTP drafts equal those with speculation off over the
  exactness workload in fp32 and bf16 (tests/gpu/test_speculative_gpu.py's comparison: a
  divergence only at a counted near-tie).

The CPU tests of the same drafter are tests/engine/test_speculative_mtp.py. The Mamba2 decode
kernel calls libdevice.log1p, which Triton's interpreter does not emulate: the GPU only.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import CommitOp, ScheduledChunk, SchedulerOutput
from tests.engine.exactness import tight_config
from tests.gpu.conftest import relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the decode kernel calls "
                       "libdevice.log1p, which Triton's interpreter does not emulate)"),
]

K = 3
MTP = dict(num_speculative_tokens=K, speculative_drafter="mtp", random_mtp_head_seed=11)
GREEDY = SamplingParams(max_tokens=12, temperature=0)
BLOCKS = (0, 1, 2)


def _chunk(tokens, start, drafts=0) -> ScheduledChunk:
    return ScheduledChunk("r", tuple(tokens), start, BLOCKS, 0, start == 0, True, GREEDY,
                          num_draft_tokens=drafts, propose_drafts=K)


def _script(worker) -> list:
    """A prompt of 20 tokens, 6 decode steps, a verification chunk whose drafts are the
    worker's own proposal, then one whose second draft is wrong; every step's output."""
    prompt = tuple(random.Random(5).randrange(100, 2000) for _ in range(20))
    outs = [worker.execute(SchedulerOutput((_chunk(prompt, 0),)))]
    tokens = [outs[-1].sampled_token_ids["r"]]
    for position in range(20, 26):
        outs.append(worker.execute(SchedulerOutput((_chunk([tokens[-1]], position),))))
        tokens.append(outs[-1].sampled_token_ids["r"])
    drafts = outs[-1].draft_proposals["r"].token_ids
    outs.append(worker.execute(SchedulerOutput((_chunk([tokens[-1], *drafts], 26, drafts=K),))))
    verified = outs[-1].verified_token_ids["r"]
    kept = 1 + next((i for i in range(K) if drafts[i] != verified[i]), K)
    wrong = (verified[1] + 1) % 2000
    outs.append(worker.execute(SchedulerOutput(
        (_chunk([verified[kept - 1], verified[kept], wrong, 7], 26 + kept, drafts=K),),
        commits=(CommitOp("r", 0, kept),))))
    return outs


def test_cuda_drafts_equal_the_pytorch_path():
    from engine.execution.worker import Worker

    cpu, cuda = Worker(EngineConfig(**MTP)), Worker(EngineConfig(device="cuda", **MTP))
    for step, (want, got) in enumerate(zip(_script(cpu), _script(cuda))):
        assert got.sampled_token_ids == want.sampled_token_ids, f"step {step}"
        assert got.verified_token_ids == want.verified_token_ids, f"step {step}"
        assert got.draft_proposals == want.draft_proposals, f"step {step}"
    # on CUDA every step's proposal came from one replay of the draft graphs
    # (engine/speculative/draft_graphs.py); the CPU drafts eagerly
    assert cpu.drafter.graphs is None and cuda.drafter.graphs.replays == step + 1
    layer = cpu.drafter.head.layer_index
    for name in ("key_cache", "value_cache"):
        want = getattr(cpu.caches, name)[layer][0, 1:16]  # positions 1..15: kept, written once
        got = getattr(cuda.caches, name)[layer][0, 1:16].cpu()
        assert relative_error(got, want) <= 1e-4, name


def test_drafting_after_a_decode_step_does_not_wait():
    from engine.execution.worker import Worker
    from tests.gpu.test_host_sync import sync_is_an_error

    worker = Worker(EngineConfig(device="cuda", **MTP))
    worker.execute(SchedulerOutput((_chunk(range(100, 120), 0),)))
    for position in range(20, 23):
        torch.cuda.synchronize()
        with sync_is_an_error() if position > 20 else contextlib.nullcontext():
            worker.submit(SchedulerOutput((_chunk([7], position),)))
        out = worker.collect()
        assert out.draft_proposals["r"].follows == position + 2
        assert len(out.draft_proposals["r"].token_ids) == K


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_outputs_equal_speculation_off_with_mtp_on_cuda(dtype):
    """The tight configuration (eviction, preemption, async scheduling) on CUDA: the rounds of
    chat requests with speculation off and with MTP drafts give the same outputs."""
    from tests.gpu.test_speculative_gpu import compare_chat_rounds_on_cuda

    config = replace(tight_config(), device="cuda", dtype=dtype)
    off = LLMEngine(config)
    # as many blocks with the head's KV layer (2 attention layers + 1) as without it
    on = LLMEngine(replace(config, kv_cache_bytes=config.kv_cache_bytes * 3 // 2, **MTP))
    compare_chat_rounds_on_cuda(off, on, 31, dtype, "mtp")
    stats = on.stats().speculation
    assert stats.drafter == "mtp" and stats.verification_chunks > 0
    assert stats.draft_tokens_proposed > 2 * stats.verification_chunks  # k drafts, less near max_tokens
    assert on.pool_usage().idle and off.pool_usage().idle
