"""Cache breakpoints at the edge and in the renderer, with no Serve and no engine: the protocol
accepts `cache_control: {"type": "ephemeral"}` on messages and text content parts and refuses
anything else with an OpenAI-style 400, as it refuses more markers than the limit; the renderer
(deployments/prompts/cache_breakpoints.py) takes the markers out of what the template sees and
places each where the conversation rendered alone up to it ends, when that is an exact token
prefix of the prompt, else drops it with a reason the ingress counts (docs/design.md section 3).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import httpx
import pytest
from fastapi import FastAPI
from transformers import AutoTokenizer

from deployments.http.errors import APIError, install_error_handlers, validated
from deployments.http.limits import RequestLimits, check_cache_markers
from deployments.http.protocol import CacheControl, ChatCompletionRequest, ChatMessage, TextContentPart
from deployments.metrics import BREAKPOINT_REJECTIONS, RequestMetrics
from deployments.prompts.cache_breakpoints import CacheMarker, split_cache_markers
from deployments.prompts.instruction_boundary import BoundaryRejection
from deployments.prompts.rendering import PromptRenderer
from deployments.renderer import Renderer
from engine.engine_config import DEFAULT_MODEL_DIR
from engine.interfaces.sampling_params import InvalidRequestError
from tests.unit.recording_metrics import RecordingMetrics
from tests.unit.test_renderer_boundary import GEN_PROMPT, NEEDS_USER_TEMPLATE

MARK = {"type": "ephemeral"}
LIMITS = RequestLimits(max_body_bytes=1 << 20, max_requests_in_flight=8, retry_after_s=1.0,
                       max_stop_strings=16, max_stop_string_chars=256, max_prompt_tokens=None,
                       max_output_tokens=4096, max_cache_breakpoints=4)

# Rewrites earlier turns (as templates that drop an assistant's reasoning from the history do):
# an assistant message followed by others renders as a placeholder, so the conversation rendered
# up to a marked assistant message is not a prefix of the whole conversation's rendering.
HISTORY_REWRITING_TEMPLATE = (
    "{%- for m in messages -%}<|start_of_role|>{{ m['role'] }}<|end_of_role|>"
    "{%- if m['role'] == 'assistant' and not loop.last -%}(an earlier answer)"
    "{%- else -%}{{ m['content'] }}{%- endif -%}<|end_of_text|>\n{%- endfor -%}" + GEN_PROMPT
)

DOCUMENT = ("The river Sava rises in the Julian Alps and joins the Danube at Belgrade; its valley "
            "holds seven towns, twelve bridges and one old mill that still grinds flour. ") * 3


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def rendered(tokenizer, messages, add_generation_prompt=False, **options) -> tuple[int, ...]:
    return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                               tokenize=True, return_dict=False, **options))


def few_shot(marked: bool) -> list[dict]:
    messages = [{"role": "system", "content": "Classify each request by topic."}]
    for i in range(3):
        messages += [{"role": "user", "content": f"Example {i}: parcel {i} never arrived at the store."},
                     {"role": "assistant", "content": f"shipping {i}"}]
    if marked:
        messages[-1]["cache_control"] = dict(MARK)
    return messages + [{"role": "user", "content": "Where is my refund?"}]


def document_question(marked: bool, question: str = "Where does the river end?") -> list[dict]:
    document = {"type": "text", "text": DOCUMENT, **({"cache_control": dict(MARK)} if marked else {})}
    return [{"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": [document, {"type": "text", "text": question}]}]


# ---------------------------------------------------------------- the renderer


def test_a_marked_message_ends_where_the_conversation_up_to_it_renders_alone(tokenizer):
    marked = few_shot(marked=True)
    prompt = PromptRenderer(tokenizer).render_chat(marked)
    plain = PromptRenderer(tokenizer).render_chat(few_shot(marked=False))
    assert prompt.token_ids == plain.token_ids  # the markers never reach the template
    examples = rendered(tokenizer, few_shot(marked=False)[:7])
    assert prompt.cache_breakpoints == (len(examples),)
    assert prompt.token_ids[: len(examples)] == examples
    assert prompt.instruction_boundary is not None and prompt.instruction_boundary < len(examples)
    assert prompt.breakpoint_rejections == () and plain.cache_breakpoints == ()
    assert marked[6]["cache_control"] == MARK  # the caller's dicts are not changed


def test_a_marked_content_part_ends_at_the_end_of_its_text(tokenizer):
    prompt = PromptRenderer(tokenizer).render_chat(document_question(marked=True))
    (position,) = prompt.cache_breakpoints
    head = document_question(marked=False)
    head[1]["content"] = head[1]["content"][:1]
    want = rendered(tokenizer, head, continue_final_message=True)
    assert position == len(want) and prompt.token_ids[:position] == want
    # it ends with the document's text, before the question and the end of the turn
    assert tokenizer.decode(prompt.token_ids[:position]).endswith(DOCUMENT)
    assert "Where does" in tokenizer.decode(prompt.token_ids[position:])
    # a marker on the message itself ends after its end-of-turn tokens, further on
    whole = document_question(marked=False)
    whole[1]["cache_control"] = dict(MARK)
    assert PromptRenderer(tokenizer).render_chat(whole).cache_breakpoints == (len(rendered(tokenizer, whole[:2])),)


def test_markers_are_found_in_order_and_duplicates_collapse(tokenizer):
    conversation = document_question(marked=True)
    conversation[0]["cache_control"] = dict(MARK)
    conversation[1]["cache_control"] = dict(MARK)
    stripped, markers = split_cache_markers(conversation)
    assert markers == (CacheMarker(0), CacheMarker(1, 0), CacheMarker(1))
    assert all("cache_control" not in m for m in stripped)
    assert all("cache_control" not in p for p in stripped[1]["content"])
    prompt = PromptRenderer(tokenizer).render_chat(conversation)
    # the system message's marker is the instruction boundary itself: one position, kept once
    assert prompt.cache_breakpoints[0] == prompt.instruction_boundary
    assert len(prompt.cache_breakpoints) == 3 and list(prompt.cache_breakpoints) == sorted(prompt.cache_breakpoints)
    conversation.append({"role": "assistant", "content": "At Belgrade.", "cache_control": dict(MARK)})
    conversation.append({"role": "user", "content": "And the source?", "cache_control": dict(MARK)})
    more = PromptRenderer(tokenizer).render_chat(conversation)
    assert len(more.cache_breakpoints) == 5
    # a marker on the last message stops before the generation prompt
    assert more.cache_breakpoints[-1] == len(rendered(tokenizer, split_cache_markers(conversation)[0]))
    assert more.cache_breakpoints[-1] < len(more.token_ids)


@pytest.mark.parametrize("template, conversation, reason", [
    (HISTORY_REWRITING_TEMPLATE, few_shot(marked=True), BoundaryRejection.NOT_A_PREFIX),
    (NEEDS_USER_TEMPLATE, [{"role": "system", "content": "Be brief.", "cache_control": MARK},
                           {"role": "user", "content": "Hi."}], BoundaryRejection.RENDER_ERROR),
], ids=["rewrites-earlier-turns", "raises-alone"])
def test_a_marker_that_cannot_be_verified_is_dropped_with_its_reason(tokenizer, template, conversation, reason):
    custom = copy.deepcopy(tokenizer)
    custom.chat_template = template
    prompt = PromptRenderer(custom).render_chat(conversation)
    assert prompt.cache_breakpoints == ()
    assert prompt.breakpoint_rejections == (reason.value,)
    assert prompt.token_ids == rendered(custom, split_cache_markers(conversation)[0], add_generation_prompt=True)


def test_the_history_rewriting_template_really_rewrites_the_marked_turn(tokenizer):
    """Guards the fixture: the conversation up to the last example, rendered alone, is not a
    prefix of the whole rendering (the example's answer becomes a placeholder)."""
    custom = copy.deepcopy(tokenizer)
    custom.chat_template = HISTORY_REWRITING_TEMPLATE
    full = rendered(custom, few_shot(marked=False), add_generation_prompt=True)
    head = rendered(custom, few_shot(marked=False)[:7])
    assert full[: len(head)] != head
    assert "(an earlier answer)" in custom.decode(full) and "shipping 2" in custom.decode(head)


@pytest.mark.parametrize("marker", [{"type": "persistent"}, {"type": "ephemeral", "ttl": "1h"}, "ephemeral"])
def test_the_renderer_refuses_other_markers(tokenizer, marker):
    conversation = [{"role": "user", "content": [{"type": "text", "text": "Hi.", "cache_control": marker}]}]
    with pytest.raises(InvalidRequestError) as refused:
        PromptRenderer(tokenizer).render_chat(conversation)
    assert refused.value.param == "messages" and "ephemeral" in str(refused.value)


def test_the_renderer_deployment_reads_the_typed_markers(tokenizer):
    """The Renderer deployment's class (no Serve), called with ChatMessage models as the
    ingress calls it for HTTP and handle requests alike, places the same breakpoints as the
    dicts give."""
    renderer = Renderer.func_or_class(str(DEFAULT_MODEL_DIR))
    messages = [ChatMessage(role="system", content="Answer from the document."),
                ChatMessage(role="user", content=[
                    TextContentPart(type="text", text=DOCUMENT, cache_control=CacheControl(type="ephemeral")),
                    TextContentPart(type="text", text="Where does the river end?")])]
    served = renderer.render_chat(messages)
    assert served == PromptRenderer(tokenizer).render_chat(document_question(marked=True))
    assert len(served.cache_breakpoints) == 1


# ---------------------------------------------------------------- the protocol and its limit


def chat_body(conversation: list[dict]) -> dict:
    return {"model": "m", "messages": conversation, "max_tokens": 4}


def test_the_protocol_accepts_ephemeral_markers_on_messages_and_text_parts():
    request = validated(ChatCompletionRequest, chat_body(document_question(marked=True) + few_shot(marked=True)))
    assert request.num_cache_markers() == 2
    assert request.messages[1].content[0].cache_control == CacheControl(type="ephemeral")
    dumped = [m.model_dump(exclude_none=True) for m in request.messages]
    assert dumped[1]["content"][0]["cache_control"] == MARK and "cache_control" not in dumped[0]


@pytest.mark.parametrize("where", ["message", "part"])
@pytest.mark.parametrize("marker", [{"type": "persistent"}, {"type": "ephemeral", "ttl": "1h"}, "ephemeral"])
def test_the_protocol_refuses_other_markers(where, marker):
    conversation = document_question(marked=False)
    if where == "message":
        conversation[1]["cache_control"] = marker
    else:
        conversation[1]["content"][0]["cache_control"] = marker
    with pytest.raises(APIError) as refused:
        validated(ChatCompletionRequest, chat_body(conversation))
    assert refused.value.status_code == 400 and refused.value.param.startswith("messages[1]")


def marked_messages(count: int) -> list[dict]:
    """`count` markers: one user message of count - 1 marked text parts, itself marked."""
    return [{"role": "user", "content": [{"type": "text", "text": f"part {i}", "cache_control": MARK}
                                         for i in range(count - 1)], "cache_control": MARK}]


def test_more_markers_than_the_limit_are_a_400():
    check_cache_markers(validated(ChatCompletionRequest, chat_body(marked_messages(4))), LIMITS)
    with pytest.raises(APIError) as refused:
        check_cache_markers(validated(ChatCompletionRequest, chat_body(marked_messages(5))), LIMITS)
    assert (refused.value.status_code, refused.value.param) == (400, "messages")
    assert "at most 4" in refused.value.message
    check_cache_markers(validated(ChatCompletionRequest, chat_body(marked_messages(5))),
                        dataclasses.replace(LIMITS, max_cache_breakpoints=5))


def test_refusals_reach_an_http_client_as_openai_error_bodies():
    """Over HTTP (a FastAPI app with the ingress's error handlers and its check): a marker of
    another type and a fifth marker each get 400 with {"error": {...}}; four markers pass."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        check_cache_markers(body, LIMITS)
        return {"markers": body.num_cache_markers()}

    wrong_type = document_question(marked=False)
    wrong_type[1]["content"][0]["cache_control"] = {"type": "persistent"}

    async def post_all():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.post("/v1/chat/completions", json=chat_body(c))
                    for c in (wrong_type, marked_messages(5), marked_messages(4))]

    wrong, too_many, fine = asyncio.run(post_all())
    for response in (wrong, too_many):
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
    assert "ephemeral" in wrong.json()["error"]["message"]
    assert too_many.json()["error"]["param"] == "messages"
    assert fine.status_code == 200 and fine.json() == {"markers": 4}


def test_the_ingress_metrics_count_dropped_markers_by_reason():
    recording = RecordingMetrics()
    metrics = RequestMetrics(create=recording)
    metrics.count_breakpoint_rejections(())
    metrics.count_breakpoint_rejections(("not_a_prefix", "not_a_prefix", "render_error"))
    assert recording.series(BREAKPOINT_REJECTIONS) == {
        (("reason", "not_a_prefix"),): 2, (("reason", "render_error"),): 1}
