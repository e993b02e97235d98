"""Shareable tokens: the denominator of the token hit rate.

Definition (the same for every workload and server): a request's shareable tokens are the
tokens of the longest run of its leading messages that an earlier request of the same pass
already sent, either as leading messages of its own or followed by its reply, rendered as a
chat prompt prefix (TokenCounter.prefix_tokens). It is what a perfect cache that cuts prompts
at message boundaries could restore. "Earlier" is the order requests were sent in, so a
request whose prefix is still being prefilled by a concurrent one counts it as shareable too.

Per workload this is:
  shared-instructions  the system prompt, for every request but the first of each system
                       prompt (exactly the instruction boundary, when the server verifies one);
  multi-turn           the whole history before the new user message, from turn 2 on (the
                       previous prompt and its reply: a response checkpoint can restore up to
                       the reply's last token, so a few template tokens after it stay computed,
                       and a reply whose text re-tokenizes differently restores less);
  agent-loop           the developer prompt for each agent's first turn (but the first
                       agent's), then the previous turn's messages (a prompt checkpoint covers
                       them plus the generation prompt's tokens);
  few-shot             the system prompt and all examples (an instruction checkpoint covers only
                       the leading system/developer messages: the examples are user/assistant
                       turns, so that slot reaches a part of this);
  no-sharing           nothing.
"""

from __future__ import annotations

import hashlib
import json

from hybrid_serve_bench.tokens import TokenCounter


def _prefix_keys(messages: list[dict]) -> list[bytes]:
    """keys[k-1] identifies messages[:k] (a running hash, so all prefixes cost O(total size))."""
    keys, digest = [], hashlib.sha256()
    for m in messages:
        digest.update(json.dumps([m.get("role"), m.get("content")], ensure_ascii=False).encode())
        digest.update(b"\0")
        keys.append(digest.copy().digest())
    return keys


class ShareableTracker:
    """Remembers the message prefixes one pass has sent (and received). Mutated by `record`;
    one tracker per (target, workload, pass): what another server saw is not shareable here."""

    def __init__(self, counter: TokenCounter) -> None:
        self._counter = counter
        self._seen: set[bytes] = set()

    def shared_messages(self, messages: list[dict]) -> int:
        """How many leading messages of `messages` an earlier request sent (0 when none)."""
        shared = 0
        for k, key in enumerate(_prefix_keys(messages), start=1):
            if key not in self._seen:
                break
            shared = k
        return shared

    def shareable_tokens(self, messages: list[dict]) -> int:
        """Tokens of the shared leading messages, rendered as a prompt prefix."""
        shared = self.shared_messages(messages)
        return self._counter.prefix_tokens(messages[:shared]) if shared else 0

    def record_sent(self, messages: list[dict]) -> None:
        """A request with `messages` was sent: its prefixes are shareable from now on."""
        self._seen.update(_prefix_keys(messages))

    def record_reply(self, messages: list[dict], reply: str) -> None:
        """The reply to `messages` came back: messages + the reply is shareable too."""
        self._seen.update(_prefix_keys([*messages, {"role": "assistant", "content": reply}]))
