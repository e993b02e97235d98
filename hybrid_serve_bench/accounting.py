"""Shareable tokens: the denominator of the token hit rate.

Definition (the same for every workload and server): a request's shareable tokens are the
longest prefix of its prompt token ids (the chat template's rendering with the generation
prompt, by the served model's tokenizer: tokens.py) that is also a prefix of a token sequence
sent earlier in the same pass: an earlier request's prompt, or an earlier prompt followed by
the reply that came back (the conversation rendered with that reply as its last message). It is
what a perfect prefix cache could restore, at any token, not only at message boundaries: a
cache can only restore tokens that some request computed before, so the tokens a server
restores never exceed the shareable ones. stats.summarize_pass asserts that per pass.

Per pass rather than per request: which of two concurrent requests with the same system prompt
computes it and which restores it depends on the order they reach the server, not the order
they were sent. The sum over a pass is the same in any order (every request's prompt minus the
tokens it adds to a token trie of the pass's sequences; the trie does not depend on the order),
so restored <= shareable holds for the pass's sums whatever the arrival order.

Per workload this is:
  shared-instructions  the system prompt (and the few template tokens that open the next user
                       message), for every request but the first of each system prompt;
  multi-turn           the whole history before the new user message, from turn 2 on (the
                       previous prompt and its reply: a response checkpoint restores up to the
                       reply's last computed token, and a reply whose text re-tokenizes
                       differently restores less);
  agent-loop           the developer prompt for each agent's first turn (but the first agent's),
                       then the previous turn's prompt, generation prompt included (the next
                       turn's assistant message opens with it);
  few-shot             the system prompt and all examples (an instruction checkpoint covers only
                       the leading system/developer messages: the examples are user/assistant
                       turns, so that slot reaches a part of this), and the template tokens that
                       open the next user message;
  few-shot-marked      the same: the marker on the last example's answer lets a breakpoint
                       checkpoint cover all but those few opening tokens;
  document-qa(-marked) for every request but the first of its document, the system prompt and the
                       document (the marked part's end), and the first words of the question
                       part that every question starts with;
  no-sharing           the first template tokens at most (the role marker of the system message).
"""

from __future__ import annotations

from hybrid_serve_bench.tokens import TokenCounter


class TokenTrie:
    """The token sequences inserted so far, as a trie of dicts (token id -> child)."""

    def __init__(self) -> None:
        self._root: dict = {}

    def longest_prefix(self, ids: tuple[int, ...]) -> int:
        """How many leading tokens of `ids` are a prefix of some inserted sequence."""
        node, depth = self._root, 0
        for token in ids:
            node = node.get(token)
            if node is None:
                break
            depth += 1
        return depth

    def insert(self, ids: tuple[int, ...]) -> None:
        node = self._root
        for token in ids:
            node = node.setdefault(token, {})


class ShareableTracker:
    """Remembers the token sequences one pass has sent (and received). Mutated by record_sent
    and record_reply; one tracker per (target, workload, pass) when cache salts keep passes apart
    (runner.py), else one per target."""

    def __init__(self, counter: TokenCounter) -> None:
        self._counter = counter
        self._seen = TokenTrie()

    def prompt_ids(self, messages: list[dict]) -> tuple[int, ...]:
        """The request's prompt as the server computes it (generation prompt included)."""
        return self._counter.chat_ids(messages, add_generation_prompt=True)

    def shareable_tokens(self, prompt_ids: tuple[int, ...]) -> int:
        """The longest prefix of `prompt_ids` that an earlier sequence of the pass began with."""
        return self._seen.longest_prefix(prompt_ids)

    def record_sent(self, prompt_ids: tuple[int, ...]) -> None:
        """A request with this prompt was sent: its prefixes are shareable from now on."""
        self._seen.insert(prompt_ids)

    def record_reply(self, messages: list[dict], reply: str) -> None:
        """The reply to `messages` came back: the conversation with that reply is shareable too."""
        self._seen.insert(self._counter.chat_ids([*messages, {"role": "assistant", "content": reply}],
                                                 add_generation_prompt=False))
