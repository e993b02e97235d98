"""Single-request runs and the reuse cases of test_checkpoint_reuse.py, shared with the
tensor-parallel tests (which run the same cases at tp=2 and tp=4 and compare with tp=1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deployments.prompts.instruction_boundary import find_instruction_boundary
from engine.interfaces.generation_request import GenerationRequest
from engine.core.llm_engine import LLMEngine
from engine.interfaces.sampling_params import SamplingParams
from tests.engine.conversations import render
from tests.engine.exactness import LOGITS_RTOL

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_logits=True)
SYSTEM = "You answer in riddles about rivers, mountains and the number seven. " * 3


@dataclass
class Alone:
    """One request run alone to completion."""

    tokens: list[int]
    text: str
    cached: int  # RequestOutput.num_cached_tokens
    chunk_sizes: list[int]  # tokens computed in each step it ran (0: sampled from a restored row)
    prompt: list[int]
    boundary: int | None  # the renderer's instruction boundary
    logits: list[torch.Tensor]


def assert_same_as_reference(got: Alone, want: Alone, label: str) -> None:
    """`got` (an engine at tp > 1) against `want` (the same run at tp=1): same cached tokens,
    same greedy tokens, logits within LOGITS_RTOL."""
    assert got.cached == want.cached, f"{label}: cached_tokens {got.cached} at tp, {want.cached} at tp=1"
    assert got.tokens == want.tokens, f"{label}: tokens differ from tp=1"
    for position, (row, reference_row) in enumerate(zip(got.logits, want.logits, strict=True)):
        error = (row - reference_row).abs().max() / reference_row.abs().max()
        assert error <= LOGITS_RTOL, f"{label}: logits at {position} differ from tp=1 by {error:.2e}"


def chat(system: str | None, user: str) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}]


def run(engine: LLMEngine, request_id: str, conversation, salt="", params=GREEDY) -> Alone:
    """Run one request alone (the engine must be idle) and collect what it produced."""
    prompt = render(engine.tokenizer, conversation)
    boundary = find_instruction_boundary(engine.tokenizer, conversation, prompt).position
    engine.add_request(GenerationRequest(request_id, prompt, params, cache_salt=salt,
                                         instruction_boundary=boundary))
    result = Alone([], "", 0, [], prompt, boundary, [])
    while engine.has_unfinished_requests():
        for out in engine.step():
            result.tokens += out.new_token_ids
            result.text += out.new_text
            result.cached = out.num_cached_tokens
            if out.logits is not None:
                result.logits.append(out.logits)
        if engine.last_step is not None:  # the step this call collected
            result.chunk_sizes += [len(c.token_ids) for c in engine.last_step.scheduler_output.chunks
                                   if c.request_id == request_id]
    return result


def instruction_reuse(
    engine: LLMEngine, salt: str, prefix: str = "i", params: SamplingParams = GREEDY
) -> tuple[Alone, Alone, Alone]:
    """Two requests with the same system prompt and different user messages in namespace
    `salt`, then the second one again under a salt of its own (computed from scratch)."""
    first = run(engine, f"{prefix}1", chat(SYSTEM, "Tell me about the river."), salt, params)
    second = run(engine, f"{prefix}2", chat(SYSTEM, "And the mountain, briefly please?"), salt, params)
    scratch = run(engine, f"{prefix}3", chat(SYSTEM, "And the mountain, briefly please?"), salt + "-scratch", params)
    return first, second, scratch


def multi_turn(
    engine: LLMEngine, salt: str, prefix: str = "m", params: SamplingParams = GREEDY
) -> tuple[Alone, Alone, Alone]:
    """A conversation's first turn, its second turn (resending the history) in namespace
    `salt`, then the second turn again under a salt of its own."""
    turn1 = chat(SYSTEM, "Name a city.")
    first = run(engine, f"{prefix}1", turn1, salt, params)
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Why?"}]
    second = run(engine, f"{prefix}2", turn2, salt, params)
    scratch = run(engine, f"{prefix}3", turn2, salt + "-scratch", params)
    return first, second, scratch
