"""Speculative decoding with tensor parallelism (tensor_parallel_size 2: one spawned process
per rank, gloo on CPU): every rank verifies its shard of each verification chunk (its heads'
scratch slots, its KV heads), the vocab-parallel LM head gives every rank the same argmax, and
the commit copies each rank's own scratch slot.

For each drafter (n-gram; MTP with a seeded random head), the same requests (repeating
prompts, on which the n-gram drafts are accepted, and chat prompts sharing a system prompt,
the later ones restoring the first one's instruction checkpoint) through four engines: tp 2 with speculation (the
engine under test), tp 2 without (with logits), tp 1 with and tp 1 without (the engines
without speculation shared by both drafters: a speculating engine's model is theirs). Greedy outputs
with speculation at tp 2 equal those without at tp 2 and those with at tp 1 (a divergence
only at a near-tie of the spec-off logits, counted: tests/engine/exactness.py), and the tp 2
n-gram engine drafts exactly what the tp 1 one drafts (the same drafts proposed and accepted
at every depth; a random MTP head is drawn per shard, so at tp 2 it is another head).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest

from deployments.prompts.instruction_boundary import find_instruction_boundary
from engine.core.llm_engine import LLMEngine
from engine.engine_config import EngineConfig
from tests.engine.conversations import random_text, render
from tests.engine.exactness import Tally, check_near_ties, run_round
from tests.engine.test_speculative import GREEDY, _compare

K = 3
WITH_LOGITS = replace(GREEDY, max_tokens=16, return_logits=True)
DRAFTERS = {"ngram": {}, "mtp": {"speculative_drafter": "mtp", "random_mtp_head_seed": 5}}


def _rounds(tokenizer, plain: LLMEngine) -> list[list[tuple]]:
    """Two rounds of jobs (id, prompt, instruction boundary, salt): three repeating prompts
    (P + C + P, C plain decoding's continuation of P) and a chat prompt; then two chat prompts
    with the first one's system prompt, which restore its instruction checkpoint."""
    rng = random.Random(45)
    spans = [[rng.randrange(100, 2000) for _ in range(rng.randint(10, 16))] for _ in range(3)]
    continued = run_round(plain, [(f"span-{i}", p, None, "spans") for i, p in enumerate(spans)],
                          replace(WITH_LOGITS, return_logits=False))
    rounds = [[(f"rep-{i}", p + continued[f"span-{i}"].token_ids + p, None, "") for i, p in enumerate(spans)], []]
    system = random_text(rng, 30, 40)
    for i in range(3):
        conversation = [{"role": "system", "content": system}, {"role": "user", "content": random_text(rng, 4, 12)}]
        prompt = render(tokenizer, conversation)
        boundary = find_instruction_boundary(tokenizer, conversation, prompt).position
        assert boundary is not None
        rounds[min(i, 1)].append((f"chat-{i}", prompt, boundary, ""))
    return rounds


def _run(engine: LLMEngine, rounds, params) -> dict:
    return {request_id: outcome for jobs in rounds for request_id, outcome in run_round(engine, jobs, params).items()}


@dataclass
class Plain:
    """The rounds and what plain decoding (speculation off) gives for them at tp 1 and tp 2."""

    rounds: list[list[tuple]]
    tp1: dict
    tp2: dict


@pytest.fixture(scope="module")
def plain() -> Plain:
    tp1 = LLMEngine(EngineConfig())
    rounds = _rounds(tp1.tokenizer, tp1)
    tp2 = LLMEngine(EngineConfig(tensor_parallel_size=2))
    try:
        return Plain(rounds, _run(tp1, rounds, WITH_LOGITS), _run(tp2, rounds, WITH_LOGITS))
    finally:
        tp2.shutdown()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_speculation_at_tp2_equals_tp2_plain_and_tp1_speculating(drafter, plain):
    changes = dict(num_speculative_tokens=K, **DRAFTERS[drafter])
    tp1_on = LLMEngine(EngineConfig(**changes))
    tp2_on = LLMEngine(EngineConfig(tensor_parallel_size=2, **changes))
    try:
        params = replace(WITH_LOGITS, return_logits=False)
        speculating = {"tp2": _run(tp2_on, plain.rounds, params), "tp1": _run(tp1_on, plain.rounds, params)}
        stats = tp2_on.stats()
    finally:
        tp2_on.shutdown()
    tally = Tally()
    for request_id in (request_id for jobs in plain.rounds for request_id, *_ in jobs):
        _compare(speculating["tp2"][request_id].token_ids, plain.tp2[request_id], tally, f"tp2 {request_id}")
        _compare(speculating["tp1"][request_id].token_ids, plain.tp1[request_id], tally, f"tp1 {request_id}")
        _compare(speculating["tp2"][request_id].token_ids, plain.tp1[request_id], tally, f"tp2 vs tp1 {request_id}")
    check_near_ties(tally, f"speculation at tp 2, {drafter}")
    tp2, tp1 = stats.speculation, tp1_on.stats().speculation
    print(f"\n[{drafter}] near_ties={tally.near_ties} proposed={tp2.draft_tokens_proposed} "
          f"accepted={tp2.draft_tokens_accepted} by depth={tp2.depth_accepted}/{tp2.depth_proposed}")
    assert tp2.verification_chunks > 0
    if drafter == "ngram":
        assert tp2.draft_tokens_accepted > 0, "the repeating prompts' drafts must be accepted"
    if drafter == "ngram" and not tally.near_ties:  # a random MTP head is drawn per shard: another head
        assert (tp2.depth_proposed, tp2.depth_accepted) == (tp1.depth_proposed, tp1.depth_accepted)
    assert stats.checkpoints["instruction"].hit >= 2, "the later chats restore"
