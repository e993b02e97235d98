"""The renderer's instruction boundary fails closed (docs/design.md section 3), with no Serve:
PromptRenderer (deployments/prompts/rendering.py), the code the Renderer deployment runs.

Custom chat templates on the embedded tokenizer stand in for the templates that break the
"instructions rendered alone are a token prefix" rule: one that merges the system message into
the first user turn, one that injects a date line into the system block only when other
messages follow, one whose bare concatenation lets BPE merge tokens across the seam, and one
that raises. Each gives no boundary and the expected reason; requests rendered by them still
produce exactly what they produce from scratch (the engine without a boundary just computes).
"""

from __future__ import annotations

import copy

import pytest
from transformers import AutoTokenizer

from deployments.http.errors import as_api_error
from deployments.prompts.instruction_boundary import BoundaryRejection, find_instruction_boundary
from deployments.prompts.prefix_memory import RenderedPrefixes
from deployments.prompts.rendering import PromptRenderer
from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.core.llm_engine import LLMEngine
from engine.interfaces.sampling_params import InvalidRequestError, SamplingParams

GEN_PROMPT = "{%- if add_generation_prompt -%}<|start_of_role|>assistant<|end_of_role|>{%- endif -%}"

# Mistral style: the system text goes into the first user turn; alone it renders nothing.
MERGING_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}{%- set sys = messages[0]['content'] -%}"
    "{%- set rest = messages[1:] -%}{%- else -%}{%- set sys = '' -%}{%- set rest = messages -%}"
    "{%- endif -%}"
    "{%- for m in rest -%}"
    "{%- if m['role'] == 'user' -%}<|start_of_role|>user<|end_of_role|>"
    "{%- if loop.first and sys -%}{{ sys }}\n\n{%- endif -%}{{ m['content'] }}<|end_of_text|>\n"
    "{%- else -%}<|start_of_role|>{{ m['role'] }}<|end_of_role|>{{ m['content'] }}<|end_of_text|>\n"
    "{%- endif -%}{%- endfor -%}" + GEN_PROMPT
)

# Llama 3.1 style: a date line inside the system block, rendered only when more messages follow.
DATE_TEMPLATE = (
    "{%- for m in messages -%}<|start_of_role|>{{ m['role'] }}<|end_of_role|>{{ m['content'] }}"
    "{%- if loop.first and m['role'] == 'system' and messages | length > 1 -%}\nToday: 2026-01-01"
    "{%- endif -%}<|end_of_text|>\n{%- endfor -%}" + GEN_PROMPT
)

# No separators at all: the end of the system text and the start of the user text merge in BPE.
CONCATENATING_TEMPLATE = "{%- for m in messages -%}{{ m['content'] }}{%- endfor -%}" + GEN_PROMPT

# Refuses a conversation without a user message (so the instructions cannot render alone).
NEEDS_USER_TEMPLATE = (
    "{%- if messages | selectattr('role', 'equalto', 'user') | list | length == 0 -%}"
    "{{ raise_exception('a user message is required') }}{%- endif -%}"
    "{%- for m in messages -%}<|start_of_role|>{{ m['role'] }}<|end_of_role|>{{ m['content'] }}"
    "<|end_of_text|>\n{%- endfor -%}" + GEN_PROMPT
)

SYSTEM = "You are hel"  # "hel" + "pful" merge into other tokens than "hel" alone
USER = "pful today? Tell me about the weather."


@pytest.fixture(scope="module")
def base_tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def with_template(tokenizer, template: str | None):
    custom = copy.deepcopy(tokenizer)
    if template is not None:
        custom.chat_template = template
    return custom


def messages(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in pairs]


def render_chat(tokenizer, conversation, prefixes: RenderedPrefixes | None = None):
    """PromptRenderer.render_chat; with `prefixes` (None: its own, empty) as its memory."""
    return PromptRenderer(tokenizer, prefixes).render_chat(conversation)


def test_the_model_template_gives_the_system_prompt_length(base_tokenizer):
    conversation = messages(("system", SYSTEM), ("developer", "Be brief."), ("user", USER))
    prompt = render_chat(base_tokenizer, conversation)
    prefix = base_tokenizer.apply_chat_template(
        conversation[:2],
        add_generation_prompt=False, tokenize=True, return_dict=False)
    assert prompt.instruction_boundary == len(prefix)
    assert prompt.boundary_rejection is None
    assert list(prompt.token_ids[: len(prefix)]) == list(prefix)


@pytest.mark.parametrize("conversation, reason", [
    (messages(("user", USER)), BoundaryRejection.NO_LEADING_INSTRUCTIONS),
    (messages(("user", USER), ("system", SYSTEM), ("user", USER)),
     BoundaryRejection.NO_LEADING_INSTRUCTIONS),
    (messages(("system", SYSTEM), ("developer", "Be brief.")), BoundaryRejection.ALL_INSTRUCTIONS),
])
def test_conversations_without_a_boundary(base_tokenizer, conversation, reason):
    prompt = render_chat(base_tokenizer, conversation)
    assert prompt.instruction_boundary is None
    assert prompt.boundary_rejection == reason.value


@pytest.mark.parametrize("template, reason", [
    (MERGING_TEMPLATE, BoundaryRejection.NOT_A_PREFIX),
    (DATE_TEMPLATE, BoundaryRejection.NOT_A_PREFIX),
    (CONCATENATING_TEMPLATE, BoundaryRejection.NOT_A_PREFIX),
    (NEEDS_USER_TEMPLATE, BoundaryRejection.RENDER_ERROR),
], ids=["merges-system-into-user", "injects-date", "bpe-merge-across-seam", "raises"])
def test_templates_that_break_the_prefix_rule_fail_closed(base_tokenizer, template, reason):
    tokenizer = with_template(base_tokenizer, template)
    conversation = messages(("system", SYSTEM), ("user", USER))
    prompt = render_chat(tokenizer, conversation)  # the full conversation still renders
    assert prompt.instruction_boundary is None
    assert prompt.boundary_rejection == reason.value
    # the same verdict straight from find_instruction_boundary
    assert find_instruction_boundary(tokenizer, conversation, prompt.token_ids).rejection is reason


def test_the_bpe_case_really_merges_across_the_seam(base_tokenizer):
    """Guards the fixture: "You are hel" alone is not a token prefix of "You are helpful..."."""
    alone = base_tokenizer.encode(SYSTEM, add_special_tokens=False)
    joined = base_tokenizer.encode(SYSTEM + USER, add_special_tokens=False)
    assert SYSTEM + USER != SYSTEM and joined[: len(alone)] != alone


def test_render_chat_errors_are_400_and_completions_have_no_boundary(base_tokenizer):
    with pytest.raises(InvalidRequestError) as info:
        render_chat(with_template(base_tokenizer, NEEDS_USER_TEMPLATE), messages(("system", SYSTEM)))
    error = as_api_error(info.value)
    assert (error.status_code, error.param) == (400, "messages")
    assert error.message.startswith("The chat template rejected the messages: ")
    renderer = PromptRenderer(base_tokenizer)
    prompt = renderer.tokenize_prompt("You are helpful")
    assert prompt.instruction_boundary is None and prompt.boundary_rejection is None
    assert renderer.tokenize_prompt([5, 6]).token_ids == (5, 6)
    for refused in ("", [len(base_tokenizer)]):
        with pytest.raises(InvalidRequestError) as info:
            renderer.tokenize_prompt(refused)
        assert as_api_error(info.value).param == "prompt"


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4))


def generate(engine: LLMEngine, request_id: str, prompt_ids, salt: str, boundary: int | None):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request(GenerationRequest(request_id, prompt_ids, params, cache_salt=salt,
                                         instruction_boundary=boundary))
    tokens, cached = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
                cached = out.num_cached_tokens
    return tokens, cached


@pytest.mark.parametrize("name, template", [
    ("merges-system-into-user", MERGING_TEMPLATE), ("injects-date", DATE_TEMPLATE),
    ("bpe-merge-across-seam", CONCATENATING_TEMPLATE),
])
def test_requests_without_a_boundary_are_still_exact(base_tokenizer, engine, name, template):
    """Two requests sharing the system message, rendered by a template that fails the check:
    the second produces exactly what it produces in a fresh namespace (no reuse possible)."""
    tokenizer = with_template(base_tokenizer, template)
    first = render_chat(tokenizer, messages(("system", SYSTEM), ("user", USER)))
    second = render_chat(tokenizer, messages(("system", SYSTEM), ("user", "pful? Say hi.")))
    assert first.instruction_boundary is None and second.instruction_boundary is None
    generate(engine, f"{name}-1", first.token_ids, name, None)
    shared, cached = generate(engine, f"{name}-2", second.token_ids, name,
                              second.instruction_boundary)
    scratch, scratch_cached = generate(engine, f"{name}-3", second.token_ids, f"{name}-fresh", None)
    assert scratch_cached == 0
    assert cached < len(second.token_ids)
    assert shared == scratch


def test_remembered_instructions_are_not_tokenized_again(base_tokenizer):
    """The second request with the same instructions takes their ids from RenderedPrefixes and
    tokenizes only the rest; the ids and the boundary are those of a render without it. Other
    instructions are tokenized; past the capacity the least recently used are forgotten."""
    prefixes = RenderedPrefixes(entries=2)
    renderer = PromptRenderer(base_tokenizer, prefixes)
    first = messages(("system", SYSTEM), ("developer", "Be brief."), ("user", USER))
    again = messages(("system", SYSTEM), ("developer", "Be brief."), ("user", "Another question?"))
    got = [renderer.render_chat(m) for m in (first, again)]
    assert got == [render_chat(base_tokenizer, m) for m in (first, again)]
    assert got[1].instruction_boundary is not None
    assert [p.reused_tokens for p in got] == [0, got[1].instruction_boundary]
    assert len(prefixes) == 1 and renderer.stats.reuses == 1
    renderer.render_chat(messages(("system", "Other."), ("user", USER)))
    renderer.render_chat(messages(("system", "Third."), ("user", USER)))
    assert len(prefixes) == 2  # the first instructions were forgotten
    assert renderer.render_chat(again).reused_tokens == 0
    assert renderer.render_chat(again).reused_tokens == got[1].instruction_boundary


def test_a_template_whose_output_changed_is_tokenized_anew(base_tokenizer):
    """The memory is keyed by the rendered text: a template whose output changed since the
    instructions were remembered (here: the system block's date line, past midnight) renders
    another text, which is tokenized and remembered anew, so that request and the next ones
    get what a render without RenderedPrefixes gives. A template that never gives a boundary
    gives none with it either. A template error is not remembered."""
    prefixes = RenderedPrefixes()
    template = DATE_TEMPLATE.replace("messages | length > 1", "true")  # the date line always
    yesterday = with_template(base_tokenizer, template)
    conversation = messages(("system", SYSTEM), ("user", USER))
    assert render_chat(yesterday, conversation, prefixes).instruction_boundary is not None
    today = with_template(base_tokenizer, template.replace("2026-01-01", "2026-01-02"))
    want = render_chat(today, conversation)
    assert want.instruction_boundary is not None
    renderer = PromptRenderer(today, prefixes)
    got = [renderer.render_chat(conversation) for _ in range(3)]
    assert got == [want] * 3
    assert [p.reused_tokens for p in got] == [0, want.instruction_boundary, want.instruction_boundary]
    assert len(prefixes) == 2  # yesterday's text and today's
    merging = with_template(base_tokenizer, MERGING_TEMPLATE)
    for _ in range(2):
        prompt = render_chat(merging, conversation, prefixes)
        assert prompt == render_chat(merging, conversation)
        assert prompt.boundary_rejection == BoundaryRejection.NOT_A_PREFIX.value
        assert prompt.reused_tokens == 0
    failing, before = with_template(base_tokenizer, NEEDS_USER_TEMPLATE), len(prefixes)
    other = messages(("system", "New."), ("user", USER))
    prompt = render_chat(failing, other, prefixes)
    assert prompt.boundary_rejection == BoundaryRejection.RENDER_ERROR.value
    assert len(prefixes) == before
