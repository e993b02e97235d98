"""The benchmark's workloads: pure functions from a seed and sizes to conversations.

A workload is a tuple of Conversations; a conversation is a tuple of Turns, each one chat request.
A turn's `new_messages` are appended to the conversation's history before its request is sent;
with `keep_reply` the server's reply is appended (as an assistant message) after it, so the next
turn resends it. Single-request workloads are conversations of one turn.

  shared-instructions  S system prompts of L tokens; request i uses system prompt i % S and a
                       distinct user message of 50-500 tokens (user_tokens).
  multi-turn           C conversations of T turns that resend the whole history, the server's
                       replies included (user messages of turn_user_tokens).
  agent-loop           one long developer prompt with tool definitions, shared by A agents; each
                       agent has its own task, then turns that append a tool call (assistant) and
                       its result. Tool calls and results travel as text in assistant and user
                       messages: hybrid-serve (like many servers) refuses role "tool" and the
                       `tools` field, and text works on every server.
  few-shot             one system prompt plus E fixed example exchanges (user/assistant), then a
                       distinct question per request.
  few-shot-marked      few-shot's very messages, with `cache_control: {"type": "ephemeral"}` on
                       the last example's answer: the client says where the shared part ends.
  document-qa          D documents of document_tokens; request i asks a distinct question about
                       document i % D, in one user message of two text parts (the document, then
                       the question), after a short system prompt.
  document-qa-marked   document-qa's very messages, with cache_control on the document part.
  no-sharing           the control: every request has its own system prompt of L tokens and its
                       own user message; nothing is shared.

Same seed and sizes, same messages (the counter decides text lengths, so use the same counter).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace

from hybrid_serve_bench.tokens import TokenCounter

WORKLOAD_KINDS = ("shared-instructions", "multi-turn", "agent-loop", "few-shot", "few-shot-marked",
                  "document-qa", "document-qa-marked", "no-sharing")
CACHE_CONTROL = {"type": "ephemeral"}  # the marker of a client-directed checkpoint

WORDS = ("model state token layer cache prefix request answer system user policy rule tool data "
         "query budget latency memory block chunk stream batch order review audit account "
         "customer invoice refund shipping warranty product store region language format "
         "always never briefly politely exactly only when unless before after because report "
         "ticket status priority owner team release build deploy config error retry limit "
         "quota backup archive search filter summary detail section table column value").split()

TOOLS = ("search_orders", "get_invoice", "issue_refund", "update_ticket", "lookup_customer",
         "check_inventory", "schedule_callback", "send_email")


@dataclass(frozen=True)
class Sizes:
    """Every size a workload takes (the CLI's flags). Token counts are as the counter counts."""

    seed: int = 0
    systems: int = 4                       # S: shared system prompts
    instruction_tokens: int = 2000         # L: tokens of each system (shared-instructions, no-sharing)
    requests: int = 48                     # requests of shared-instructions, few-shot, no-sharing
    user_tokens: tuple[int, int] = (50, 500)
    conversations: int = 8                 # C (multi-turn)
    turns: int = 4                         # T (multi-turn)
    turn_user_tokens: tuple[int, int] = (50, 200)
    agents: int = 6                        # A (agent-loop)
    agent_turns: int = 5                   # turns per agent, the first one the task
    developer_tokens: int = 1500
    tool_result_tokens: tuple[int, int] = (50, 200)
    examples: int = 6                      # E (few-shot)
    example_tokens: int = 120
    documents: int = 4                     # D (document-qa)
    document_tokens: int = 2000


@dataclass(frozen=True)
class Turn:
    new_messages: tuple[dict, ...]
    keep_reply: bool = False


@dataclass(frozen=True)
class Conversation:
    key: str
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Workload:
    """name: unique in a run (a length sweep names shared-instructions@L); kind: one of
    WORKLOAD_KINDS; params: the sizes that shaped it (written to the result JSON)."""

    name: str
    kind: str
    conversations: tuple[Conversation, ...]
    params: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


def make_text(rng: random.Random, n_tokens: int, counter: TokenCounter, lead: str = "") -> str:
    """Pseudo-English of at most n_tokens tokens (as `counter` counts), as close as whole words
    allow: draws more words than needed, then keeps the longest prefix that fits (binary search,
    so the counter runs O(log n) times). `lead` starts the text and makes it unique."""
    words = [rng.choice(WORDS) for _ in range(2 * n_tokens + 8)]
    head = [lead] if lead else []
    lo, hi = 0, len(words)  # the largest k with count(head + words[:k]) <= n_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if counter.count(" ".join(head + words[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(head + words[:lo])


def _tokens(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


def shared_instructions(sizes: Sizes, counter: TokenCounter, name: str = "shared-instructions") -> Workload:
    rng = random.Random(f"{sizes.seed}/shared-instructions/{sizes.instruction_tokens}")
    systems = [make_text(rng, sizes.instruction_tokens, counter, f"System policy {s}:")
               for s in range(sizes.systems)]
    conversations = tuple(
        Conversation(f"{name}/{i}", (Turn((
            {"role": "system", "content": systems[i % sizes.systems]},
            {"role": "user", "content": make_text(rng, _tokens(rng, sizes.user_tokens), counter,
                                                  f"Question {i}:")}),),))
        for i in range(sizes.requests))
    return Workload(name, "shared-instructions", conversations,
                    {"systems": sizes.systems, "instruction_tokens": sizes.instruction_tokens,
                     "requests": sizes.requests, "user_tokens": list(sizes.user_tokens)})


def multi_turn(sizes: Sizes, counter: TokenCounter) -> Workload:
    rng = random.Random(f"{sizes.seed}/multi-turn")
    conversations = tuple(
        Conversation(f"multi-turn/{c}", tuple(
            Turn(({"role": "user", "content": make_text(rng, _tokens(rng, sizes.turn_user_tokens),
                                                        counter, f"Chat {c} turn {t}:")},),
                 keep_reply=True)
            for t in range(sizes.turns)))
        for c in range(sizes.conversations))
    return Workload("multi-turn", "multi-turn", conversations,
                    {"conversations": sizes.conversations, "turns": sizes.turns,
                     "turn_user_tokens": list(sizes.turn_user_tokens)})


def _tool_definitions() -> str:
    return "\n".join(json.dumps({"name": tool, "description": f"{tool.replace('_', ' ')} by id",
                                 "parameters": {"type": "object",
                                                "properties": {"id": {"type": "string"}},
                                                "required": ["id"]}})
                     for tool in TOOLS)


def agent_loop(sizes: Sizes, counter: TokenCounter) -> Workload:
    rng = random.Random(f"{sizes.seed}/agent-loop")
    tools = _tool_definitions()
    rules = make_text(rng, max(1, sizes.developer_tokens - counter.count(tools)), counter,
                      "You are an operations agent. Call one tool per turn as JSON. Rules:")
    developer = {"role": "developer", "content": f"{rules}\nTools:\n{tools}"}
    conversations = []
    for a in range(sizes.agents):
        task = {"role": "user", "content": make_text(rng, _tokens(rng, sizes.turn_user_tokens),
                                                     counter, f"Task {a}:")}
        turns = [Turn((developer, task))]
        for t in range(1, sizes.agent_turns):
            call = {"tool": rng.choice(TOOLS), "arguments": {"id": f"A{a}-{t}-{rng.randrange(10**6)}"}}
            result = make_text(rng, _tokens(rng, sizes.tool_result_tokens), counter,
                               f"Tool result for call {a}.{t}:")
            turns.append(Turn(({"role": "assistant", "content": json.dumps(call)},
                               {"role": "user", "content": result})))
        conversations.append(Conversation(f"agent-loop/{a}", tuple(turns)))
    return Workload("agent-loop", "agent-loop", tuple(conversations),
                    {"agents": sizes.agents, "agent_turns": sizes.agent_turns,
                     "developer_tokens": sizes.developer_tokens,
                     "tool_result_tokens": list(sizes.tool_result_tokens)})


def few_shot(sizes: Sizes, counter: TokenCounter, marked: bool = False) -> Workload:
    """few-shot, or few-shot-marked (the same messages, the last example's answer marked)."""
    rng = random.Random(f"{sizes.seed}/few-shot")
    head: list[dict] = [{"role": "system", "content": make_text(rng, 200, counter,
                                                                "Classify each request. Examples follow.")}]
    for e in range(sizes.examples):
        head.append({"role": "user", "content": make_text(rng, sizes.example_tokens, counter,
                                                          f"Example {e}:")})
        head.append({"role": "assistant", "content": f"label {rng.choice(WORDS)}"})
    if marked:
        head[-1] = {**head[-1], "cache_control": CACHE_CONTROL}
    name = "few-shot-marked" if marked else "few-shot"
    conversations = tuple(
        Conversation(f"{name}/{i}", (Turn((*head, {"role": "user", "content": make_text(
            rng, _tokens(rng, sizes.user_tokens), counter, f"Question {i}:")}),),))
        for i in range(sizes.requests))
    return Workload(name, name, conversations,
                    {"examples": sizes.examples, "example_tokens": sizes.example_tokens,
                     "requests": sizes.requests, "user_tokens": list(sizes.user_tokens)})


def document_qa(sizes: Sizes, counter: TokenCounter, marked: bool = False) -> Workload:
    """document-qa, or document-qa-marked (the same messages, the document part marked)."""
    rng = random.Random(f"{sizes.seed}/document-qa")
    system = {"role": "system", "content": "Answer the question from the document, briefly."}
    documents = [make_text(rng, sizes.document_tokens, counter, f"Document {d}:")
                 for d in range(sizes.documents)]
    name = "document-qa-marked" if marked else "document-qa"
    conversations = []
    for i in range(sizes.requests):
        document = {"type": "text", "text": documents[i % sizes.documents],
                    **({"cache_control": CACHE_CONTROL} if marked else {})}
        question = {"type": "text", "text": make_text(rng, _tokens(rng, sizes.user_tokens), counter,
                                                      f"Question {i}:")}
        conversations.append(Conversation(f"{name}/{i}", (Turn((
            system, {"role": "user", "content": [document, question]}),),)))
    return Workload(name, name, tuple(conversations),
                    {"documents": sizes.documents, "document_tokens": sizes.document_tokens,
                     "requests": sizes.requests, "user_tokens": list(sizes.user_tokens)})


def no_sharing(sizes: Sizes, counter: TokenCounter) -> Workload:
    rng = random.Random(f"{sizes.seed}/no-sharing")
    conversations = tuple(
        Conversation(f"no-sharing/{i}", (Turn((
            {"role": "system", "content": make_text(rng, sizes.instruction_tokens, counter,
                                                    f"Unique policy {i}:")},
            {"role": "user", "content": make_text(rng, _tokens(rng, sizes.user_tokens), counter,
                                                  f"Question {i}:")}),),))
        for i in range(sizes.requests))
    return Workload("no-sharing", "no-sharing", conversations,
                    {"instruction_tokens": sizes.instruction_tokens, "requests": sizes.requests,
                     "user_tokens": list(sizes.user_tokens)})


def build_workloads(kinds: list[str], sizes: Sizes, counter: TokenCounter,
                    instruction_lengths: list[int] | None = None) -> list[Workload]:
    """The workloads of `kinds`, in that order. shared-instructions is built once per length of
    `instruction_lengths` (default: sizes.instruction_tokens), named shared-instructions@L when
    there are several."""
    workloads = []
    for kind in kinds:
        if kind == "shared-instructions":
            lengths = instruction_lengths or [sizes.instruction_tokens]
            for length in lengths:
                name = f"shared-instructions@{length}" if len(lengths) > 1 else "shared-instructions"
                workloads.append(shared_instructions(
                    replace(sizes, instruction_tokens=length), counter, name))
        elif kind == "multi-turn":
            workloads.append(multi_turn(sizes, counter))
        elif kind == "agent-loop":
            workloads.append(agent_loop(sizes, counter))
        elif kind in ("few-shot", "few-shot-marked"):
            workloads.append(few_shot(sizes, counter, marked=kind.endswith("-marked")))
        elif kind in ("document-qa", "document-qa-marked"):
            workloads.append(document_qa(sizes, counter, marked=kind.endswith("-marked")))
        elif kind == "no-sharing":
            workloads.append(no_sharing(sizes, counter))
        else:
            raise ValueError(f"unknown workload {kind!r}; choose from {list(WORKLOAD_KINDS)}")
    return workloads

