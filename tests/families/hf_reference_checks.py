"""Checks shared by the family tests (test_bamba.py, test_falcon_h1.py, test_nemotron_h.py,
test_qwen3_next.py):
a tiny random transformers model saved with save_pretrained and loaded by the engine's loader,
compared with transformers (fp32, CPU, eager attention) through the paged driver
(tests/paged_runner.py); a saved model with the embedded model's tokenizer for LLMEngine runs:
the engine's own greedy output against generate() (check_engine_greedy,
tests/engine/generate_reference.py) and the checkpoint reuse cases (tokens and logits against
from scratch, on a model that is not degenerate); tp=2 against tp=1 with tests/tp/tp_support.py's
per-rank program.

Each check prints what it measured (max relative error max|a-b| / max|b|, near-ties)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.execution.loader import load_model
from engine.parallel.tensor_parallel import TensorParallel
from paged_runner import PagedRunner, Request
from tests.engine.exactness import LOGITS_RTOL
from tests.engine.generate_reference import MIN_DISTINCT_TOKENS, check_engine_matches_generate
from tests.engine.reuse_cases import GREEDY, SYSTEM, Alone, chat, instruction_reuse, multi_turn, run
from tests.tp.tp_support import run_model, run_world

TOLERANCE = 1e-4
PROMPT_LEN = 45  # several KV blocks of 16 and SSD chunks of 16, with a partial tail
ODD_CHUNKS = [3, 5, 7, 3, 5, 7, 1, 3]  # the rest (11) in a last chunk
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|a - b| / max|b|."""
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


@torch.no_grad()
def perturb_constant_init(reference: torch.nn.Module, seed: int) -> None:
    """transformers sets norms to 1, D and dt_bias to 1, A_log to log(1..H) and biases to 0:
    draw them, so that a per-head, per-channel or misplaced term changes the output."""
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in reference.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            param.copy_(1.0 + 0.3 * noise)
        elif name.endswith("dt_bias"):
            param.copy_(0.7 * noise)
        elif name.endswith("A_log"):
            param.copy_(torch.log(torch.rand(param.shape, generator=generator) * 8 + 0.5))
        elif name.endswith(".D"):
            param.copy_(noise)
        elif name.endswith("bias"):
            param.copy_(0.1 * noise)


def without_none(hf_kwargs: dict) -> dict:
    """hf_kwargs less the keys set to None (left to the transformers config's default)."""
    return {k: v for k, v in hf_kwargs.items() if v is not None}


def save_reference(
    config_class, model_class, hf_kwargs: dict, directory: Path, seed: int = 0,
    perturb: Callable[[torch.nn.Module, int], None] = perturb_constant_init,
):
    """A seeded random transformers model (fp32, eager attention), constants perturbed by
    `perturb(model, seed)`, saved to `directory`; returns it in eval mode. hf_kwargs is
    deep-copied: transformers' configs may write into the dicts they are given (BambaConfig
    adds partial_rotary_factor to rope_parameters)."""
    torch.manual_seed(seed)
    kwargs = json.loads(json.dumps(hf_kwargs))
    reference = model_class(config_class(**kwargs, attn_implementation="eager")).eval()
    perturb(reference, seed)
    reference.save_pretrained(directory)
    return reference


class Case:
    """A transformers reference and the same checkpoint loaded by the engine."""

    def __init__(
        self, config_class, model_class, hf_kwargs: dict, directory: Path,
        perturb: Callable[[torch.nn.Module, int], None] = perturb_constant_init,
    ) -> None:
        self.reference = save_reference(config_class, model_class, hf_kwargs, directory, perturb=perturb)
        self.model, self.config = load_model(directory)
        self.directory = directory

    def prompt(self, length: int, seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.config.vocab_size, (length,), generator=generator).tolist()

    @torch.no_grad()
    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        return self.reference(torch.tensor([tokens])).logits[0].float()


def check_one_chunk(case: Case) -> float:
    prompt = case.prompt(PROMPT_LEN, seed=1)
    logits = PagedRunner(case.model).run_in_chunks(Request(state_slot=0), prompt, [])
    error = rel_err(logits, case.reference_logits(prompt))
    print(f"one chunk: max relative error {error:.2e}")
    assert error < TOLERANCE
    return error


def check_odd_chunks(case: Case) -> float:
    prompt = case.prompt(PROMPT_LEN, seed=2)
    logits = PagedRunner(case.model, seed=1).run_in_chunks(Request(state_slot=2), prompt, ODD_CHUNKS)
    error = rel_err(logits, case.reference_logits(prompt))
    print(f"chunks of {ODD_CHUNKS} + rest: max relative error {error:.2e}")
    assert error < TOLERANCE
    return error


def check_batched(case: Case) -> float:
    """Three requests in shared forwards: a prefill continuing, a decode and a fresh prefill in
    one batch (the fresh one in a slot another request dirtied, so it must reset)."""
    a, b, c = case.prompt(34, seed=3), case.prompt(23, seed=4), case.prompt(20, seed=5)
    runner = PagedRunner(case.model, num_slots=4)
    req_a, req_b, req_c = Request(state_slot=0), Request(state_slot=1), Request(state_slot=2)
    runner.step([(Request(state_slot=2), case.prompt(9, seed=6))])
    first = runner.step([(req_a, a[:12]), (req_b, b[:21])])
    mixed = runner.step([(req_a, a[12:30]), (req_b, b[21:22]), (req_c, c[:9])])
    last = runner.step([(req_b, b[22:23]), (req_c, c[9:]), (req_a, a[30:31])])
    got = {
        "a": (a[:31], [first[0], mixed[0], last[2]]),
        "b": (b, [first[1], mixed[1], last[0]]),
        "c": (c, [mixed[2], last[1]]),
    }
    worst = 0.0
    for name, (tokens, pieces) in got.items():
        logits = torch.cat(pieces)
        assert logits.shape[0] == len(tokens)
        worst = max(worst, rel_err(logits, case.reference_logits(tokens)))
    print(f"batched (3 requests): max relative error {worst:.2e}")
    assert worst < TOLERANCE
    return worst


def check_greedy(case: Case, num_new: int = 32) -> int:
    """num_new greedy tokens against generate(): logits within TOLERANCE at every step, tokens
    identical; a differing token at a near-tie (reference top-2 within TOLERANCE) is counted
    and ends the comparison. Returns the near-ties (0 or 1)."""
    prompt = case.prompt(19, seed=7)
    with torch.no_grad():
        reference = case.reference.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=num_new, min_new_tokens=0,
            eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
    reference_tokens = reference.sequences[0, len(prompt):].tolist()
    reference_logits = [step[0].float() for step in reference.logits]
    assert len(reference_tokens) == num_new
    runner, request = PagedRunner(case.model), Request(state_slot=1)
    step_logits = runner.step([(request, prompt)])[0][-1]
    worst = 0.0
    for i, expected in enumerate(reference_tokens):
        error = rel_err(step_logits, reference_logits[i])
        worst = max(worst, error)
        assert error < TOLERANCE, f"logits differ at step {i} ({error:.2e})"
        token = int(step_logits.argmax())
        if token != expected:
            top2 = reference_logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TOLERANCE, f"step {i}: got {token}, reference {expected} (gap {gap})"
            print(f"greedy: near-tie at step {i} (top-2 gap {gap:.2e}); {i} tokens identical")
            return 1
        step_logits = runner.step([(request, [token])])[0][-1]
    print(f"greedy: {num_new} tokens identical, 0 near-ties, max relative error {worst:.2e}")
    return 0


def save_engine_model(
    config_class, model_class, hf_kwargs: dict, directory: Path,
    perturb: Callable[[torch.nn.Module, int], None] = perturb_constant_init,
) -> Path:
    """A saved random model (constants drawn by `perturb`, as save_reference) whose vocabulary
    is the embedded model's, with its tokenizer files copied, for
    LLMEngine(EngineConfig(model_dir=...))."""
    embedded = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    kwargs = dict(hf_kwargs, vocab_size=embedded["vocab_size"], max_position_embeddings=1024,
                  eos_token_id=embedded.get("eos_token_id"), pad_token_id=embedded.get("pad_token_id"),
                  bos_token_id=embedded.get("bos_token_id"))
    save_reference(config_class, model_class, kwargs, directory, perturb=perturb)
    for name in TOKENIZER_FILES:
        if (DEFAULT_MODEL_DIR / name).exists():
            shutil.copy(DEFAULT_MODEL_DIR / name, directory / name)
    return directory


def check_tp2_matches_tp1(model_dir: Path, name: str, out_dir: Path) -> float:
    """tp_support's greedy batch (24 prompts, 4 decode steps) and stop-and-continue (copied and
    captured-then-restored state slots) at tp=2 (two gloo ranks) against tp=1 in process:
    tokens equal, logits within TOLERANCE, each rank holding less than the whole model."""
    torch.set_num_threads(1)
    single = run_model(model_dir, TensorParallel.single())
    assert single["tokens"].unique().numel() > 5, "degenerate greedy outputs test nothing"
    ranks = run_world(2, {name: model_dir}, out_dir)[name]
    worst = 0.0
    for rank in ranks:
        assert torch.equal(rank["tokens"], single["tokens"])
        worst = max(worst, rel_err(rank["logits"], single["logits"]))
        for key in ("whole", "copied", "restored"):
            worst = max(worst, rel_err(rank[key], single["whole"]))
        assert rank["num_elements"] < 0.7 * single["num_elements"]
        assert rank["state_bytes_per_slot"] < single["state_bytes_per_slot"]
    print(f"tp=2: greedy tokens equal, logits max relative error {worst:.2e}")
    assert worst < TOLERANCE
    return worst


def check_engine_greedy(engine, model_class, label: str) -> int:
    """The engine's own greedy output (LLMEngine, its worker and sampler) against generate()
    of `model_class` loaded from the engine's model directory (tests/engine/generate_reference.py).
    Returns the near-ties counted."""
    reference = model_class.from_pretrained(
        engine.config.model_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
    return check_engine_matches_generate(engine, reference, label)


# ---- checkpoint reuse through LLMEngine (every family asserts the same) ------------------------


def assert_same_run(got: Alone, want: Alone, label: str) -> float:
    """`got` (served from a checkpoint) against `want` (from scratch): all GREEDY.max_tokens
    tokens identical and each position's logits within LOGITS_RTOL relative. Returns the worst
    relative error."""
    assert len(want.tokens) == GREEDY.max_tokens, f"{label}: {len(want.tokens)} tokens from scratch"
    assert got.tokens == want.tokens, f"{label}: tokens {got.tokens}, from scratch {want.tokens}"
    assert len(got.logits) == len(got.tokens) and len(want.logits) == len(want.tokens), (
        f"{label}: {len(got.logits)} and {len(want.logits)} logits rows for {len(got.tokens)} tokens")
    worst = 0.0
    for position, (row, reference) in enumerate(zip(got.logits, want.logits, strict=True)):
        error = float((row - reference).abs().max() / reference.abs().max())
        assert error <= LOGITS_RTOL, f"{label}: logits at output position {position} differ by {error:.2e}"
        worst = max(worst, error)
    return worst


def assert_not_degenerate(*runs: Alone, label: str) -> None:
    """A random model that answers everything with one token makes equal outputs meaningless."""
    distinct = {token for run_ in runs for token in run_.tokens}
    assert len(distinct) >= MIN_DISTINCT_TOKENS, (
        f"{label}: the runs produced only tokens {sorted(distinct)}: a degenerate model tests nothing")


def check_instruction_reuse(engine, prefix: str) -> tuple[Alone, Alone, Alone]:
    """A second request with the same instructions restores them, prefills only the rest,
    and gives the from-scratch tokens and logits. Returns the three runs (first, second, scratch)."""
    first, second, scratch = instruction_reuse(engine, f"{prefix}-instruction")
    assert first.cached == 0 and second.boundary is not None
    assert second.cached == second.boundary
    assert sum(second.chunk_sizes) == len(second.prompt) - second.boundary + GREEDY.max_tokens - 1
    assert scratch.cached == 0
    assert_not_degenerate(first, second, label=f"{prefix} instruction reuse")
    assert_same_run(second, scratch, f"{prefix} instruction reuse")
    return first, second, scratch


def check_multi_turn(engine, prefix: str) -> tuple[Alone, Alone, Alone]:
    """A continuation restores at least the previous turn's prompt and matches from scratch
    (tokens and logits). Returns the three runs (turn 1, turn 2, turn 2 from scratch)."""
    first, second, scratch = multi_turn(engine, f"{prefix}-multi-turn")
    assert second.cached >= len(first.prompt)
    assert scratch.cached == 0
    assert_not_degenerate(first, second, label=f"{prefix} multi-turn")
    assert_same_run(second, scratch, f"{prefix} multi-turn")
    return first, second, scratch


def check_repeat(engine, prefix: str) -> tuple[Alone, Alone]:
    """The same conversation again is served from its prompt checkpoint with no prefill and
    gives the first run's tokens, text and logits. Returns both runs."""
    conversation = chat(SYSTEM, "Repeat after me: seven rivers.")
    first = run(engine, f"{prefix}-r1", conversation, f"{prefix}-repeat")
    second = run(engine, f"{prefix}-r2", conversation, f"{prefix}-repeat")
    assert first.cached == 0
    assert second.cached == len(second.prompt) and second.chunk_sizes[0] == 0
    assert_not_degenerate(first, label=f"{prefix} repeat")
    assert_same_run(second, first, f"{prefix} repeat")
    assert second.text == first.text
    return first, second
