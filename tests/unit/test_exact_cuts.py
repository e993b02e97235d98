"""The renderer's fast path (docs/design.md section 3.2): a chat that starts with a remembered
rendering is tokenized only past it, and its ids are exactly those of apply_chat_template on
the whole chat, on many random chats, for tokenizers whose segments behave differently
(ByteLevel as the embedded model's, ByteLevel with add_prefix_space, Metaspace with
prepend_scheme "first"); the fast path is not taken where a cut is not provably exact (no
special token after the cut, an added token straddling it, an lstrip token at it), and the rule
is off for tokenizers it cannot prove (single_word tokens, split_special_tokens, a slow or
unknown tokenizer, one that fails the self-check). The memory is bounded; the fast path is
counted (RenderStats, RenderedPrompt.reused_tokens, the ingress's metrics); LocalPrompts
tokenizes long text on its render threads and short text inline.
"""

from __future__ import annotations

import asyncio
import copy
import random
import threading

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from deployments.prompts.cache_breakpoints import find_cache_breakpoints, split_cache_markers
from deployments.prompts.exact_cuts import CutRule
from deployments.prompts.instruction_boundary import find_instruction_boundary
from deployments.prompts.prefix_memory import RenderedPrefixes
from deployments.prompts.rendering import PromptRenderer
from engine.engine_config import DEFAULT_MODEL_DIR
from tests.unit.test_renderer_boundary import CONCATENATING_TEMPLATE, SYSTEM, USER

EPHEMERAL = {"type": "ephemeral"}
IM_TEMPLATE = ("{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n"
               "{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}"
               "{%- for p in m['content'] -%}{{ p['text'] }}{%- endfor -%}{%- endif -%}"
               "<|im_end|>\n{%- endfor -%}"
               "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello world, how are you today?",
          "über café 東京 policy refund shipping system user assistant", "a.b,c!? 1234 5678"] * 4
FRAGMENTS = ["Hello", " world", "  ", "\n", "\n\n", "über", "東京", "a.b", "<|", "|>", "<|start_of",
             "_role|>", "<|end_of_text|>", "<|start_of_role|>", "<|im_start|>", "<|im_end|>", "▁x",
             " ", "policy", "123", "fox", "ing", "!"]


def text(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 6)))


def random_chat(rng: random.Random, shared: list[str], part_markers: bool = True) -> list[dict]:
    """Leading instructions drawn from `shared` (so that later chats repeat earlier ones), then
    turns of random text, string or part contents, with random cache_control markers."""
    chat = [{"role": rng.choice(["system", "developer"]), "content": rng.choice(shared)}
            for _ in range(rng.choice([0, 1, 1, 1, 2]))]
    for turn in range(rng.randint(1, 4)):
        role = "user" if turn % 2 == 0 else "assistant"
        if part_markers and rng.random() < 0.3:
            content = [{"type": "text", "text": text(rng)} for _ in range(rng.randint(1, 3))]
            if rng.random() < 0.5:
                content[rng.randrange(len(content))]["cache_control"] = EPHEMERAL
            chat.append({"role": role, "content": content})
        else:
            chat.append({"role": role, "content": rng.choice(shared) if rng.random() < 0.2 else text(rng)})
    for message in chat:
        if rng.random() < 0.25:
            message["cache_control"] = EPHEMERAL
    return chat


def check_against_full_tokenization(tokenizer, seed: int, chats: int = 120, part_markers: bool = True) -> PromptRenderer:
    """Render `chats` random chats with one renderer (its memory filling as they go) and check
    each against the references without memory: apply_chat_template(tokenize=True) for the
    ids, find_instruction_boundary and find_cache_breakpoints for the positions."""
    rng = random.Random(seed)
    shared = [text(rng) + "instructions " + str(i) + text(rng) for i in range(4)]
    renderer = PromptRenderer(tokenizer, RenderedPrefixes(entries=6))
    for _ in range(chats):
        chat = random_chat(rng, shared, part_markers)
        plain, markers = split_cache_markers(chat)
        try:
            want = tuple(tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))
        except Exception:
            continue  # the template refuses it: test_prompt_rendering covers refusals
        got = renderer.render_chat(chat)
        assert got.token_ids == want, chat
        boundary = find_instruction_boundary(tokenizer, plain, want)
        assert (got.instruction_boundary, got.boundary_rejection) == (
            boundary.position, boundary.rejection.value if boundary.rejection else None), chat
        breakpoints = find_cache_breakpoints(tokenizer, plain, markers, want)
        assert got.cache_breakpoints == breakpoints.positions, chat
        assert got.breakpoint_rejections == tuple(r.value for r in breakpoints.rejections), chat
        assert 0 <= got.reused_tokens < len(want)
    assert renderer.stats.chats > chats // 2
    return renderer


def trained(pre_tokenizer, special: list[str], normalizer=None) -> PreTrainedTokenizerFast:
    """A small BPE trained here on CORPUS, with `special` as its special tokens and IM_TEMPLATE."""
    backend = Tokenizer(models.BPE(unk_token="[UNK]"))
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]", *special],
                                                            show_progress=False))
    backend.decoder = decoders.ByteLevel() if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else None
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=special[-1])
    tokenizer.chat_template = IM_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def embedded():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def with_added(tokenizer, token: AddedToken, template: str | None = None):
    custom = copy.deepcopy(tokenizer)
    custom.add_tokens([token], special_tokens=True)
    if template is not None:
        custom.chat_template = template
    return custom


@pytest.mark.parametrize("name", ["embedded", "metaspace-first", "byte-level-prefix-space"])
def test_the_fast_path_gives_the_ids_of_a_full_tokenization(embedded, name):
    """Random chats, with shared instructions and markers: every prompt equals its full
    tokenization, every position its verification without memory, and the fast path was taken
    (the rule holds for these tokenizers, so it is on)."""
    tokenizer = {
        "embedded": lambda: embedded,
        "metaspace-first": lambda: trained(pre_tokenizers.Metaspace(prepend_scheme="first"),
                                           ["<|im_start|>", "<|im_end|>"], normalizers.NFKC()),
        "byte-level-prefix-space": lambda: trained(pre_tokenizers.ByteLevel(add_prefix_space=True),
                                                   ["<|im_start|>", "<|im_end|>"]),
    }[name]()
    rule = CutRule.of(tokenizer)
    assert rule.enabled, rule.reason
    renderer = check_against_full_tokenization(tokenizer, seed=len(name))
    assert renderer.stats.reuses > 10 and renderer.stats.reused_tokens > 0


def test_no_fast_path_where_the_prefix_does_not_end_at_a_special_token(embedded):
    """A template that concatenates the messages: the instructions' text is a prefix of the
    prompt's, but BPE merges across the seam ("hel" + "pful"); the cut is refused, the chat is
    tokenized whole, and the ids are exact."""
    tokenizer = copy.deepcopy(embedded)
    tokenizer.chat_template = CONCATENATING_TEMPLATE
    renderer = PromptRenderer(tokenizer)
    for user in (USER, USER + " Again."):
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        got = renderer.render_chat(chat)
        assert got.token_ids == tuple(tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                                    tokenize=True, return_dict=False))
        assert got.reused_tokens == 0
    assert renderer.stats.reuses == 0
    text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
                                         add_generation_prompt=True, tokenize=False)
    assert not renderer.cuts.exact_at(text, len(SYSTEM))


def test_an_added_token_across_the_cut_refuses_it(embedded):
    """An added token "!<|end_of_text|>" starts before the edge at the end of a text part that
    ends in "!": tokenized whole it is one token, cut there it would be two. That cut is
    refused; random chats (whose texts end in "!" at times) stay exact."""
    tokenizer = with_added(embedded, AddedToken("!<|end_of_text|>", special=True, normalized=False))
    rule = CutRule.of(tokenizer)
    assert rule.enabled, rule.reason
    text = "<|start_of_role|>user<|end_of_role|>Look!<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"
    cut = text.index("<|end_of_text|>")
    pieces = tokenizer(text[:cut], add_special_tokens=False)["input_ids"] + tokenizer(
        text[cut:], add_special_tokens=False)["input_ids"]
    assert pieces != tokenizer(text, add_special_tokens=False)["input_ids"]  # the cut would be wrong
    assert not rule.exact_at(text, cut)
    assert rule.exact_at(text, text.index("<|start_of_role|>assistant"))  # other cuts stand
    chat = [{"role": "user", "content": [{"type": "text", "text": "Look!", "cache_control": EPHEMERAL}]},
            {"role": "assistant", "content": "Yes."}]
    renderer = PromptRenderer(tokenizer, cuts=rule)
    for _ in range(2):
        got = renderer.render_chat(copy.deepcopy(chat))
        want = tuple(tokenizer.apply_chat_template(split_cache_markers(chat)[0], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False))
        assert got.token_ids == want and got.reused_tokens == 0
        assert got.breakpoint_rejections == ("not_a_prefix",)
    check_against_full_tokenization(tokenizer, seed=7)


def test_an_lstrip_token_at_the_cut_refuses_it(embedded):
    """A special token with lstrip takes the whitespace before it: a cut before it is never
    exact, and chats whose messages start with it stay exact without the fast path."""
    template = ("{%- for m in messages -%}<|turn|>{{ m['role'] }}: {{ m['content'] }} {%- endfor -%}"
                "{%- if add_generation_prompt -%}<|turn|>assistant: {%- endif -%}")
    tokenizer = with_added(embedded, AddedToken("<|turn|>", special=True, normalized=False, lstrip=True), template)
    rule = CutRule.of(tokenizer)
    assert rule.enabled, rule.reason
    assert not rule.exact_at("a <|turn|>b", 2)
    renderer = check_against_full_tokenization(tokenizer, seed=11, part_markers=False)
    assert renderer.stats.reuses == 0


def test_cuts_by_hand(embedded):
    rule = CutRule.of(embedded)
    text = "ab<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>hi"
    edge = text.index("<|start_of_role|>")
    assert rule.exact_at(text, edge) and rule.exact_at(text, text.index("<|end_of_text|>"))
    for cut in (0, 1, edge - 1, edge + 1, len(text), len(text) + 3):
        assert not rule.exact_at(text, cut)  # inside text, inside a token, or no cut at all


@pytest.mark.parametrize("case", ["single-word", "split-special-tokens", "not-fast", "self-check"])
def test_the_rule_is_off_where_it_cannot_be_proved(embedded, case):
    """Off, with the reason, and the renderer then tokenizes every chat whole (exact, no reuse)."""
    if case == "single-word":
        tokenizer = with_added(embedded, AddedToken("<|word|>", special=True, normalized=False, single_word=True))
        reason = "single_word"
    elif case == "split-special-tokens":
        tokenizer = copy.deepcopy(embedded)
        tokenizer.split_special_tokens = True
        reason = "split_special_tokens"
    elif case == "not-fast":
        tokenizer = SlowStandIn(embedded)
        reason = "not a fast"
    else:
        tokenizer = LeadingSpace(embedded)
        reason = "self-check failed"
    rule = CutRule.of(tokenizer)
    assert not rule.enabled and reason in rule.reason
    renderer = PromptRenderer(tokenizer, cuts=rule)
    for user in ("Hi.", "Hello again."):
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        want = tuple(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
        got = renderer.render_chat(chat)
        assert got.token_ids == want and got.reused_tokens == 0
        if case != "split-special-tokens":  # split: the role markers are text, the seam merges
            assert got.instruction_boundary is not None
    assert renderer.stats.reuses == 0


class SlowStandIn:
    """A tokenizer without the Rust backend's object (as transformers' Python tokenizers)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __call__(self, text, **kwargs):
        return self._tokenizer(text, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        return self._tokenizer.apply_chat_template(*args, **kwargs)


class LeadingSpace(SlowStandIn):
    """Structurally a fast tokenizer, but its encode puts a space before every text it is given
    (a position-dependent quirk the structure does not show): cutting is not exact, and the
    self-check finds it."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.split_special_tokens = False

    def __call__(self, text, **kwargs):
        return self._tokenizer(" " + text, **kwargs)

    def apply_chat_template(self, conversation, tokenize=True, return_dict=True, **kwargs):
        rendered = self._tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
        return self(rendered, add_special_tokens=False)["input_ids"] if tokenize else rendered


def test_the_memory_is_bounded():
    memory = RenderedPrefixes(entries=3, tokens=10)
    for i in range(6):
        memory.put(f"t{i}", (i, i))
        assert len(memory) <= 3 and memory.held_tokens <= 10
    assert [memory.get(f"t{i}") for i in range(6)] == [None, None, None, (3, 3), (4, 4), (5, 5)]
    memory.get("t3")  # now the most recently used
    memory.put("long", tuple(range(6)))  # 6 + 2 + 2 + 2 > 10: the least recently used go
    assert memory.get("t4") is None and memory.get("t3") == (3, 3) and memory.held_tokens <= 10
    memory.put("too long", tuple(range(11)))  # longer than the budget alone: not remembered
    assert memory.get("too long") is None
    assert memory.hits == 5 and memory.misses == 5
    with pytest.raises(ValueError):
        RenderedPrefixes(entries=0)


def test_a_renderer_keeps_its_memory_bounded(embedded):
    renderer = PromptRenderer(embedded, RenderedPrefixes(entries=4))
    for i in range(12):
        renderer.render_chat([{"role": "system", "content": f"System {i}. " * 20, "cache_control": EPHEMERAL},
                              {"role": "user", "content": "Hi."}])
        assert len(renderer.instruction_prefixes) <= 4 and len(renderer.breakpoint_prefixes) <= 64
    assert renderer.stats.reuses == 0 and renderer.stats.chats == 12


def test_the_fast_path_is_counted_in_the_metrics(embedded):
    from deployments.metrics import RENDER_PROMPT_TOKENS, RENDER_SECONDS, RequestMetrics
    from tests.unit.recording_metrics import RecordingMetrics

    recording = RecordingMetrics()
    metrics = RequestMetrics(create=recording)
    renderer = PromptRenderer(embedded)
    chats = [[{"role": "system", "content": SYSTEM * 20}, {"role": "user", "content": q}] for q in ("Hi.", "Yo.")]
    prompts = [renderer.render_chat(chat) for chat in chats]
    for prompt in prompts:
        metrics.record_render("chat", 0.002, prompt)
    metrics.record_render("completion", 0.001, renderer.tokenize_prompt([5, 6]))
    boundary = prompts[1].instruction_boundary
    assert prompts[1].reused_tokens == boundary and renderer.stats.reuses == 1
    assert recording.series(RENDER_PROMPT_TOKENS) == {
        (("source", "reused"),): boundary,
        (("source", "tokenized"),): sum(len(p.token_ids) for p in prompts) - boundary}
    assert recording.series(RENDER_SECONDS) == {(("route", "chat"),): [0.002, 0.002],
                                                (("route", "completion"),): [0.001]}


def test_local_prompts_tokenize_long_text_on_the_render_threads(embedded):
    """A long chat seen for the first time is tokenized on a render thread; the same
    instructions again (only a short rest left to tokenize) and a short chat, inline."""
    from deployments.frontend import LocalPrompts
    from deployments.http.protocol import ChatMessage

    renderer = PromptRenderer(embedded)
    threads = []
    finish = renderer.finish_chat

    def recording_finish(draft):
        threads.append(threading.current_thread().name)
        return finish(draft)

    renderer.finish_chat = recording_finish
    prompts = LocalPrompts(renderer)
    long_system = "The policy says refunds are reviewed. " * 200  # 7,600 characters

    def chat(system: str, user: str) -> list[ChatMessage]:
        return [ChatMessage(role="system", content=system), ChatMessage(role="user", content=user)]

    async def render_all():
        return [await prompts.render_chat(chat(long_system, "First?")),
                await prompts.render_chat(chat(long_system, "Second?")),
                await prompts.render_chat(chat("Short.", "Hi."))]

    got = asyncio.run(render_all())
    main = threading.current_thread().name
    assert threads[0].startswith("hybrid-serve-render") and threads[1:] == [main, main]
    assert got[1].reused_tokens == got[1].instruction_boundary > 0
