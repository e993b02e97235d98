"""POST /v1/completions: string and token-id prompts, full and streamed."""

from __future__ import annotations

import uuid

MODEL_NAME = "hybrid-serve-tiny"
PROMPT = "The quick brown fox"


def test_string_prompt_usage_and_text(client, tokenizer):
    # a salt of its own: nothing another test left (test_handle_api sends this prompt too) restores
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=9, temperature=0,
                                         extra_body={"ignore_eos": True, "cache_salt": uuid.uuid4().hex})
    assert response.object == "text_completion"
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(tokenizer.encode(PROMPT, add_special_tokens=False))
    assert response.usage.completion_tokens == 9
    assert response.usage.prompt_tokens_details.cached_tokens == 0


def test_token_id_prompt_equals_string_prompt(client, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_stream_matches_full_and_reports_usage(client, tokenizer):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == len(tokenizer.encode(PROMPT, add_special_tokens=False))
    assert chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text


def test_default_max_tokens_fills_the_context(client, tokenizer):
    """No max_tokens: generation may run up to max_model_len (512 in the e2e config)."""
    ids = tokenizer.encode(PROMPT, add_special_tokens=False) * 100
    ids = ids[: 512 - 6]
    response = client.completions.create(model=MODEL_NAME, prompt=ids, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == 506
    assert response.usage.completion_tokens == 6
