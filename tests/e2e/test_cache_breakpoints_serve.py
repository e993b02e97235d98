"""Cache breakpoints through the whole application: a `cache_control` marker on a document's
content part, sent over HTTP (the openai client) and through the Python handle API (typed
request objects), is restored by the next question as `cached_tokens`; a sixth marker past the
limit is a 400 on both paths. The position is computed here, independently of the server, with
the tokenizer's own chat template.
"""

from __future__ import annotations

import openai
import pytest

from deployments.http.errors import APIError
from deployments.http.protocol import CacheControl, ChatCompletionRequest, ChatMessage, TextContentPart

MODEL_NAME = "hybrid-serve-tiny"
DOCUMENT = ("Aisle seven holds the power tools; cordless drills sit on the top shelf, their batteries "
            "below, and the service desk at its end repairs what is under warranty. ") * 3
MARK = {"type": "ephemeral"}


def messages(question: str, markers: int = 1) -> list[dict]:
    """The document part, then `question`; the document marked unless markers is 0, and
    markers - 1 marked parts more between them."""
    document = {"type": "text", "text": DOCUMENT, **({"cache_control": MARK} if markers else {})}
    parts = [document] + [{"type": "text", "text": f"Note {i}.", "cache_control": MARK}
                          for i in range(max(0, markers - 1))]
    return [{"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def breakpoint_position(tokenizer) -> int:
    head = [{"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": [{"type": "text", "text": DOCUMENT}]}]
    return len(tokenizer.apply_chat_template(head, continue_final_message=True, tokenize=True,
                                             return_dict=False))


def test_a_marked_document_is_restored_over_http_and_through_the_handle(
        client, app_handle, render_ids, breakpoint_position, new_salt):
    salt = new_salt()

    def ask(question: str):
        return client.chat.completions.create(
            model=MODEL_NAME, messages=messages(question), max_tokens=4, temperature=0,
            extra_body={"ignore_eos": True, "cache_salt": salt})

    first = ask("Where are the drill batteries?")
    second = ask("Who repairs broken tools?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == breakpoint_position
    assert breakpoint_position < second.usage.prompt_tokens == len(render_ids(
        messages("Who repairs broken tools?", markers=0)))

    typed = ChatCompletionRequest(
        messages=[ChatMessage(role="system", content="Answer from the document."),
                  ChatMessage(role="user", content=[
                      TextContentPart(type="text", text=DOCUMENT, cache_control=CacheControl(type="ephemeral")),
                      TextContentPart(type="text", text="Which aisle has the drills?")])],
        max_tokens=4, temperature=0, ignore_eos=True, cache_salt=salt)
    response = app_handle.chat.remote(typed).result()
    assert response.usage.prompt_tokens_details.cached_tokens == breakpoint_position


def test_more_markers_than_the_limit_are_refused_on_both_paths(client, app_handle):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=messages("Hi?", markers=5), max_tokens=2)
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == "messages" and "at most 4" in refused.value.body["message"]
    with pytest.raises(APIError) as handle_refused:
        app_handle.chat.remote(ChatCompletionRequest(messages=messages("Hi?", markers=5), max_tokens=2)).result()
    assert handle_refused.value.status_code == 400
