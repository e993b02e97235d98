"""Client-directed checkpoints in the in-process engine (docs/design.md sections 2-3): prompts
rendered by the one renderer (PromptRenderer, with the messages' cache_control markers), their
verified breakpoints carried by GenerationRequest, a `breakpoint` checkpoint captured at each,
and a later request that shares the marked prefix restores it, with exactly the output it
computes from scratch under a fresh cache_salt.
"""

from __future__ import annotations

import copy

import pytest

from cache.checkpoint_keys import CheckpointKind
from deployments.engine_metrics import EngineMetricsExporter
from deployments.metrics import CHECKPOINT_EVENTS_TOTAL
from deployments.prompts.rendering import PromptRenderer, RenderedPrompt
from engine.core.llm_engine import LLMEngine
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.sampling_params import InvalidRequestError
from tests.engine.exactness import Outcome, Tally, check_near_ties, compare
from tests.engine.reuse_cases import GREEDY
from tests.unit.recording_metrics import RecordingMetrics
from tests.unit.test_cache_breakpoint_markers import HISTORY_REWRITING_TEMPLATE, MARK

SYSTEM = "Classify each customer request by topic, in two words."
EXAMPLES = [("My parcel never arrived and the tracking page is empty.", "shipping delay"),
            ("The blender stopped working after a week, can I get it replaced?", "warranty claim"),
            ("I was charged twice for the same invoice this month.", "billing error")]
DOCUMENT = ("Store handbook. Returns are accepted within thirty days with a receipt; opened "
            "software is exchanged only for the same title. Warranty repairs go to the service "
            "desk in aisle seven, which opens at nine and closes at five on weekdays. ") * 4


def few_shot(question: str, marked: bool = True) -> list[dict]:
    """System + 3 user/assistant example pairs, the last example marked, + a new question."""
    messages = [{"role": "system", "content": SYSTEM}]
    for request, label in EXAMPLES:
        messages += [{"role": "user", "content": request}, {"role": "assistant", "content": label}]
    if marked:
        messages[-1]["cache_control"] = dict(MARK)
    return messages + [{"role": "user", "content": question}]


def document_qa(question: str) -> list[dict]:
    """A first user message holding the document, marked on its content part, then a question."""
    return [{"role": "system", "content": "Answer from the handbook."},
            {"role": "user", "content": [{"type": "text", "text": DOCUMENT, "cache_control": dict(MARK)},
                                         {"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(max_num_batched_tokens=64, max_num_seqs=4))


def run(engine: LLMEngine, renderer: PromptRenderer, request_id: str, conversation: list[dict],
        salt: str) -> tuple[RenderedPrompt, Outcome]:
    """Render `conversation` and run it alone to completion (greedy, with logits)."""
    prompt = renderer.render_chat(conversation)
    engine.add_request(GenerationRequest(
        request_id, prompt.token_ids, GREEDY, instruction_boundary=prompt.instruction_boundary,
        cache_breakpoints=prompt.cache_breakpoints, cache_salt=salt))
    outcome = Outcome([], [], "", 0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outcome.token_ids += out.new_token_ids
            outcome.text += out.new_text
            outcome.logits.append(out.logits)
            outcome.cached_tokens = out.num_cached_tokens
    return prompt, outcome


def assert_exact(shared: Outcome, scratch: Outcome, label: str) -> None:
    """`shared` is what `scratch` (computed from scratch) is: same greedy tokens, logits within
    the exactness suite's tolerance (no near-tie allowed for one request)."""
    assert scratch.cached_tokens == 0
    tally = Tally()
    compare(shared, scratch, tally, label)
    check_near_ties(tally, label)


def breakpoint_counters(engine: LLMEngine):
    return engine.stats().checkpoints[CheckpointKind.BREAKPOINT.value]


def test_few_shot_examples_marked_on_the_last_example_are_restored(engine):
    renderer = PromptRenderer(engine.tokenizer)
    before = breakpoint_counters(engine)
    first, one = run(engine, renderer, "fs1", few_shot("Where is my refund for order 12?"), "few-shot")
    prompt, two = run(engine, renderer, "fs2", few_shot("Does the warranty cover water damage?"), "few-shot")
    _, scratch = run(engine, renderer, "fs3", few_shot("Does the warranty cover water damage?"), "fs-fresh")

    examples = len(engine.tokenizer.apply_chat_template(
        few_shot("", marked=False)[:-1], add_generation_prompt=False, tokenize=True, return_dict=False))
    assert first.cache_breakpoints == prompt.cache_breakpoints == (examples,)
    assert one.cached_tokens == 0
    assert two.cached_tokens == examples  # the system prompt and every example
    assert examples > 3 * prompt.instruction_boundary
    assert_exact(two, scratch, "few-shot")
    after = breakpoint_counters(engine)
    assert after.captured - before.captured == 2  # the shared namespace's and the fresh salt's
    assert after.hit - before.hit == 1


def test_without_the_marker_only_the_instructions_are_restored(engine):
    """The control: the same few-shot requests unmarked restore the system prompt alone."""
    renderer = PromptRenderer(engine.tokenizer)
    run(engine, renderer, "un1", few_shot("Where is my refund for order 12?", marked=False), "unmarked")
    prompt, two = run(engine, renderer, "un2", few_shot("Does the warranty cover water damage?", marked=False),
                      "unmarked")
    assert prompt.cache_breakpoints == () and two.cached_tokens == prompt.instruction_boundary


def test_a_marked_document_part_is_reused_by_another_question(engine):
    renderer = PromptRenderer(engine.tokenizer)
    first, one = run(engine, renderer, "doc1", document_qa("When does the service desk open?"), "document")
    prompt, two = run(engine, renderer, "doc2", document_qa("Can I return opened software?"), "document")
    _, scratch = run(engine, renderer, "doc3", document_qa("Can I return opened software?"), "doc-fresh")

    (position,) = prompt.cache_breakpoints
    assert first.cache_breakpoints == (position,)
    assert engine.tokenizer.decode(prompt.token_ids[:position]).endswith(DOCUMENT)
    assert position >= len(engine.tokenizer.encode(DOCUMENT, add_special_tokens=False))
    assert one.cached_tokens == 0 and two.cached_tokens == position
    assert_exact(two, scratch, "document")


def test_a_breakpoint_the_template_rewrites_is_dropped_and_outputs_stay_exact(engine):
    """A template that rewrites earlier turns: the marked example is not a token prefix of the
    prompt, so the breakpoint is dropped with its reason (which the ingress counts); the
    second request restores only the instructions and still computes exactly."""
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = HISTORY_REWRITING_TEMPLATE
    renderer = PromptRenderer(tokenizer)
    before = breakpoint_counters(engine)
    first, _ = run(engine, renderer, "rw1", few_shot("Where is my refund for order 12?"), "rewriting")
    prompt, two = run(engine, renderer, "rw2", few_shot("Does the warranty cover water damage?"), "rewriting")
    _, scratch = run(engine, renderer, "rw3", few_shot("Does the warranty cover water damage?"), "rw-fresh")
    for rendered in (first, prompt):
        assert rendered.cache_breakpoints == () and rendered.breakpoint_rejections == ("not_a_prefix",)
    assert two.cached_tokens == prompt.instruction_boundary
    assert_exact(two, scratch, "rewriting")
    assert breakpoint_counters(engine).captured == before.captured


def test_markers_are_ignored_when_breakpoint_checkpoints_are_off():
    engine = LLMEngine(EngineConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                    checkpoint_slots=("prompt", "response", "instruction")))
    renderer = PromptRenderer(engine.tokenizer)
    _, one = run(engine, renderer, "off1", few_shot("Where is my refund for order 12?"), "off")
    prompt, two = run(engine, renderer, "off2", few_shot("Does the warranty cover water damage?"), "off")
    _, scratch = run(engine, renderer, "off3", few_shot("Does the warranty cover water damage?"), "off-fresh")
    assert prompt.cache_breakpoints  # verified, and passed on
    assert two.cached_tokens == prompt.instruction_boundary  # but nothing was captured there
    assert breakpoint_counters(engine).captured == 0
    assert_exact(two, scratch, "breakpoints off")
    # and the prefill was not cut there: no chunk of the first request ended at the breakpoint
    engine.add_request(GenerationRequest("off4", prompt.token_ids, GREEDY, cache_salt="off-cut",
                                         cache_breakpoints=prompt.cache_breakpoints))
    assert engine.scheduler.requests["off4"].pause_positions == ()
    engine.abort_request("off4")
    while engine.has_unfinished_requests():
        engine.step()


def test_breakpoint_captures_and_hits_are_exported_as_metrics(engine):
    """The LLM server's exporter turns the engine's breakpoint counters into
    ray_hybrid_serve_checkpoint_events_total{kind="breakpoint", event=...}."""
    renderer = PromptRenderer(engine.tokenizer)
    run(engine, renderer, "m1", few_shot("Where is my refund for order 12?"), "metrics")
    run(engine, renderer, "m2", few_shot("Does the warranty cover water damage?"), "metrics")
    recording = RecordingMetrics()
    EngineMetricsExporter(engine, create=recording).export()
    series = recording.series(CHECKPOINT_EVENTS_TOTAL)
    counters = breakpoint_counters(engine)
    assert counters.hit >= 1
    assert series[(("event", "captured"), ("kind", "breakpoint"))] == counters.captured
    assert series[(("event", "hit"), ("kind", "breakpoint"))] == counters.hit


def test_breakpoints_outside_the_prompt_are_refused_and_inside_kept_sorted(engine):
    prompt = tuple(range(10, 50))  # 40 tokens
    for breakpoints in ((0,), (5, 40), (-1,)):
        with pytest.raises(InvalidRequestError, match="cache_breakpoints"):
            engine.add_request(GenerationRequest("bad", prompt, GREEDY, cache_breakpoints=breakpoints))
    engine.add_request(GenerationRequest("good", prompt, GREEDY, cache_breakpoints=(39, 5, 5)))
    assert engine.scheduler.requests["good"].cache_breakpoints == (5, 39)
    assert engine.scheduler.requests["good"].pause_positions == (5, 39)
    engine.abort_request("good")
    while engine.has_unfinished_requests():
        engine.step()
