"""The engine's own greedy output against transformers' generate() (greedy, same weights, fp32,
CPU), end to end: prompts go through LLMEngine (scheduler, the real worker, sampler, output
processor), all in one batch under a fresh cache_salt so every token is computed from scratch.

For each prompt the engine's greedy tokens must equal generate()'s, and the logits of each step
(generate()'s raw `output_logits`, before any processor) must be within TOLERANCE relative
(max|a-b| / max|b|), the first step's always. A differing token is allowed only where the
reference's top-2 logits are within NEAR_TIE (DESIGN.md's invariant): it is counted, printed,
and the rest of that response is not compared. A reference that answers every prompt with one
repeated token would make the comparison vacuous: at least MIN_DISTINCT_TOKENS distinct tokens
across the prompts' reference outputs are required.
"""

from __future__ import annotations

import itertools

import torch

from engine.core.llm_engine import LLMEngine
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.sampling_params import SamplingParams

TOLERANCE = 1e-4  # max|a - b| / max|b| of one step's logits
NEAR_TIE = 1e-4  # reference top-2 logit gap below which a different token is a near-tie
MIN_DISTINCT_TOKENS = 3  # across the prompts' reference outputs
PROMPT_LENGTHS = (5, 19, 45)  # 45: longer than a 40-token step budget, so its prefill is chunked

_salts = itertools.count()


def random_prompts(vocab_size: int, seed: int = 0, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    """Seeded random token ids (ids 0..2, often special, left out)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def reference_generate(reference: torch.nn.Module, prompt: list[int], num_new: int
                       ) -> tuple[list[int], list[torch.Tensor]]:
    """generate()'s num_new greedy tokens for `prompt` alone (no EOS stop) and each step's raw
    logits (fp32)."""
    out = reference.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=num_new, min_new_tokens=0,
        eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = [step[0].float() for step in out.logits]
    assert len(tokens) == len(logits) == num_new, "generate() stopped early"
    return tokens, logits


def engine_generate(engine: LLMEngine, prompts: list[list[int]], num_new: int
                    ) -> list[tuple[list[int], list[torch.Tensor]]]:
    """The engine's greedy tokens and per-token logits rows for every prompt, submitted
    together (one batch) under a cache_salt no earlier request used. The engine must be idle."""
    params = SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True, return_logits=True)
    salt = f"generate-reference-{next(_salts)}"
    ids = [f"{salt}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(GenerationRequest(request_id, prompt, params, cache_salt=salt))
    got: dict[str, tuple[list[int], list[torch.Tensor]]] = {i: ([], []) for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, logits = got[out.request_id]
            tokens += out.new_token_ids
            if out.logits is not None:
                logits.append(out.logits.float().reshape(-1))
    return [got[i] for i in ids]


def compare_with_generate(got_tokens: list[int], got_logits: list[torch.Tensor],
                          want_tokens: list[int], want_logits: list[torch.Tensor], label: str
                          ) -> tuple[int, float]:
    """One prompt's engine output against generate()'s (see the module doc). Returns (near-ties
    (0 or 1), worst relative logits error)."""
    assert len(got_tokens) == len(want_tokens), f"{label}: {len(got_tokens)} tokens, want {len(want_tokens)}"
    assert len(got_logits) == len(got_tokens), f"{label}: {len(got_logits)} logits rows for {len(got_tokens)} tokens"
    worst = 0.0
    for step, (token, want, row, want_row) in enumerate(
            zip(got_tokens, want_tokens, got_logits, want_logits, strict=True)):
        assert row.shape == want_row.shape, f"{label}: step {step} logits shape {tuple(row.shape)}"
        error = float((row - want_row).abs().max() / want_row.abs().max())
        worst = max(worst, error)
        if token != want:
            top2 = want_row.topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE, (f"{label}: step {step}: engine token {token}, generate() {want}, "
                                    f"not a near-tie (reference top-2 gap {gap:.2e})")
            print(f"{label}: near-tie at step {step} (top-2 gap {gap:.2e}); rest not compared")
            return 1, worst
        assert error < TOLERANCE, f"{label}: step {step} logits differ by {error:.2e} relative"
    return 0, worst


def check_engine_matches_generate(engine: LLMEngine, reference: torch.nn.Module, label: str,
                                  num_new: int = 24, seed: int = 0) -> int:
    """PROMPT_LENGTHS random prompts through `engine` against `reference.generate()` (module
    doc). Returns the near-ties counted; fails if more than one prompt ended at one. Runs
    with one intra-op thread (on the shared 2-core CI box more threads only contend)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _check_engine_matches_generate(engine, reference, label, num_new, seed)
    finally:
        torch.set_num_threads(threads)


def _check_engine_matches_generate(engine: LLMEngine, reference: torch.nn.Module, label: str,
                                   num_new: int, seed: int) -> int:
    prompts = random_prompts(reference.config.vocab_size, seed)
    wanted = [reference_generate(reference, prompt, num_new) for prompt in prompts]
    distinct = {token for tokens, _ in wanted for token in tokens}
    assert len(distinct) >= MIN_DISTINCT_TOKENS, (
        f"{label}: the reference answers with only {sorted(distinct)}: a degenerate model tests nothing")
    got = engine_generate(engine, prompts, num_new)
    near_ties, worst = 0, 0.0
    for n, ((tokens, logits), (want_tokens, want_logits)) in enumerate(zip(got, wanted, strict=True)):
        tie, error = compare_with_generate(tokens, logits, want_tokens, want_logits, f"{label} prompt {n}")
        near_ties, worst = near_ties + tie, max(worst, error)
    print(f"{label}: {len(prompts)} prompts x {num_new} greedy tokens equal to generate()'s, "
          f"{len(distinct)} distinct tokens, {near_ties} near-ties, logits max relative error {worst:.2e}")
    assert near_ties <= 1, f"{label}: {near_ties} of {len(prompts)} prompts ended at a near-tie"
    return near_ties
