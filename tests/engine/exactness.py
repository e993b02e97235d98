"""The exactness suite's workload and checks, shared by the in-process run
(test_checkpoint_exactness.py) and the tensor-parallel run (test_tensor_parallel_engine.py).

Requests are rendered by the one renderer (PromptRenderer) with random cache_control markers (0
to 3 a request, on random messages and text parts; some user messages are sent as two text
parts), so their verified cache breakpoints are captured and restored alongside the
instruction, prompt and response checkpoints.

Every request runs twice in the same engine and the same batch: once in the shared namespace
(where it can restore checkpoints) and once under a fresh cache_salt (where nothing can be
reused). Greedy tokens must be identical and logits equal within LOGITS_RTOL relative; the only
divergence allowed is at a near-tie of the from-scratch run (top-2 logits within NEAR_TIE),
which is counted and printed, and the rest of that response is not compared. Near-ties are
allowed in at most MAX_NEAR_TIE_FRACTION of the requests compared (check_near_ties); any
other difference fails at once.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass

import torch

from deployments.prompts.rendering import PromptRenderer
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.core.llm_engine import LLMEngine
from engine.execution.loader import load_model
from engine.interfaces.sampling_params import SamplingParams
from engine.parallel.tensor_parallel import TensorParallel
from tests.engine.conversations import random_text, render, system_prompts

NEAR_TIE = 1e-4  # top-2 gap of the from-scratch logits below which a different token is a near-tie
MAX_NEAR_TIE_FRACTION = 0.02  # of the requests compared; more near-ties fail the suite
LOGITS_RTOL = 1e-4  # max |shared - scratch| / max |scratch| of one position's logits


@dataclass
class Outcome:
    token_ids: list[int]
    logits: list[torch.Tensor]
    text: str
    cached_tokens: int


@dataclass
class Tally:
    requests: int = 0  # compared (counted by compare)
    hits: int = 0
    cached_tokens: int = 0
    near_ties: int = 0


# A round in which no request finishes for this many steps is stuck (requests preempting each
# other in a cycle): fail it instead of running into the suite's timeout.
MAX_STEPS_WITHOUT_A_FINISH = 3_000


def run_round(engine: LLMEngine, jobs: list[tuple], params: SamplingParams):
    """Submit every job at once (id, prompt, boundary, salt[, cache breakpoints]) and run them
    to completion; AssertionError when no request finishes for MAX_STEPS_WITHOUT_A_FINISH
    steps."""
    for request_id, prompt, boundary, salt, *breakpoints in jobs:
        engine.add_request(GenerationRequest(request_id, prompt, params, cache_salt=salt,
                                             instruction_boundary=boundary,
                                             cache_breakpoints=breakpoints[0] if breakpoints else ()))
    outcomes = {request_id: Outcome([], [], "", 0) for request_id, *_ in jobs}
    steps_since_a_finish = 0
    while engine.has_unfinished_requests():
        steps_since_a_finish += 1
        assert steps_since_a_finish <= MAX_STEPS_WITHOUT_A_FINISH, (
            f"no request finished in {MAX_STEPS_WITHOUT_A_FINISH} steps: "
            f"{engine.scheduler.stats.preemptions} preemptions so far")
        for out in engine.step():
            steps_since_a_finish = 0 if out.finished else steps_since_a_finish
            outcome = outcomes[out.request_id]
            outcome.token_ids += out.new_token_ids
            outcome.text += out.new_text
            if out.logits is not None:
                outcome.logits.append(out.logits)
            outcome.cached_tokens = out.num_cached_tokens
    return outcomes


def compare(shared: Outcome, scratch: Outcome, tally: Tally, label: str) -> None:
    """Check one request served from a checkpoint (`shared`) against the same request computed
    from scratch, and count it in tally.requests.

    Greedy tokens must be identical and each position's logits within LOGITS_RTOL relative. A
    token that differs where the from-scratch top-2 logits are within NEAR_TIE is a near-tie:
    counted in tally.near_ties and printed, and the rest of the response is not compared. Any
    other difference raises AssertionError at once, naming `label` and the output position (a
    token mismatch also gives the from-scratch top-2 logits).
    """
    tally.requests += 1
    for position, (got, want) in enumerate(zip(shared.token_ids, scratch.token_ids)):
        reference = scratch.logits[position]
        if got != want:
            top2 = torch.topk(reference, 2)
            gap = float(top2.values[0] - top2.values[1])
            top2_text = ", ".join(f"token {int(i)}: {float(v):.6g}" for v, i in zip(top2.values, top2.indices))
            assert gap < NEAR_TIE, (
                f"{label}: output position {position} is token {got} from the checkpoint, {want} from "
                f"scratch, not at a near-tie (from-scratch top-2 logits {top2_text}; gap {gap:.2e} >= "
                f"NEAR_TIE {NEAR_TIE:g})")
            tally.near_ties += 1
            print(f"near-tie in {label} at output position {position} (from-scratch top-2 logits "
                  f"{top2_text}): rest not compared")
            return
        error = (shared.logits[position] - reference).abs().max() / reference.abs().max()
        assert error <= LOGITS_RTOL, f"{label}: logits at output position {position} differ by {error:.2e} relative"
    assert len(shared.token_ids) == len(scratch.token_ids), f"{label}: lengths differ"


def check_near_ties(tally: Tally, label: str) -> None:
    """Fail when more than MAX_NEAR_TIE_FRACTION of the requests compared ended at a near-tie."""
    allowed = math.floor(MAX_NEAR_TIE_FRACTION * tally.requests)
    assert tally.near_ties <= allowed, (
        f"{label}: {tally.near_ties} near-ties in {tally.requests} requests compared; at most "
        f"{allowed} ({MAX_NEAR_TIE_FRACTION:.0%}) allowed")


def run_workload(engine: LLMEngine, seed: int, num_requests: int, tally: Tally) -> dict[str, Outcome]:
    """Run num_requests randomized chat requests (each also from scratch) in rounds of 8 and
    check each against its from-scratch twin (compare), then the near-ties of this workload
    against their bound (check_near_ties). Returns the shared-namespace outcomes by id."""
    rng = random.Random(seed)
    marker_rng = random.Random(f"{seed}/markers")
    renderer = PromptRenderer(engine.tokenizer)
    results: dict[str, Outcome] = {}
    systems = system_prompts(rng, 4)
    conversations: list[list[dict]] = []
    params = SamplingParams(max_tokens=rng.randint(4, 8), temperature=0, return_logits=True)
    issued = 0
    round_index = 0
    while issued < num_requests:
        jobs, picked = [], []
        for slot in range(min(8, num_requests - issued)):
            growing = [c for c in conversations if len(c) < 7 and len(render(engine.tokenizer, c)) < 300]
            if growing and rng.random() < 0.4:
                conversation = rng.choice(growing)
                conversation.append({"role": "user", "content": user_content(rng, marker_rng, 3, 25)})
            else:
                conversation = []
                if rng.random() < 0.85:
                    conversation.append({"role": "system", "content": rng.choice(systems)})
                    if rng.random() < 0.2:
                        conversation.append({"role": "developer", "content": random_text(rng, 5, 20)})
                conversation.append({"role": "user", "content": user_content(rng, marker_rng, 3, 30)})
                conversations.append(conversation)
            rendered = renderer.render_chat(with_random_markers(marker_rng, conversation))
            prompt, boundary, breakpoints = rendered.token_ids, rendered.instruction_boundary, rendered.cache_breakpoints
            assert list(prompt) == render(engine.tokenizer, conversation)  # markers change no token
            request_id = f"s{seed}-r{round_index}-{slot}"
            jobs.append((request_id, prompt, boundary, "", breakpoints))
            jobs.append((request_id + "-scratch", prompt, boundary, f"fresh-{request_id}", breakpoints))
            picked.append((request_id, conversation))
        outcomes = run_round(engine, jobs, params)
        for request_id, conversation in picked:
            shared, scratch = outcomes[request_id], outcomes[request_id + "-scratch"]
            assert scratch.cached_tokens == 0
            compare(shared, scratch, tally, request_id)
            tally.hits += shared.cached_tokens > 0
            tally.cached_tokens += shared.cached_tokens
            conversation.append({"role": "assistant", "content": shared.text})
            results[request_id] = shared
        issued += len(picked)
        round_index += 1
    check_near_ties(tally, f"workload seed {seed}")
    return results


def user_content(rng: random.Random, marker_rng: random.Random, min_words: int, max_words: int) -> str | list[dict]:
    """A user message's content: random text, sent as two text parts in a third of the
    messages (marker_rng decides, and where the text is cut)."""
    text = random_text(rng, min_words, max_words)
    words = text.split(" ")
    if len(words) < 2 or marker_rng.random() >= 1 / 3:
        return text
    cut = marker_rng.randrange(1, len(words))
    return [{"type": "text", "text": " ".join(words[:cut])}, {"type": "text", "text": " ".join(words[cut:])}]


def with_random_markers(marker_rng: random.Random, conversation: list[dict]) -> list[dict]:
    """A copy of `conversation` with 0 to 3 cache_control markers, each on a random message or
    text part (the conversation itself keeps none: a later turn resends it unmarked)."""
    marked = copy.deepcopy(conversation)
    places = [(m, None) for m in range(len(marked))]
    places += [(m, p) for m, message in enumerate(marked) if isinstance(message["content"], list)
               for p in range(len(message["content"]))]
    for m, p in marker_rng.sample(places, min(len(places), marker_rng.randint(0, 3))):
        (marked[m] if p is None else marked[m]["content"][p])["cache_control"] = {"type": "ephemeral"}
    return marked


def tight_config(tensor_parallel_size: int = 1) -> EngineConfig:
    """Budgets small enough that checkpoints are evicted under KV pressure and requests are
    preempted: 24 KV blocks and 24 bundle states per rank (the budgets are per rank, and a
    rank's shard of a block or a state is smaller at tensor_parallel_size > 1). Async
    scheduling on, as on cuda (one CPU rank runs without it by default): a finished request
    then holds its blocks one step longer, which is what makes the budget tight."""
    base = EngineConfig(tensor_parallel_size=tensor_parallel_size)
    model, _ = load_model(base.model_dir, dtype=getattr(torch, base.dtype), device=torch.device(base.device),
                          tp=TensorParallel(rank=0, world_size=tensor_parallel_size))
    return EngineConfig(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=384,
        kv_cache_bytes=24 * model.kv_bytes_per_block(base.block_size),
        checkpoint_cache_bytes=24 * model.state_bytes_per_slot(),
        tensor_parallel_size=tensor_parallel_size,
        async_scheduling=True,
    )
