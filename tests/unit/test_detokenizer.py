"""Incremental detokenizer and stop strings, on the embedded tokenizer (byte-level BPE)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from engine.core.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopStringMatcher,
    find_stop,
    stop_prefix_len,
)

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-granite-hybrid"

TEXTS = [
    "The river was quiet that morning, and the fog lay low over the water.",
    "def add(a, b):\n    return a + b  # sum\n\n\tprint({'x': [1, 2]})",
    "Le café était fermé; ¿Qué hora es? Grüße aus München. Coração, ação.",
    "東京は日本の首都です。北京是中国的首都。안녕하세요, 만나서 반갑습니다.",
    "Emoji: 😀🎉 👩‍💻 👨‍👩‍👧 👍🏽 🏳️‍🌈 ❤️ and a rare one 🦩🪐 then text.",
    "Mixed: naïve résumé — “quotes” … ∑ √2 ≈ 1.414 € ¥ 🐍 Ελληνικά Москва",
    "  leading spaces, trailing spaces   \n\n\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def chat_prompt(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "Say something."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def stream(tokenizer, prompt: list[int], ids: list[int]) -> tuple[list[str], str]:
    """Deltas of add_token, and the text flushed at the end."""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add_token(t) for t in ids]
    flushed = detok.flush()
    assert detok.text == "".join(deltas) + flushed
    return deltas, flushed


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_concatenates_to_decode(tokenizer, chat_prompt, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert expected == text
    for prompt in (chat_prompt, []):
        deltas, flushed = stream(tokenizer, prompt, ids)
        assert "".join(deltas) == expected
        assert flushed == ""
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_multibyte_characters_are_held_until_complete(tokenizer):
    # A rare emoji is not in the vocabulary as a whole: its 4 bytes span several tokens.
    text = "🦩🪐"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 2
    deltas, _ = stream(tokenizer, [], ids)
    assert "" in deltas  # some tokens completed no character
    assert [d for d in deltas if d] == ["🦩", "🪐"]


def test_special_tokens_produce_no_text(tokenizer, chat_prompt):
    eos = tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    start = tokenizer.convert_tokens_to_ids("<|start_of_role|>")
    ids = tokenizer.encode("Hello 東京", add_special_tokens=False)
    ids = [start] + ids[:2] + [eos] + ids[2:] + [eos]
    deltas, flushed = stream(tokenizer, chat_prompt, ids)
    assert "".join(deltas) + flushed == tokenizer.decode(ids, skip_special_tokens=True) == "Hello 東京"


def test_random_token_sequences_match_decode(tokenizer, chat_prompt):
    """Garbage such as a random model emits: partial and invalid UTF-8, special tokens."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        deltas, flushed = stream(tokenizer, chat_prompt, ids)
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) + flushed == expected
        if REPLACEMENT_CHAR not in expected:
            assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_flush_releases_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("ok 🦩", add_special_tokens=False)[:-1]  # the emoji's last byte is missing
    detok = IncrementalDetokenizer(tokenizer, [])
    emitted = "".join(detok.add_token(t) for t in ids)
    assert emitted.startswith("ok") and REPLACEMENT_CHAR not in emitted and detok.has_held_tokens
    flushed = detok.flush()
    assert flushed.endswith(REPLACEMENT_CHAR)
    assert emitted + flushed == tokenizer.decode(ids)
    assert detok.flush() == "" and not detok.has_held_tokens


def test_prompt_ending_inside_a_character(tokenizer):
    """A raw token-id prompt cut mid-character: output text is the decode of the output alone."""
    ids = tokenizer.encode("🦩🪐 done", add_special_tokens=False)
    prompt, output = ids[:1], ids[1:]
    assert tokenizer.decode(prompt).endswith(REPLACEMENT_CHAR)
    deltas, flushed = stream(tokenizer, prompt, output)
    assert "".join(deltas) + flushed == tokenizer.decode(output)


# ---------------------------------------------------------------- stop strings


def test_find_stop_only_counts_occurrences_touching_new_text():
    assert find_stop("abc STOP def", ("STOP",), 3) is None  # wholly in the old text
    assert find_stop("abc STOP def", ("STOP",), 6) == 4  # ends inside the new text
    assert find_stop("abc ST", ("STOP",), 2) is None
    assert find_stop("xxSTOP", ("STOP", "xS"), 4) == 1  # "xS" completes first
    assert find_stop("abcd", ("abcd", "bc"), 4) == 1  # first completed, not first started
    assert find_stop("xabcd", ("abcd", "xabcd"), 5) == 0  # same end: the longer one
    assert find_stop("anything", (), 8) is None


def test_stop_prefix_len():
    assert stop_prefix_len("hello S", ("STOP",)) == 1
    assert stop_prefix_len("hello STO", ("STOP",)) == 3
    assert stop_prefix_len("hello", ("STOP",)) == 0
    assert stop_prefix_len("a\n\n", ("\n\nUser:", "\n#")) == 2
    assert stop_prefix_len("abc", ()) == 0


def scan_reference(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """Character-by-character definition: stop where a stop string first completes."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(len(s) for s in done)], True
    return text, False


def feed_all(stops: tuple[str, ...], deltas: list[str]) -> tuple[str, bool, list[str]]:
    matcher = StopStringMatcher(stops)
    emitted = []
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        emitted.append(text)
        if stopped:
            return "".join(emitted), True, emitted
    emitted.append(matcher.flush())
    return "".join(emitted), False, emitted


def test_stop_string_split_across_tokens_is_cut_exactly(tokenizer):
    text = "The answer is 42.\n\nUser: and then more text 東京"
    stop = "\n\nUser:"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.add_token(t) for t in ids]
    assert stop not in deltas  # really split across tokens
    out, stopped, emitted = feed_all((stop,), deltas)
    assert stopped and out == "The answer is 42."
    assert "\n" not in out  # the stop's first characters were held, never emitted


@pytest.mark.parametrize("cut", range(1, 12))
def test_stop_string_cut_at_every_split_point(cut):
    text = "abc STOP xyz"
    deltas = [text[:cut], text[cut:]]
    out, stopped, emitted = feed_all(("STOP",), deltas)
    assert stopped and out == "abc "
    assert all("S" not in e for e in emitted)  # no part of the stop was ever emitted


def test_held_text_is_flushed_at_the_end():
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("abc ST") == ("abc ", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.flush() == "STO"
    assert matcher.flush() == ""


def test_no_stops_pass_through_and_after_stop_nothing():
    matcher = StopStringMatcher(())
    assert matcher.feed("abc") == ("abc", False) and matcher.flush() == ""
    matcher = StopStringMatcher(("x",))
    assert matcher.feed("axb") == ("a", True)
    assert matcher.feed("more") == ("", True) and matcher.flush() == ""
    with pytest.raises(ValueError):
        StopStringMatcher(("",))


def test_random_streams_match_character_scan():
    rng = random.Random(1)
    for _ in range(2000):
        text = "".join(rng.choice("ab\nS东") for _ in range(rng.randrange(0, 16)))
        stops = tuple(
            "".join(rng.choice("ab\nS东") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 4))
        )
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randrange(0, len(text) + 1)))
        deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        out, stopped, _ = feed_all(stops, deltas)
        assert (out, stopped) == scan_reference(text, stops), (text, stops, deltas)
