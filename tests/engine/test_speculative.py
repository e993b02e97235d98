"""Speculative decoding (issue 25, first landing: CPU path, n-gram drafter; docs/design.md
section 10): greedy outputs with speculation on are those with it off, and a rejected draft
leaves no trace in a state slot, KV block, computed count or checkpoint.

The embedded tiny model is close to random, so the prompts that let drafts be accepted repeat
a span and the model's own continuation of it (P + C + P, C the greedy continuation of P):
after the second P the model mostly says C again, which the n-gram lookup proposes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from deployments.prompts.instruction_boundary import find_instruction_boundary
from deployments.engine_metrics import EngineMetricsExporter
from deployments.metrics import (
    SPECULATIVE_ACCEPTANCE_LENGTHS, SPECULATIVE_DEPTH_ACCEPTED, SPECULATIVE_DEPTH_PROPOSED,
    SPECULATIVE_DRAFTS_ACCEPTED, SPECULATIVE_DRAFTS_PROPOSED, SPECULATIVE_DRAFTS_REJECTED,
    SPECULATIVE_DRAFTS_TRIMMED, SPECULATIVE_VERIFICATION_CHUNKS,
)
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.core.llm_engine import LLMEngine
from engine.interfaces.sampling_params import SamplingParams
from engine.speculative.ngram import NgramDrafter
from engine.speculative.scheduling import greedy_accept
from engine.speculative.verify import check_verifiable
from engine.interfaces.step_io import CommitOp, ScheduledChunk, SchedulerOutput
from engine.execution.worker import Worker
from tests.engine.conversations import random_text, render, system_prompts
from tests.engine.exactness import NEAR_TIE, Outcome, Tally, check_near_ties, run_round, tight_config
from tests.unit.recording_metrics import RecordingMetrics

K = 4
GREEDY = SamplingParams(max_tokens=24, temperature=0)


# ----------------------------------------------------------------- drafter and acceptance rule


def test_ngram_drafter_proposes_what_followed_the_longest_match():
    drafter = NgramDrafter(max_ngram=3, min_ngram=1)
    # "7 8" occurred twice; the latest occurrence (followed by 1 2) wins
    assert drafter.propose([7, 8, 5, 6, 7, 8, 1, 2, 9, 7, 8], 2) == (1, 2)
    # the longer match wins over a later shorter one: "4 5 6" -> 7, though "6" alone -> 0
    assert drafter.propose([4, 5, 6, 7, 3, 6, 0, 4, 5, 6], 1) == (7,)
    # never past the end of the context; the suffix itself is no match
    assert drafter.propose([1, 2, 3, 1, 2], 5) == (3, 1, 2)
    assert drafter.propose([1, 2, 3], 3) == ()
    assert drafter.propose([5, 5], 3) == (5,)
    # a run repeating itself: the latest match leaves one token, an earlier one the full three
    assert drafter.propose([3, 3, 3, 3, 3, 3], 3) == (3, 3, 3)
    assert drafter.propose([9, 1, 2, 1, 2, 1, 2, 1, 2], 4) == (1, 2, 1, 2)  # the latest: (1, 2)
    assert drafter.propose([4, 1, 2, 4, 1, 2, 6, 4, 1, 2], 2) == (6, 4)  # the latest is long enough
    assert drafter.propose([1, 2, 1], 0) == ()
    assert drafter.propose([], 2) == () and drafter.propose([4], 2) == ()
    assert NgramDrafter(max_ngram=2, min_ngram=2).propose([1, 2, 3, 9, 2], 2) == ()
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=1, min_ngram=2)


def test_greedy_acceptance_rule():
    assert greedy_accept([5, 6, 7], [5, 6, 7, 8]) == 3
    assert greedy_accept([5, 6, 7], [5, 9, 7, 8]) == 1
    assert greedy_accept([5, 6, 7], [4, 6, 7, 8]) == 0
    assert greedy_accept([], [4]) == 0


# ----------------------------------------------------------------- configuration


@pytest.mark.parametrize("changes, message", [
    ({"num_speculative_tokens": -1}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": 2.0}, "num_speculative_tokens must be an integer"),
    ({"speculative_drafter": "eagle"}, "speculative_drafter must be one of"),
])
def test_config_refusals(changes, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**changes)


def test_off_by_default_and_the_cuda_path_is_untouched_when_off():
    config = EngineConfig()
    # unset: the policy decides (tests/unit/test_speculation_policy.py), off on the CPU
    assert config.num_speculative_tokens is None and config.speculative_drafter == "ngram"
    EngineConfig(device="cuda")  # speculation off: the CUDA path is configured as before
    EngineConfig(num_speculative_tokens=2, device="cuda")  # one CUDA device verifies (verify_gpu.py)
    EngineConfig(num_speculative_tokens=16)
    EngineConfig(num_speculative_tokens=2, tensor_parallel_size=2)  # test_speculative_tensor_parallel.py


def test_models_whose_recurrent_layers_cannot_verify_are_refused():
    check_verifiable(("mamba", "attention", "mlp"))
    check_verifiable(("hybrid", "mlp"))  # Falcon-H1 (tests/families/test_speculation_families.py)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        check_verifiable(("mamba", "a_kind_without_verification"))


# ----------------------------------------------------------------- engines and workloads


def _engine(k: int, **changes) -> LLMEngine:
    return LLMEngine(EngineConfig(num_speculative_tokens=k, **changes))


@pytest.fixture(scope="module")
def engine_off() -> LLMEngine:
    return _engine(0)


@pytest.fixture(scope="module")
def engine_on() -> LLMEngine:
    return _engine(K)


def _run(engine: LLMEngine, jobs, params: SamplingParams) -> dict[str, list]:
    """Run jobs (id, prompt, salt) to completion: id -> the outputs in order."""
    for request_id, prompt, salt in jobs:
        engine.add_request(GenerationRequest(request_id, prompt, params, cache_salt=salt))
    outputs = {request_id: [] for request_id, *_ in jobs}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def _tokens(outputs) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def _text(outputs) -> str:
    return "".join(out.new_text for out in outputs)


@pytest.fixture(scope="module")
def repeating_prompts(engine_off) -> list[list[int]]:
    """P + C + P for six random spans P, C the spec-off greedy continuation of P."""
    rng = random.Random(25)
    spans = [[rng.randrange(100, 2000) for _ in range(rng.randint(12, 24))] for _ in range(6)]
    continued = _run(engine_off, [(f"span-{i}", p, "spans") for i, p in enumerate(spans)], GREEDY)
    return [p + _tokens(continued[f"span-{i}"]) + p for i, p in enumerate(spans)]


def _compare(got: list[int], want: Outcome, tally: Tally, label: str) -> None:
    """Speculation on (`got`) against off (`want`, with logits): tokens identical; a divergence
    is allowed only at a near-tie of the spec-off logits (counted, the rest not compared)."""
    tally.requests += 1
    for position, (a, b) in enumerate(zip(got, want.token_ids)):
        if a != b:
            top2 = torch.topk(want.logits[position], 2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE, f"{label}: output position {position}: {a} with speculation, {b} without (gap {gap:.2e})"
            tally.near_ties += 1
            print(f"near-tie in {label} at output position {position} (gap {gap:.2e})")
            return
    assert len(got) == len(want.token_ids), f"{label}: lengths differ"


def _chat_jobs(tokenizer, seed: int, num_requests: int):
    """The checkpoint exactness workload's requests (tests/engine/exactness.py), smaller: chat
    prompts with shared system prompts and multi-turn continuations; each also under a fresh
    salt (computed from scratch). Yields rounds of (id, prompt, boundary, salt) jobs; send()
    the round's outcomes back to grow the conversations."""
    rng = random.Random(seed)
    systems = system_prompts(rng, 3)
    conversations: list[list[dict]] = []
    issued = 0
    while issued < num_requests:
        jobs, picked = [], []
        for slot in range(min(8, num_requests - issued)):
            growing = [c for c in conversations if len(c) < 5 and len(render(tokenizer, c)) < 250]
            if growing and rng.random() < 0.4:
                conversation = rng.choice(growing)
                conversation.append({"role": "user", "content": random_text(rng, 3, 20)})
            else:
                conversation = [{"role": "system", "content": rng.choice(systems)},
                                {"role": "user", "content": random_text(rng, 3, 25)}]
                conversations.append(conversation)
            prompt = render(tokenizer, conversation)
            boundary = find_instruction_boundary(tokenizer, conversation, prompt).position
            request_id = f"c{seed}-{issued + slot}"
            jobs.append((request_id, prompt, boundary, ""))
            jobs.append((request_id + "-scratch", prompt, boundary, f"fresh-{request_id}"))
            picked.append((request_id, conversation))
        texts = yield jobs
        for request_id, conversation in picked:
            conversation.append({"role": "assistant", "content": texts[request_id]})
        issued += len(picked)


def compare_chat_rounds(
    off: LLMEngine, on: LLMEngine, seed: int, label: str,
    extra_jobs: Callable[[int], list[tuple]] = lambda round_index: [],
) -> Tally:
    """The rounds of _chat_jobs(seed, 16 requests), each with extra_jobs(round index) added,
    through `off` (with logits) and `on` (greedy, 12 tokens): every output of `on` must equal
    `off`'s (_compare: a divergence only at a near-tie); the conversations grow with `on`'s
    texts. Checks the near-ties (check_near_ties) and returns the tally."""
    with_logits = replace(GREEDY, max_tokens=12, return_logits=True)
    tally = Tally()
    rounds = _chat_jobs(off.tokenizer, seed=seed, num_requests=16)
    jobs = next(rounds)
    round_index = 0
    while True:
        jobs = jobs + extra_jobs(round_index)
        want = run_round(off, jobs, with_logits)
        got = run_round(on, jobs, replace(with_logits, return_logits=False))
        for request_id, *_ in jobs:
            _compare(got[request_id].token_ids, want[request_id], tally, f"{label} {request_id}")
        try:
            jobs = rounds.send({rid: got[rid].text for rid, *_ in jobs})
        except StopIteration:
            break
        round_index += 1
    check_near_ties(tally, label)
    return tally


@pytest.mark.parametrize("label, config", [
    ("tight: eviction + preemption, budget 64", "tight"),
    ("roomy, budget 61, sync", EngineConfig(max_num_batched_tokens=61, async_scheduling=False)),
    # requests move between drafting and plain decoding as the batch crosses 3, verifications
    # in flight among them
    ("tight, drafting at most 3 running", "tight, capped"),
])
def test_greedy_outputs_equal_speculation_off_over_the_exactness_workload(label, config, repeating_prompts):
    if config == "tight":
        config = tight_config()
    elif config == "tight, capped":
        config = replace(tight_config(), speculative_max_batch_size=3)
    check_speculation_equals_off(config, K, repeating_prompts, label)


def check_speculation_equals_off(config: EngineConfig, k: int, repeating_prompts, label: str) -> None:
    """Engines of `config` with speculation off and with k draft tokens run the same rounds
    (chat requests with shared system prompts and multi-turn continuations, each also from
    scratch, and the first three repeating prompts); every speculating output must equal the
    spec-off engine's, and drafts must have been accepted."""
    off, on = LLMEngine(config), LLMEngine(replace(config, num_speculative_tokens=k))
    tally = compare_chat_rounds(
        off, on, seed=len(label), label=label,
        extra_jobs=lambda r: [(f"rep-{r}-{i}", p, None, "") for i, p in enumerate(repeating_prompts[:3])],
    )
    stats = on.stats().speculation
    print(f"\n[{label}] requests={tally.requests} near_ties={tally.near_ties} "
          f"proposed={stats.draft_tokens_proposed} accepted={stats.draft_tokens_accepted} "
          f"acceptance={stats.acceptance_rate:.2f} lengths={stats.acceptance_lengths} "
          f"preemptions={on.stats().scheduler.preemptions}")
    assert stats.draft_tokens_accepted > 0 and stats.verification_chunks > 0
    assert sum(stats.acceptance_lengths) == stats.verification_chunks
    assert off.stats().speculation.draft_tokens_proposed == 0
    assert on.pool_usage().idle and off.pool_usage().idle


# ----------------------------------------------------------------- rollback, at the worker


def _state(worker: Worker, slot: int) -> list[torch.Tensor]:
    caches = worker.caches
    return [t.clone() for layer in sorted(caches.conv_state)
            for t in (caches.conv_state[layer][slot], caches.ssm_state[layer][slot])]


def _kv(worker: Worker, block: int, offsets: slice) -> list[torch.Tensor]:
    caches = worker.caches
    return [cache[layer][block, offsets].clone() for cache in (caches.key_cache, caches.value_cache)
            for layer in sorted(cache)]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Equal up to the rounding of the projections (a verification multiplies k + 1 rows at
    once, a decode step one): 1e-5 of the largest magnitude."""
    return all(float((x - y).abs().max()) <= 1e-5 * max(1.0, float(y.abs().max()))
               for x, y in zip(a, b, strict=True))


def test_a_rejected_draft_leaves_no_trace_in_the_state_slot_or_kept_kv():
    check_rejected_draft_leaves_no_trace(EngineConfig())


def check_rejected_draft_leaves_no_trace(config: EngineConfig) -> None:
    """A verification chunk with a wrong draft leaves the request's slot as it was; the
    commit of the last accepted position gives the state and KV plain decoding gives
    (Workers of `config`, one with 3 draft tokens)."""
    spec, plain = Worker(replace(config, num_speculative_tokens=3)), Worker(config)
    prompt = tuple(random.Random(7).randrange(100, 2000) for _ in range(20))
    blocks = (0, 1, 2)  # block size 16: positions 0..47

    def chunk(tokens, start, drafts=0):
        return ScheduledChunk("r", tuple(tokens), start, blocks, 0, start == 0, True, GREEDY,
                              num_draft_tokens=drafts)

    first = {w: w.execute(SchedulerOutput((chunk(prompt, 0),))).sampled_token_ids["r"] for w in (spec, plain)}
    g0 = first[plain]
    assert first[spec] == g0
    g1 = plain.execute(SchedulerOutput((chunk([g0], 20),))).sampled_token_ids["r"]
    g2 = plain.execute(SchedulerOutput((chunk([g1], 21),))).sampled_token_ids["r"]
    wrong = (g2 + 1) % 2000
    before = _state(spec, 0)
    verified = spec.execute(SchedulerOutput((chunk([g0, g1, wrong, 5], 20, drafts=3),))).verified_token_ids["r"]
    assert verified[:2] == (g1, g2)  # g1 accepted, the wrong draft rejected: kept g0 g1, bonus g2
    assert _close(_state(spec, 0), before) and all(torch.equal(a, b) for a, b in zip(_state(spec, 0), before))
    spec.execute(SchedulerOutput((), commits=(CommitOp("r", 0, 1),)))
    assert _close(_state(spec, 0), _state(plain, 0))
    assert _close(_kv(spec, 1, slice(0, 6)), _kv(plain, 1, slice(0, 6)))  # positions 16..21
    # the next chunk overwrites the rejected draft's KV at position 22 and goes on exactly
    g3 = plain.execute(SchedulerOutput((chunk([g2], 22),))).sampled_token_ids["r"]
    verified = spec.execute(SchedulerOutput((chunk([g2, g3], 22, drafts=1),))).verified_token_ids["r"]
    g4 = plain.execute(SchedulerOutput((chunk([g3], 23),))).sampled_token_ids["r"]
    assert verified == (g3, g4)
    spec.execute(SchedulerOutput((), commits=(CommitOp("r", 0, 1),)))
    assert _close(_state(spec, 0), _state(plain, 0))
    assert _close(_kv(spec, 1, slice(0, 8)), _kv(plain, 1, slice(0, 8)))


# ----------------------------------------------------------------- rollback, in the engine


def test_rejections_leave_no_trace_in_computed_counts_blocks_or_checkpoints(repeating_prompts):
    """Step by step (no async scheduling): after every step a speculating request stands just
    before its last token, holds only the blocks its computed tokens need, and its response
    checkpoint covers exactly the kept tokens; the output is the spec-off one."""
    on, off = _engine(K, async_scheduling=False), _engine(0, async_scheduling=False)
    block_size = on.config.block_size
    prompts = repeating_prompts[3:]
    jobs = [(f"t{i}", p, "trace") for i, p in enumerate(prompts)]
    want = _run(off, jobs, GREEDY)
    for request_id, prompt, salt in jobs:
        on.add_request(GenerationRequest(request_id, prompt, GREEDY, cache_salt=salt))
    got = {request_id: [] for request_id, *_ in jobs}
    while on.has_unfinished_requests():
        for out in on.step():
            got[out.request_id] += out.new_token_ids
        for request in on.scheduler.running:
            if request.num_output_tokens:
                assert request.num_computed_tokens == request.num_tokens - 1
                assert len(request.block_ids) == -(-request.num_computed_tokens // block_size)
    stats = on.stats().speculation
    assert stats.draft_tokens_accepted < stats.draft_tokens_proposed  # some were rejected
    namespace = (on.config.model_dir, "trace")
    for (request_id, prompt, _), outputs in zip(jobs, want.values()):
        assert got[request_id] == _tokens(outputs)
        kept = list(prompt) + got[request_id]
        assert on.longest_checkpoint(namespace, kept + [1, 2, 3]) == len(kept) - 1
    assert on.pool_usage().idle


def _inside_runs(outputs, after: int = 1, required: bool = True) -> list[tuple[int, int]]:
    """(index, start) of each output token that one verification (whose first kept token is
    at `start`) kept with at least `after` more after it: a stop there drops accepted tokens.
    required: fail when there is none."""
    inside, position = [], 0
    for out in outputs:
        inside += [(i, position) for i in range(position, position + len(out.new_token_ids) - after)]
        position += len(out.new_token_ids)
    assert inside or not required, f"no verification kept {after + 1} tokens"
    return inside


LATER_STOPS = (None, "stop_token_ids", "max_tokens")


def _stop_string_index(outputs, later_stop: str | None) -> int | None:
    """The output token test_stop_string_inside_an_accepted_draft_run stops inside: past the
    first token of a verification that kept two more after it (the detokenizer may hold a
    token's text until the next) and, with a later stop token id, one first seen two tokens
    later. None when the outputs hold no such token."""
    tokens = _tokens(outputs)
    return next((i for i, start in _inside_runs(outputs, after=2, required=False)
                 if i > start and (later_stop != "stop_token_ids" or tokens[i + 2] not in tokens[: i + 2])), None)


def _has_every_case(outputs) -> bool:
    """The outputs give the stop-string test its token for every later_stop rule, and the
    token-level stop test its tokens (inside a run, past its start; first seen inside a run)."""
    tokens = _tokens(outputs)
    inside = _inside_runs(outputs, required=False)
    return (all(_stop_string_index(outputs, rule) is not None for rule in LATER_STOPS)
            and any(i > start for i, start in inside) and any(tokens[i] not in tokens[:i] for i, _ in inside))


@pytest.fixture(scope="module")
def free_run(engine_on, repeating_prompts) -> tuple[list[int], list]:
    """A repeating prompt and its outputs with speculation on, no stop rule: the first
    repeating prompt whose outputs hold every case the stop tests stop inside (_has_every_case;
    prompts 0, 3 and 4 of the six do, on the embedded model)."""
    for i, prompt in enumerate(repeating_prompts):
        outputs = _run(engine_on, [(f"free-{i}", prompt, "free")], GREEDY)[f"free-{i}"]
        if _has_every_case(outputs):
            return prompt, outputs
    pytest.fail("no repeating prompt's free run holds every case the stop tests stop inside")


@pytest.mark.parametrize("later_stop", LATER_STOPS)
def test_stop_string_inside_an_accepted_draft_run(later_stop, engine_on, engine_off, free_run):
    """The output ends at the stop string's first character, its tokens end with the one that
    completed it (the rest of the run is dropped), as with speculation off; the response
    checkpoint covers exactly the kept tokens, and a follow-up turn that restores it gives
    what the follow-up computed from scratch gives. later_stop: a token-level rule that also
    ends the request, two tokens later in the same verification; the stop string, judged on
    text after the token rules, still decides what is kept and checkpointed."""
    prompt, outputs = free_run
    tokens, text = _tokens(outputs), _text(outputs)
    # inside a run with two more after it: the detokenizer may hold a token's text until the
    # next; with a stop token id, one first seen two tokens later
    index = _stop_string_index(outputs, later_stop)
    assert index is not None, "free_run must hold a token to stop inside (_has_every_case)"
    tokenizer = engine_on.tokenizer
    # a stop string that ends inside token `index`'s text and occurs nowhere before it
    before = tokenizer.decode(tokens[:index])
    through = tokenizer.decode(tokens[: index + 1])
    assert through.startswith(before) and len(through) > len(before), "pick a token with text"
    stop = through[max(0, len(before) - 3) : len(before) + 1]
    assert text.find(stop) == len(through[: len(before) + 1]) - len(stop)
    params = replace(GREEDY, stop=(stop,))
    if later_stop == "stop_token_ids":
        params = replace(params, stop_token_ids=(tokens[index + 2],))
    elif later_stop == "max_tokens":
        params = replace(params, max_tokens=index + 3)
    salt = f"stop-string-{later_stop}"
    trimmed = engine_on.stats().speculation.draft_tokens_trimmed
    got = _run(engine_on, [("stop", prompt, salt)], params)["stop"]
    want = _run(engine_off, [("stop", prompt, salt)], params)["stop"]
    assert _text(got) == _text(want) == text[: text.find(stop)]
    num_kept = len(_tokens(want))  # the token that completed the stop string's text, and those before
    assert index < num_kept <= index + 2
    assert _tokens(got) == _tokens(want) == tokens[:num_kept]
    assert got[-1].finish_reason == "stop" and got[-1].num_output_tokens == num_kept
    assert engine_on.stats().speculation.draft_tokens_trimmed > trimmed  # accepted, then dropped
    # the response checkpoint: prompt + kept tokens but the last (never fed), nothing dropped
    kept = list(prompt) + tokens[:num_kept]
    namespace = (engine_on.config.model_dir, salt)
    assert engine_on.longest_checkpoint(namespace, list(prompt) + tokens) == len(kept) - 1
    # follow-up turn: restores it and matches a from-scratch run, and the spec-off engine
    follow_up = kept + [321, 654, 987, 123]
    jobs = [("turn2", follow_up, salt), ("turn2-scratch", follow_up, f"stop-scratch-{later_stop}")]
    second = _run(engine_on, jobs, GREEDY)
    assert second["turn2"][-1].num_cached_tokens == len(kept) - 1
    assert second["turn2-scratch"][-1].num_cached_tokens == 0
    reference = _tokens(_run(engine_off, [("turn2", follow_up, f"off-scratch-{later_stop}")], GREEDY)["turn2"])
    assert _tokens(second["turn2"]) == _tokens(second["turn2-scratch"]) == reference


@pytest.mark.parametrize("rule", ["eos", "stop_token_ids", "max_tokens"])
def test_eos_stop_token_and_max_tokens_inside_a_draft_run(rule, engine_off, free_run):
    """A token-level stop falling on a token of an accepted run ends the output there; what
    the verification kept after it is dropped, and the response checkpoint covers exactly
    the kept tokens."""
    prompt, outputs = free_run
    tokens = _tokens(outputs)
    inside = _inside_runs(outputs)
    if rule == "max_tokens":
        # a verification drafts only up to max_tokens: this run's is cut short at the limit
        index = next(i for i, start in inside if i > start)
        params = replace(GREEDY, max_tokens=index + 1)
    else:
        # a token first seen there, at a position with accepted tokens after it
        index = next(i for i, _ in inside if tokens[i] not in tokens[:i])
        params = replace(GREEDY, stop_token_ids=(tokens[index],)) if rule == "stop_token_ids" else GREEDY
    engine = _engine(K)
    if rule == "eos":
        engine.eos_token_ids = (tokens[index],)  # add_request gives requests the engine's EOS ids
    got = _run(engine, [("r", prompt, "")], params)["r"]
    assert _tokens(got) == tokens[: index + 1]
    assert got[-1].finish_reason == ("length" if rule == "max_tokens" else "stop")
    kept = list(prompt) + tokens[: index + 1]
    assert engine.longest_checkpoint((engine.config.model_dir, ""), list(prompt) + tokens) == len(kept) - 1
    stats = engine.stats().speculation
    assert stats.draft_tokens_accepted > 0
    if rule != "max_tokens":
        # tokens past the stop were accepted and dropped; without speculation the same end
        assert stats.draft_tokens_trimmed > 0
        off = _run(engine_off, [(f"off-{rule}", prompt, f"off-{rule}")],
                   params if rule != "eos" else replace(params, stop_token_ids=(tokens[index],)))
        assert _tokens(off[f"off-{rule}"]) == tokens[: index + 1]
    assert engine.pool_usage().idle


def test_sampled_requests_and_logits_requests_do_not_speculate(engine_on, repeating_prompts):
    prompt = repeating_prompts[1]
    before = engine_on.stats().speculation.verification_chunks
    _run(engine_on, [("sampled", prompt, "s")], replace(GREEDY, temperature=0.8, seed=3))
    _run(engine_on, [("logits", prompt, "l")], replace(GREEDY, return_logits=True))
    assert engine_on.stats().speculation.verification_chunks == before


# ----------------------------------------------------------------- metrics


def test_the_exported_metrics_equal_the_engine_counters(repeating_prompts):
    """EngineMetricsExporter (deployments/metrics.py, as an LLM server replica runs it) after
    every step of a speculating engine: its per-drafter series add up to EngineStats.speculation."""
    engine, recorded = _engine(K), RecordingMetrics()
    exporter = EngineMetricsExporter(engine, create=recorded)
    for i, prompt in enumerate(repeating_prompts[:3]):
        engine.add_request(GenerationRequest(f"m{i}", prompt, GREEDY, cache_salt="metrics"))
    while engine.has_unfinished_requests():
        engine.step()
        exporter.export()
    stats = engine.stats().speculation
    assert 0 < stats.draft_tokens_accepted < stats.draft_tokens_proposed
    drafter = (("drafter", "ngram"),)
    for spec, total in ((SPECULATIVE_VERIFICATION_CHUNKS, stats.verification_chunks),
                        (SPECULATIVE_DRAFTS_PROPOSED, stats.draft_tokens_proposed),
                        (SPECULATIVE_DRAFTS_ACCEPTED, stats.draft_tokens_accepted),
                        (SPECULATIVE_DRAFTS_TRIMMED, stats.draft_tokens_trimmed)):
        assert recorded.series(spec) == ({drafter: total} if total else {}), spec.name
    assert recorded.series(SPECULATIVE_ACCEPTANCE_LENGTHS) == {
        (("accepted", str(a)),) + drafter: n for a, n in enumerate(stats.acceptance_lengths) if n}
    assert len(stats.acceptance_lengths) == K + 1
    assert recorded.series(SPECULATIVE_DRAFTS_REJECTED) == {drafter: stats.draft_tokens_rejected}
    # depth d is accepted in every chunk that accepted at least d drafts
    assert stats.depth_accepted == [sum(stats.acceptance_lengths[d:]) for d in range(1, K + 1)]
    assert sum(stats.depth_proposed) == stats.draft_tokens_proposed and stats.depth_proposed[0] == stats.verification_chunks
    for spec, counts in ((SPECULATIVE_DEPTH_PROPOSED, stats.depth_proposed), (SPECULATIVE_DEPTH_ACCEPTED, stats.depth_accepted)):
        assert recorded.series(spec) == {
            (("depth", str(d)),) + drafter: n for d, n in enumerate(counts, start=1) if n}, spec.name
