"""Where a rendered chat prompt can be cut in two and each side tokenized alone with exactly the
ids of the whole (docs/design.md section 3.2): the rule, proved for the tokenizer at hand or not
used.

A Hugging Face fast tokenizer (the Rust `tokenizers` library, which transformers'
TokenizersBackend calls) encodes a text in this order (tokenizers' added_vocabulary.rs
`extract_and_normalize`, tokenizer/mod.rs `encode_single_sequence`):

  1. split out the added tokens that are not normalized (chat templates' special tokens:
     `<|start_of_role|>`, `<|im_start|>`, ...), matched leftmost-longest over the raw text;
  2. normalize each remaining segment on its own, split out the normalized added tokens in it;
  3. pre-tokenize each segment on its own, run the model (BPE, Unigram, ...) on each piece;
  4. concatenate; with add_special_tokens false (what apply_chat_template passes) the
     post-processor adds no token.

So the ids of text[:cut] + the ids of text[cut:] are the ids of the text wherever step 1 puts
a segment edge at `cut` in all three texts, and the later steps treat a segment the same
wherever it sits. `CutRule.exact_at` accepts a cut only where:

  - an added token T that step 1 matches starts at `cut` (the longest one starting there, as
    leftmost-longest matching picks), T is not normalized, has no lstrip (which would take
    whitespace from before the cut into T) and starts with no whitespace;
  - no occurrence of any added token straddles `cut`. Then the occurrences in the text are those
    of the two sides, and leftmost-longest matching, which depends on nothing else, picks in
    each side what it picks there in the whole: the segments of the whole are those of the
    sides (rstrip and lstrip only extend a match over whitespace, which cannot cross T).

and it is used for a tokenizer (`CutRule.of`) only where:

  - it is a fast tokenizer (transformers exposes `backend_tokenizer`) whose special tokens are
    split out (`split_special_tokens` false: otherwise step 1 skips them);
  - no added token is `single_word` (its match depends on the characters around it, which may
    lie across the cut);
  - its normalizer and pre-tokenizer are built-in types (a custom Python one could read
    anything). Of the built-in ones only Metaspace with prepend_scheme "first" looks at where a
    segment sits (its original offset 0); the segment after T never starts at 0 in either text,
    and the segments before the cut have the same offsets in both;
  - a self-check passes: a probe chat in the tokenizer's own template, cut at every message
    edge the rule accepts, gives the ids of apply_chat_template, and so do probe texts around
    every added token (letters, spaces, newlines, partial special tokens on either side).

Anything else: the rule is off for that tokenizer (`CutRule.reason` says why) and every prompt
is tokenized whole, as without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# The built-in components of tokenizers (pre_tokenizers/mod.rs, normalizers/mod.rs): each
# treats a segment by its text alone, Metaspace "first" aside (see the module docstring).
PRE_TOKENIZERS = frozenset({"BertPreTokenizer", "ByteLevel", "CharDelimiterSplit", "Metaspace",
                            "Whitespace", "Sequence", "Split", "Punctuation", "WhitespaceSplit",
                            "Digits", "UnicodeScripts", "FixedLength"})
NORMALIZERS = frozenset({"BertNormalizer", "Strip", "StripAccents", "NFC", "NFD", "NFKC", "NFKD",
                         "Sequence", "Lowercase", "Nmt", "Precompiled", "Replace", "Prepend",
                         "ByteLevel"})
PROBE_TOKENS = 4
PROBE_FILLERS = ("Hello world", " leading space", "trailing space ", "\n", "two\n\nlines",
                 "  ", "x", "über café 東京", "a.b,c!?", "<|", "|>", "<", "1234 5678")


def encode_text(tokenizer: Any, text: str) -> tuple[int, ...]:
    """`text`'s ids exactly as apply_chat_template(tokenize=True) makes them from its rendering
    (the same call and arguments)."""
    ids = tokenizer(text, padding=False, truncation=False, max_length=None, add_special_tokens=False,
                    return_tensors=None)["input_ids"]
    return tuple(map(int, ids))


@dataclass(frozen=True)
class _Added:
    content: str
    lstrip: bool
    normalized: bool


@dataclass(frozen=True)
class CutRule:
    """The exact-cut rule for one tokenizer. enabled false: no cut is ever exact, `reason` says
    why. Immutable, thread-safe."""

    enabled: bool
    reason: str | None = None
    # added tokens by first character, longest first (the leftmost-longest choice at a cut)
    _starting: dict[str, tuple[_Added, ...]] = field(default_factory=dict, repr=False)
    # a proper, non-empty prefix of an added token -> the rests that complete it
    _completions: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    _longest: int = 0

    @classmethod
    def off(cls, reason: str) -> CutRule:
        return cls(False, reason)

    @classmethod
    def of(cls, tokenizer: Any) -> CutRule:
        """The rule for `tokenizer`, or an off rule with the reason (the module docstring's
        conditions, then the self-check). Never raises."""
        try:
            rule = cls._from_structure(tokenizer)
            if rule.enabled:
                problem = _self_check(tokenizer, rule)
                if problem is not None:
                    return cls.off(f"self-check failed: {problem}")
            return rule
        except Exception as exc:  # an unexpected tokenizer object: fail closed
            return cls.off(f"could not inspect the tokenizer: {type(exc).__name__}: {exc}")

    @classmethod
    def _from_structure(cls, tokenizer: Any) -> CutRule:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return cls.off("not a fast (tokenizers) tokenizer")
        if getattr(tokenizer, "split_special_tokens", False) or backend.encode_special_tokens:
            return cls.off("special tokens are not split out (split_special_tokens)")
        for name, component, known in (("pre-tokenizer", backend.pre_tokenizer, PRE_TOKENIZERS),
                                       ("normalizer", backend.normalizer, NORMALIZERS)):
            unknown = _unknown_types(component, known)
            if unknown:
                return cls.off(f"{name} of unknown type {unknown}")
        added = []
        for token in backend.get_added_tokens_decoder().values():
            if token.single_word:
                return cls.off(f"added token {token.content!r} is single_word")
            if token.content:
                added.append(_Added(token.content, bool(token.lstrip), bool(token.normalized)))
        if not added:
            return cls.off("the tokenizer has no added tokens to cut at")
        starting: dict[str, list[_Added]] = {}
        completions: dict[str, set[str]] = {}
        for token in added:
            starting.setdefault(token.content[0], []).append(token)
            for k in range(1, len(token.content)):
                completions.setdefault(token.content[:k], set()).add(token.content[k:])
        return cls(True, None,
                   {c: tuple(sorted(ts, key=lambda t: -len(t.content))) for c, ts in starting.items()},
                   {p: tuple(rests) for p, rests in completions.items()},
                   max(len(t.content) for t in added))

    def exact_at(self, text: str, cut: int) -> bool:
        """Whether ids(text[:cut]) + ids(text[cut:]) == ids(text) is guaranteed (the module
        docstring's conditions). False whenever it is not provably so."""
        if not self.enabled or not 0 < cut < len(text):
            return False
        for token in self._starting.get(text[cut], ()):
            if text.startswith(token.content, cut):
                break  # the longest added token starting at the cut
        else:
            return False
        if token.normalized or token.lstrip or token.content[0].isspace():
            return False
        for k in range(1, min(self._longest, cut + 1)):
            for rest in self._completions.get(text[cut - k:cut], ()):
                if text.startswith(rest, cut):
                    return False  # an added token straddles the cut
        return True


def _unknown_types(component: Any, known: frozenset[str]) -> str | None:
    """The first type in `component`'s serialized form (nested Sequences included) that is not
    in `known`; None when all are (or there is no component)."""
    if component is None:
        return None
    try:
        state = json.loads(component.__getstate__())
    except Exception:
        return type(component).__name__  # a custom component serializes to nothing readable
    stack = [state]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or node.get("type") not in known:
            return str(node.get("type") if isinstance(node, dict) else node)
        for key in ("pretokenizers", "normalizers"):
            stack.extend(node.get(key) or ())
    return None


def _self_check(tokenizer: Any, rule: CutRule) -> str | None:
    """None when the probes tokenize exactly under the rule; else the first that did not. The
    probes: a chat in the tokenizer's own template cut at every edge the rule accepts, and each
    added token the template writes and PROBE_TOKENS others between every two PROBE_FILLERS,
    cut before the token where the rule accepts it. No probe the rule accepts: off too."""
    added = sorted({t.content for ts in rule._starting.values() for t in ts})
    conversation = [{"role": "system", "content": "You are terse. "},
                    {"role": "user", "content": " Hello,\nworld"},
                    {"role": "assistant", "content": "Hi there"},
                    {"role": "user", "content": "über café 東京 <|"}]
    probes: list[tuple[str, int]] = []
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        whole = tuple(map(int, tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False)))
    except Exception:  # the template refuses this chat: the token probes stand alone
        text = None
    if text is not None:
        if encode_text(tokenizer, text) != whole:
            return "encode_text differs from apply_chat_template"
        probes += [(text, cut) for cut in range(1, len(text)) if rule.exact_at(text, cut)]
    written = [token for token in added if text is not None and token in text]
    tokens = written + [token for token in added if token not in written][:PROBE_TOKENS]
    probes += [(before + token + after, len(before)) for token in tokens
               for before in PROBE_FILLERS for after in PROBE_FILLERS
               if rule.exact_at(before + token + after, len(before))]
    if not probes:
        return "no probe could be cut"
    if text is not None:  # the chat through encode_text, the renderer's own call
        for cut in range(1, len(text)):
            if rule.exact_at(text, cut) and encode_text(tokenizer, text[:cut]) + encode_text(tokenizer, text[cut:]) != whole:
                return f"cutting {text!r} at {cut}"
    wholes = _encode_batch(tokenizer, [text for text, _ in probes])
    lefts = _encode_batch(tokenizer, [text[:cut] for text, cut in probes])
    rights = _encode_batch(tokenizer, [text[cut:] for text, cut in probes])
    for (text, cut), whole, left, right in zip(probes, wholes, lefts, rights):
        if left + right != whole:
            return f"cutting {text!r} at {cut}"
    return None


def _encode_batch(tokenizer: Any, texts: list[str]) -> list[tuple[int, ...]]:
    """Each text's ids from the Rust tokenizer, in one call (what encode_text runs, without
    transformers' per-call overhead: the chat probe checks encode_text itself)."""
    return [tuple(e.ids) for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
