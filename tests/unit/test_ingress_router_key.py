"""The lean path's ingress request router reads the HTTP body HAProxy forwards into the same
token ids, instruction boundary and cache salt the LLM server replica will compute
(deployments/cluster/ingress_router.py prompt_key against deployments/frontend.py's rendering),
and any body it cannot read into no key at all (power-of-two routing), never an error."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from deployments.cluster.ingress_router import prompt_key
from deployments.cluster.prompt_key import PromptKey
from deployments.cluster.router import RecentPlacements, generation_request
from deployments.http.protocol import ChatCompletionRequest
from deployments.prompts.rendering import PromptRenderer
from engine.engine_config import EngineConfig


@pytest.fixture(scope="module")
def renderer() -> PromptRenderer:
    return PromptRenderer.from_pretrained(EngineConfig().model_dir)


CHAT = {"model": "hybrid-serve-tiny", "max_tokens": 8, "cache_salt": "team-a",
        "messages": [{"role": "system", "content": "You are a terse pirate."},
                     {"role": "developer", "content": "Never say arr."},
                     {"role": "user", "content": "Where is the treasure?"}]}


def test_a_chat_body_gives_the_replicas_token_ids_boundary_and_salt(renderer):
    key = prompt_key(json.dumps(CHAT).encode(), renderer)
    # what the replica renders: the validated messages, fields as the API dumps them
    messages = ChatCompletionRequest.model_validate(CHAT).messages
    rendered = PromptRenderer.from_pretrained(EngineConfig().model_dir).render_chat(
        [m.model_dump(exclude_none=True) for m in messages])
    assert key == PromptKey(rendered.token_ids, "team-a", rendered.instruction_boundary)
    assert 0 < key.instruction_boundary < len(key.prompt_token_ids)
    # requests sharing the instructions share a placement key; other instructions do not
    other = {**CHAT, "messages": CHAT["messages"][:2] + [{"role": "user", "content": "Why?"}]}
    namespace = ("model", "team-a")
    assert RecentPlacements.key(namespace, key) == RecentPlacements.key(
        namespace, prompt_key(json.dumps(other).encode(), renderer))


def test_a_completion_body_gives_its_prompts_ids(renderer):
    by_ids = prompt_key(json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}).encode(), renderer)
    assert by_ids == PromptKey((5, 6, 7), None, None)
    text = prompt_key(json.dumps({"prompt": "hello there"}).encode(), renderer)
    assert text.prompt_token_ids == renderer.tokenize_prompt("hello there").token_ids


@pytest.mark.parametrize("body", [
    b"", b"not json", b"[1, 2]", b'{"model": "x"}',
    json.dumps(CHAT).encode()[:40],  # truncated past HAProxy's buffer
    json.dumps({**CHAT, "messages": []}).encode(),  # the replica answers 400
    json.dumps({**CHAT, "temperature": -1}).encode(),
    json.dumps({"prompt": [10 ** 9]}).encode(),  # beyond the vocabulary: the renderer refuses
    "\xff".encode("latin-1"),
], ids=["empty", "not-json", "array", "no-prompt", "truncated", "no-messages", "bad-field",
        "bad-token-id", "not-utf8"])
def test_a_body_it_cannot_read_routes_without_a_key(renderer, body):
    assert prompt_key(body, renderer) is None


def test_the_checkpoint_aware_router_finds_the_key_among_the_pick_arguments():
    key = PromptKey((1, 2, 3), None, 2)
    assert generation_request(SimpleNamespace(args=[key], kwargs={})) is key
