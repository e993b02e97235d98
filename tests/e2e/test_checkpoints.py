"""Request-boundary checkpoints through the OpenAI API: instruction reuse, multi-turn, repeat,
namespaces, the checkpoint_slots switch, and what GET /metrics answers.

Every test sends its own fresh cache_salt, so checkpoints of other tests can never hit it and
`cached_tokens` is exactly what this test's own requests left behind. Boundaries are computed
here, independently of the server, with the tokenizer and the model's chat template.
"""

from __future__ import annotations

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL_NAME = "hybrid-serve-tiny"
BLOCK_SIZE = 16  # E2E_CONFIG.engine.block_size
NO_INSTRUCTION_APP = "hybrid-serve-e2e-no-instruction"
NO_INSTRUCTION_PREFIX = "/no-instruction"

SYSTEM = ("You are a careful assistant for a hardware store. Answer in one short sentence, "
          "name the aisle when you know it, and never invent prices.")
USER_1 = "Where do I find wood screws?"
USER_2 = "Do you sell cordless drills, and which brand lasts longest in daily use?"


def chat(client: openai.OpenAI, messages, salt: str, max_tokens: int = 6):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True, "cache_salt": salt},
    )


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def instruction_boundary(tokenizer) -> int:
    """len(system S rendered alone, no generation prompt): the boundary the renderer must find."""
    ids = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}],
                                        add_generation_prompt=False, tokenize=True, return_dict=False)
    return len(ids)


def test_instruction_reuse_restores_exactly_the_system_prompt(
        client, app_handle, render_ids, instruction_boundary, new_salt):
    salt = new_salt()
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_1}]
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_2}]
    # The case the block-aligned prefix caches cannot serve: nothing here is block aligned.
    assert instruction_boundary % BLOCK_SIZE != 0
    assert len(render_ids(first)) % BLOCK_SIZE != 0 and len(render_ids(second)) % BLOCK_SIZE != 0

    assert cached(chat(client, first, salt)) == 0
    before = app_handle.engine_stats.remote().result().scheduler
    response = chat(client, second, salt)
    after = app_handle.engine_stats.remote().result().scheduler

    assert response.usage.prompt_tokens == len(render_ids(second))
    assert cached(response) == instruction_boundary
    assert after.prompt_tokens_restored - before.prompt_tokens_restored == instruction_boundary
    assert (after.prompt_tokens_computed - before.prompt_tokens_computed
            == response.usage.prompt_tokens - instruction_boundary)


def test_multi_turn_restores_at_least_the_previous_prompt(client, new_salt):
    salt = new_salt()
    turn_1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_1}]
    reply = chat(client, turn_1, salt, max_tokens=8)
    turn_2 = turn_1 + [{"role": "assistant", "content": reply.choices[0].message.content},
                       {"role": "user", "content": "And nails?"}]
    response = chat(client, turn_2, salt)
    assert reply.usage.prompt_tokens <= cached(response) < response.usage.prompt_tokens


def test_repeat_restores_the_whole_prompt_and_gives_the_same_output(client, app_handle, new_salt):
    salt = new_salt()
    messages = [{"role": "user", "content": "Count slowly from one to ten, please."}]
    first = chat(client, messages, salt, max_tokens=10)
    computed_before = app_handle.engine_stats.remote().result().scheduler.prompt_tokens_computed
    second = chat(client, messages, salt, max_tokens=10)
    computed_after = app_handle.engine_stats.remote().result().scheduler.prompt_tokens_computed

    assert cached(first) == 0
    assert cached(second) == second.usage.prompt_tokens == first.usage.prompt_tokens
    assert computed_after == computed_before  # no prefill at all
    assert second.choices[0].message.content == first.choices[0].message.content


def test_streamed_usage_reports_cached_tokens(client, new_salt):
    salt = new_salt()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_1}]
    chat(client, messages, salt)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache_salt": salt},
    )
    usage = list(stream)[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens


def test_namespaces_never_share_checkpoints(client, new_salt):
    salt_a, salt_b = new_salt(), new_salt()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_2}]
    chat(client, messages, salt_a)
    assert cached(chat(client, messages, salt_a)) > 0
    assert cached(chat(client, messages, salt_b)) == 0


def test_completions_take_a_cache_salt(client, new_salt):
    salt_a, salt_b = new_salt(), new_salt()
    prompt = list(range(100, 141))

    def complete(salt: str):
        return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3,
                                         temperature=0, extra_body={"cache_salt": salt})

    first, second, other = complete(salt_a), complete(salt_a), complete(salt_b)
    assert cached(first) == 0 and cached(other) == 0
    assert cached(second) == second.usage.prompt_tokens == len(prompt)
    assert second.choices[0].text == first.choices[0].text == other.choices[0].text


def test_empty_cache_salt_is_rejected(http):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "cache_salt": ""}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "cache_salt" in response.text


@pytest.fixture(scope="module")
def no_instruction_client(deploy_variant):
    """A second small app in the same Serve instance with checkpoint_slots [prompt, response]."""
    return deploy_variant(NO_INSTRUCTION_APP, NO_INSTRUCTION_PREFIX,
                          engine={"checkpoint_slots": ("prompt", "response")}, worker_num_cpus=0.5)


def test_without_the_instruction_slot_the_pair_gets_nothing(no_instruction_client, new_salt):
    salt = new_salt()
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_1}]
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_2}]
    assert cached(chat(no_instruction_client, first, salt)) == 0
    assert cached(chat(no_instruction_client, second, salt)) == 0
    # the other slots still work in that app
    assert cached(chat(no_instruction_client, second, salt)) > 0


def test_metrics_route_serves_no_numbers_and_says_where_they_are(http):
    """GET /metrics is a valid Prometheus exposition without samples: one replica's numbers are
    not the application's, so the metrics go through Ray's metrics agent instead
    (tests/metrics/test_ray_metrics.py checks what it exports)."""
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert [family for family in text_string_to_metric_families(response.text)
            if family.samples] == []
    assert "ray_hybrid_serve_" in response.text and "metrics-export-port" in response.text
