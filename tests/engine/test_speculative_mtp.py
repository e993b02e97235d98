"""Speculative decoding with the MTP drafter (speculative_drafter mtp; docs/design.md section
10), on the CPU path, with a seeded random MTP head attached to the embedded tiny Granite model:
greedy outputs equal speculation off, the drafts depend only on the tokens (not on how they
were computed: decode steps, verification chunks, a restored checkpoint), and refusals name
the key.

A random head drafts at random, so in the engine its drafts are rejected; the accepted path of
the worker is driven directly with verification chunks of the true tokens.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from deployments.prompts.instruction_boundary import find_instruction_boundary
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.core.llm_engine import LLMEngine
from engine.interfaces.sampling_params import SamplingParams
from engine.speculative.scheduling import SpeculationStats
from engine.interfaces.step_io import CommitOp, ScheduledChunk, SchedulerOutput
from engine.execution.worker import Worker
from tests.engine.conversations import random_text, render, system_prompts
from tests.engine.exactness import tight_config
from tests.engine.test_speculative import compare_chat_rounds

K = 3
SEED = 11
MTP = dict(num_speculative_tokens=K, speculative_drafter="mtp", random_mtp_head_seed=SEED)
GREEDY = SamplingParams(max_tokens=12, temperature=0)


# ----------------------------------------------------------------- configuration


@pytest.mark.parametrize("changes, message", [
    ({"random_mtp_head_seed": 1}, "random_mtp_head_seed attaches a head for speculative_drafter mtp"),
    ({**MTP, "random_mtp_head_seed": -1}, "random_mtp_head_seed must be an integer"),
    ({**MTP, "random_mtp_head_seed": True}, "random_mtp_head_seed must be an integer"),
])
def test_config_refusals(changes, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**changes)


def test_a_model_without_an_mtp_head_is_refused_naming_the_drafter():
    with pytest.raises(ValueError, match="speculative_drafter mtp: this model has no multi-token-prediction head"):
        LLMEngine(EngineConfig(num_speculative_tokens=K, speculative_drafter="mtp"))


def test_the_head_has_its_own_kv_layer_in_the_blocks():
    """The head's layer (index num_hidden_layers) is one more KV layer of every block: in the
    stacked KV cache, in the KV bytes a block costs and in the checkpoint shard layout."""
    off, on = Worker(EngineConfig()), Worker(EngineConfig(**MTP))
    layers = off.model_config.num_hidden_layers
    assert sorted(on.caches.key_cache) == sorted(off.caches.key_cache) + [layers]
    assert on.caches.kv_stack.shape[1] == off.caches.kv_stack.shape[1] + 1
    per_layer = off.capacity.bundle_sizing.kv_bytes_per_token // len(off.caches.key_cache)
    assert on.capacity.bundle_sizing.kv_bytes_per_token == off.capacity.bundle_sizing.kv_bytes_per_token + per_layer
    assert on.model.mtp is on.drafter.head and off.model.mtp is None


# ----------------------------------------------------------------- the worker's drafts


def _head_kv(worker: Worker, block: int, offsets: slice) -> list[torch.Tensor]:
    layer = worker.drafter.head.layer_index
    return [worker.caches.key_cache[layer][block, offsets].clone(),
            worker.caches.value_cache[layer][block, offsets].clone()]


def test_drafts_follow_from_the_tokens_whatever_computed_them():
    """A worker that decodes token by token and one that verifies drafts (all accepted, then
    one rejected) propose the same drafts after the same tokens, and hold the same head K/V
    at the kept positions."""
    plain, spec = Worker(EngineConfig(**MTP)), Worker(EngineConfig(**MTP))
    prompt = tuple(random.Random(5).randrange(100, 2000) for _ in range(20))
    blocks = (0, 1, 2)

    def chunk(tokens, start, drafts=0):
        return ScheduledChunk("r", tuple(tokens), start, blocks, 0, start == 0, True, GREEDY,
                              num_draft_tokens=drafts, propose_drafts=K)

    # plain decoding: the token at every position and the proposal after it
    out = plain.execute(SchedulerOutput((chunk(prompt, 0),)))
    tokens, proposals = [out.sampled_token_ids["r"]], {}
    proposals[out.draft_proposals["r"].follows] = out.draft_proposals["r"].token_ids
    for position in range(20, 28):
        out = plain.execute(SchedulerOutput((chunk([tokens[-1]], position),)))
        tokens.append(out.sampled_token_ids["r"])
        proposal = out.draft_proposals["r"]
        assert proposal.follows == position + 2 and len(proposal.token_ids) == K
        proposals[proposal.follows] = proposal.token_ids

    out = spec.execute(SchedulerOutput((chunk(prompt, 0),)))
    assert out.draft_proposals["r"].token_ids == proposals[21]
    # every draft right: 3 accepted, the bonus token at 24, drafts after it
    out = spec.execute(SchedulerOutput((chunk(tokens[:4], 20, drafts=3),)))
    assert out.verified_token_ids["r"] == tuple(tokens[1:5])
    assert out.draft_proposals["r"] == replace(out.draft_proposals["r"], follows=25, token_ids=proposals[25])
    # one right, one wrong: the bonus token at 26
    wrong = (tokens[6] + 1) % 2000
    out = spec.execute(SchedulerOutput((chunk([tokens[4], tokens[5], wrong, 7], 24, drafts=3),),
                                       commits=(CommitOp("r", 0, 3),)))
    assert out.verified_token_ids["r"][:2] == (tokens[5], tokens[6])
    assert out.draft_proposals["r"].follows == 27 and out.draft_proposals["r"].token_ids == proposals[27]
    # the next chunk starts at the kept position and goes on as plain decoding
    out = spec.execute(SchedulerOutput((chunk([tokens[6]], 26),), commits=(CommitOp("r", 0, 1),)))
    assert out.sampled_token_ids["r"] == tokens[7] and out.draft_proposals["r"].token_ids == proposals[28]
    for got, want in zip(_head_kv(spec, 1, slice(0, 11)), _head_kv(plain, 1, slice(0, 11))):  # positions 16..26
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
    assert all(torch.equal(a, b) for a, b in zip(_head_kv(spec, 0, slice(0, 16)), _head_kv(plain, 0, slice(0, 16))))


# ----------------------------------------------------------------- engines


@pytest.mark.parametrize("cap", [None, 1])
def test_greedy_outputs_equal_speculation_off_over_the_exactness_workload(cap):
    """The tight configuration (eviction, preemption, async scheduling): the same rounds of chat
    requests (each also from scratch) with speculation off and with MTP drafts; with drafting
    capped at one running request (speculative_max_batch_size) too, so that requests move
    between drafting and plain decoding, which asks the head for no proposal."""
    config = tight_config()
    # as many blocks with the head's KV layer (2 attention layers + 1) as without it
    off = LLMEngine(config)
    on = LLMEngine(replace(config, kv_cache_bytes=config.kv_cache_bytes * 3 // 2, speculative_max_batch_size=cap, **MTP))
    assert on.executor.capacity.num_blocks == off.executor.capacity.num_blocks
    tally = compare_chat_rounds(off, on, seed=25, label=f"mtp, cap {cap}")
    stats = on.stats().speculation
    print(f"\n[mtp, cap {cap}] requests={tally.requests} near_ties={tally.near_ties} proposed={stats.draft_tokens_proposed} "
          f"accepted={stats.draft_tokens_accepted} preemptions={on.stats().scheduler.preemptions}")
    assert stats.drafter == "mtp" and stats.verification_chunks > 0
    assert stats.draft_tokens_proposed > 2 * stats.verification_chunks  # k drafts, less near max_tokens
    assert on.stats().scheduler.preemptions > 0
    assert on.pool_usage().idle and off.pool_usage().idle


def _chat_requests(tokenizer, count: int) -> list[tuple[str, list[int], int]]:
    """`count` chat prompts over three shared system prompts: (id, prompt, instruction boundary)."""
    rng = random.Random(32)
    systems = system_prompts(rng, 3)
    requests = []
    for i in range(count):
        conversation = [{"role": "system", "content": systems[i % 3]},
                        {"role": "user", "content": random_text(rng, 3, 20)}]
        prompt = render(tokenizer, conversation)
        requests.append((f"q{i}", prompt, find_instruction_boundary(tokenizer, conversation, prompt).position))
    return requests


def _drafts_per_request(engine: LLMEngine, requests, batch: int) -> tuple[dict[str, list], dict[str, int]]:
    """Run `requests` `batch` at a time (async scheduling off, so every step is traced): each
    request's verification chunks' drafts in order, and its cached prompt tokens."""
    drafts = {request_id: [] for request_id, *_ in requests}
    cached = {}
    for first in range(0, len(requests), batch):
        for request_id, prompt, boundary in requests[first : first + batch]:
            engine.add_request(GenerationRequest(request_id, prompt, GREEDY, instruction_boundary=boundary))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    cached[out.request_id] = out.num_cached_tokens
            for chunk in engine.last_step.scheduler_output.chunks:
                if chunk.num_draft_tokens:
                    drafts[chunk.request_id].append(chunk.token_ids[1:])
    return drafts, cached


def test_drafts_after_an_instruction_restore_equal_drafts_from_scratch():
    """32 requests over three system prompts: with checkpoints most restore their instruction
    checkpoint (the head's K/V of the instructions comes back with it, and its hidden row),
    and they draft exactly the tokens they draft computed from scratch (checkpoints off):
    the same drafts, so the same acceptances."""
    check_restored_drafts_equal_scratch(EngineConfig(async_scheduling=False, **MTP))


def check_restored_drafts_equal_scratch(config: EngineConfig) -> SpeculationStats:
    """Engines of `config` (speculating, async scheduling off) with checkpoints and without
    run the same 32 chat requests over three system prompts, 4 at a time: at least 24 restore
    a checkpoint, and every request's drafts, and the drafts proposed and accepted, are the
    same in both. Returns the restoring engine's counters."""
    restored, scratch = LLMEngine(config), LLMEngine(replace(config, checkpoint_slots=()))
    requests = _chat_requests(restored.tokenizer, 32)
    got, cached = _drafts_per_request(restored, requests, batch=4)
    want, _ = _drafts_per_request(scratch, requests, batch=4)
    assert sum(1 for tokens in cached.values() if tokens) >= 24, cached
    assert got == want
    a, b = restored.stats().speculation, scratch.stats().speculation
    assert a.draft_tokens_proposed == b.draft_tokens_proposed > 0
    assert (a.draft_tokens_accepted, a.acceptance_lengths) == (b.draft_tokens_accepted, b.acceptance_lengths)
    return a
