"""Our GraniteMoeHybrid forward against transformers' (same weights, fp32, CPU): one chunk,
odd chunks, mixed batches, greedy generation and state-slot copies all give the reference
logits within 1e-4 relative error (max|a-b| / max|b|)."""

from __future__ import annotations

import pytest
import torch

from numerics_support import CLAMPED_DT_CONFIG, Case, PagedRunner, Request, build_random_case, rel_err

TOLERANCE = 1e-4
PROMPT_LEN = 45  # several KV blocks of 16 and several SSD chunks of 16, with a partial tail


def test_one_chunk_prompt_matches_reference(case: Case):
    prompt = case.prompt(PROMPT_LEN, seed=1)
    logits = PagedRunner(case.model).run_in_chunks(Request(state_slot=0), prompt, [])
    assert rel_err(logits, case.reference_logits(prompt)) < TOLERANCE


def test_clamped_time_step_matches_reference(tmp_path):
    case = build_random_case("clamped_dt", CLAMPED_DT_CONFIG, tmp_path)
    assert case.config.time_step_limit == (0.05, 0.6)
    prompt = case.prompt(PROMPT_LEN, seed=1)
    logits = PagedRunner(case.model).run_in_chunks(Request(state_slot=0), prompt, [])
    assert rel_err(logits, case.reference_logits(prompt)) < TOLERANCE


def test_odd_chunks_match_one_chunk(case: Case):
    prompt = case.prompt(PROMPT_LEN, seed=2)
    whole = PagedRunner(case.model).run_in_chunks(Request(state_slot=0), prompt, [])
    pieces = PagedRunner(case.model, seed=1).run_in_chunks(Request(state_slot=2), prompt, [7, 13, 1])
    assert pieces.shape == whole.shape
    assert rel_err(pieces, whole) < TOLERANCE
    assert rel_err(pieces, case.reference_logits(prompt)) < TOLERANCE


def test_mixed_batch_matches_each_request_alone(case: Case):
    a, b, c = case.prompt(34, seed=3), case.prompt(23, seed=4), case.prompt(20, seed=5)
    runner = PagedRunner(case.model, num_slots=4)
    req_a, req_b, req_c = Request(state_slot=0), Request(state_slot=1), Request(state_slot=2)
    # Dirty C's slot with another request first: C must start from zeros anyway.
    runner.step([(Request(state_slot=2), case.prompt(9, seed=6))])
    got_a = runner.step([(req_a, a[:12])])
    got_b = runner.step([(req_b, b[:21])])
    # A mid-prefill, B decoding, C starting: one ForwardBatch.
    mixed = runner.step([(req_a, a[12:30]), (req_b, b[21:22]), (req_c, c[:9])])
    got_a, got_b, got_c = got_a + mixed[:1], got_b + mixed[1:2], mixed[2:]
    # A and B decoding, C finishing its prompt.
    last = runner.step([(req_b, b[22:23]), (req_c, c[9:]), (req_a, a[30:31])])
    got_a, got_b, got_c = got_a + last[2:], got_b + last[:1], got_c + last[1:2]

    for tokens, got in ((a[:31], got_a), (b, got_b), (c, got_c)):
        logits = torch.cat(got)
        assert logits.shape[0] == len(tokens)
        assert rel_err(logits, case.reference_logits(tokens)) < TOLERANCE


def test_greedy_generation_matches_generate(case: Case):
    prompt = case.prompt(19, seed=7)
    num_new = 32
    with torch.no_grad():
        reference = case.reference.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=num_new,
            min_new_tokens=0,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    reference_tokens = reference.sequences[0, len(prompt) :].tolist()
    reference_logits = [step[0].float() for step in reference.logits]

    runner = PagedRunner(case.model)
    request = Request(state_slot=1)
    step_logits = runner.step([(request, prompt)])[0][-1]
    for i, expected_token in enumerate(reference_tokens):
        assert rel_err(step_logits, reference_logits[i]) < TOLERANCE, f"logits differ at step {i}"
        token = int(step_logits.argmax())
        if token != expected_token:
            top2 = reference_logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TOLERANCE, f"step {i}: got {token}, reference {expected_token} (gap {gap})"
            print(f"{case.name}: tie at step {i} (reference top-2 gap {gap:.2e}); stop comparing")
            return
        step_logits = runner.step([(request, [token])])[0][-1]
    assert len(reference_tokens) == num_new


@pytest.mark.parametrize("stop", [21, 32])
def test_continue_from_copied_state_slot(case: Case, stop: int):
    prompt = case.prompt(PROMPT_LEN, seed=8)
    runner = PagedRunner(case.model, num_slots=4)
    first = Request(state_slot=1)
    head = runner.step([(first, prompt[:stop])])[0]
    saved = runner.caches.read_state_slot(1)
    runner.caches.copy_state_slot(1, 3)
    for conv, ssm in runner.caches.read_state_slot(3).values():  # the copy is exact
        assert any(torch.equal(conv, c) and torch.equal(ssm, s) for c, s in saved.values())
    # Scribble over the source slot: the continuation must read only the copy.
    for layer in runner.caches.conv_state:
        runner.caches.conv_state[layer][1].normal_()
        runner.caches.ssm_state[layer][1].normal_()
    resumed = Request(state_slot=3, block_table=first.block_table, num_computed=stop)
    tail = runner.step([(resumed, prompt[stop:])])[0]
    assert rel_err(torch.cat([head, tail]), case.reference_logits(prompt)) < TOLERANCE


def test_decode_rows_on_scattered_and_permuted_slots(case: Case):
    """Decode steps batch their one-token chunks (engine/interfaces/decode_rows.py): rows whose
    state slots are not one run are gathered and scattered back; rows whose slots are one run
    in another order than the chunks advance the slots in place, in slot order. Each request's
    logits must still be the reference's, also for a one-token prompt started in a slot that
    holds NaN (a reset row)."""
    prompts = [case.prompt(n, seed=10 + n) for n in (19, 6, 11)]
    single = case.prompt(1, seed=9)
    runner = PagedRunner(case.model, num_slots=5)
    requests = [Request(state_slot=slot) for slot in (4, 0, 2)]
    got = [runner.step([(request, prompt[:-2])]) for request, prompt in zip(requests, prompts)]
    # slots 4, 0, 2: not one run, gathered and scattered back
    step = runner.step([(request, prompt[-2:-1]) for request, prompt in zip(requests, prompts)])
    got = [g + [s] for g, s in zip(got, step)]
    for layer in runner.caches.ssm_state:  # slot 1 held garbage: a reset row must not read it
        runner.caches.conv_state[layer][1].fill_(float("nan"))
        runner.caches.ssm_state[layer][1].fill_(float("nan"))
    fresh = Request(state_slot=1)
    # slots 2, 1, 0 (the request in slot 4 sits out): one run, in reverse chunk order
    step = runner.step([(requests[2], prompts[2][-1:]), (fresh, single), (requests[1], prompts[1][-1:])])
    got[2].append(step[0])
    got[1].append(step[2])
    for prompt, logits in zip(prompts[1:], got[1:]):
        assert rel_err(torch.cat(logits), case.reference_logits(prompt)) < TOLERANCE
    assert rel_err(torch.cat(got[0]), case.reference_logits(prompts[0][:-1])) < TOLERANCE
    assert torch.isfinite(step[1]).all()
    assert rel_err(step[1], case.reference_logits(single)) < TOLERANCE
