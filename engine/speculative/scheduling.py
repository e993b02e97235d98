"""The scheduler's side of speculative decoding: which requests draft, how a verification
chunk's result becomes output tokens, and which position's state the worker keeps.

A verification chunk is a decode of k + 1 tokens: the request's last known token t0 then k
drafts d1..dk (ScheduledChunk.num_draft_tokens = k). The runner returns the argmax g0..gk at
each position. Greedy acceptance: d(i+1) is accepted while it equals g(i); with a drafts
accepted the new tokens are g0..ga (the accepted drafts and the bonus token g(a)), exactly
what a + 1 plain greedy decode steps give. Token-level stops (EOS, stop token ids, max_tokens,
max_model_len) are judged token by token and drop what follows (`accept`); a stop string,
judged on text by the output processor, drops what follows through `trim`. Only positions
that are kept count: num_computed_tokens advances by the tokens kept, KV blocks past them are
freed, and the worker is told (CommitOp) to keep the state after the last kept computed
position; the request's own state slot is not written before that.

Which requests speculate: greedy ones that do not ask for logits, once they have an output
token and min_tokens is met (the sampler's min_tokens masking would change the argmax), in
steps that start with at most max_batch_size running requests (`begin_step`; above it a
verification step costs more than the plain decode steps it saves, and every request decodes
plainly), and, where the speculation policy turned it on, while the request's own acceptance
pays at the step's batch size (engine/speculative/policy.py AcceptanceGate). Drafting needs
every token known, so such a request waits while a token of its is pending (`waits`) once
its next chunk may draft: with async_scheduling it has one step in flight at a time; the
others keep the overlap, and so does it below min_tokens. A request whose verification chunk
is in flight waits in any step, since where its next token goes depends on how many drafts
are accepted.

Drafters, one interface (Drafter.draft) for both kinds: the n-gram drafter computes its drafts
here from the request's tokens; the MTP drafter runs on the worker, which needs the hidden rows
(engine/speculative/mtp.py): a chunk that samples asks for a proposal
(ScheduledChunk.propose_drafts), the worker returns it with the step's output (a DraftProposal
that says which tokens it follows), `receive` keeps it, and `drafts` hands it to the drafter
only if it follows exactly the request's tokens.

Pure Python, like the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.interfaces.request import Request, RequestStatus, token_stop_reason
from engine.interfaces.step_io import CommitOp, DraftProposal, ScheduledChunk
from engine.speculative.policy import AcceptanceGate


class Drafter(Protocol):
    """Where drafts come from. on_worker: the worker proposes them after each chunk that
    samples (ScheduledChunk.propose_drafts), and `draft` is handed the proposal."""

    name: str
    on_worker: bool

    def draft(self, request: Request, proposal: DraftProposal | None, num_drafts: int) -> tuple[int, ...]:
        """Up to num_drafts tokens to follow all of `request`'s tokens (() for none).
        proposal: what the worker proposed to follow exactly those tokens, or None (none
        asked, or none that follows them). Mutates nothing."""
        ...


@dataclass(frozen=True)
class WorkerProposals:
    """The drafter whose drafts the worker proposes (`name`: what it runs there, "mtp"): hands
    out the proposal's first num_drafts tokens."""

    name: str
    on_worker: bool = True

    def draft(self, request: Request, proposal: DraftProposal | None, num_drafts: int) -> tuple[int, ...]:
        return proposal.token_ids[:num_drafts] if proposal is not None else ()


@dataclass
class SpeculationStats:
    """Counters since start (exported as metrics), for one drafter.

    acceptance_lengths[a]: verification chunks in which a drafts were accepted (a = 0..k).
    draft_tokens_accepted counts by the greedy rule; those dropped after at a stop are also
    in draft_tokens_trimmed. steps_over_batch_cap: steps that started with more running
    requests than max_batch_size, in which no request drafted. depth_proposed[d - 1] and
    depth_accepted[d - 1]: verification chunks that carried a draft at depth d (d = 1..k),
    and those in which it was accepted."""

    drafter: str = ""
    verification_chunks: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    draft_tokens_trimmed: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    steps_over_batch_cap: int = 0
    depth_proposed: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)

    def copy(self) -> SpeculationStats:
        return SpeculationStats(self.drafter, self.verification_chunks, self.draft_tokens_proposed,
                                self.draft_tokens_accepted, self.draft_tokens_trimmed,
                                list(self.acceptance_lengths), self.steps_over_batch_cap,
                                list(self.depth_proposed), list(self.depth_accepted))

    @property
    def draft_tokens_rejected(self) -> int:
        """Proposed drafts the greedy rule rejected (the first wrong one and every one after)."""
        return self.draft_tokens_proposed - self.draft_tokens_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts per proposed draft (0.0 before any)."""
        return self.draft_tokens_accepted / self.draft_tokens_proposed if self.draft_tokens_proposed else 0.0

    def acceptance_by_depth(self) -> list[float]:
        """For d = 1..k, the share of drafts at depth d that were accepted (0.0 before any)."""
        return [accepted / proposed if proposed else 0.0
                for proposed, accepted in zip(self.depth_proposed, self.depth_accepted)]

    def count_chunk(self, num_drafts: int, accepted: int) -> None:
        """One verification chunk of num_drafts drafts settled with `accepted` of them kept by
        the greedy rule."""
        self.verification_chunks += 1
        self.draft_tokens_proposed += num_drafts
        self.draft_tokens_accepted += accepted
        self.acceptance_lengths[accepted] += 1
        for depth in range(num_drafts):
            self.depth_proposed[depth] += 1
            self.depth_accepted[depth] += int(depth < accepted)


def _min_tokens_met(request: Request, sampling: int = 0) -> bool:
    """Whether `request` has min_tokens output tokens once its pending ones and `sampling`
    more are known: only then may a chunk of it draft (the sampler's min_tokens masking would
    change the argmax the drafts are checked against)."""
    return request.num_output_tokens + request.num_pending_tokens + sampling >= request.sampling.min_tokens


def greedy_accept(drafts: Sequence[int], verified: Sequence[int]) -> int:
    """How many drafts the greedy rule accepts: drafts[i] is accepted while it equals
    verified[i], the argmax at the position before it (len(verified) = len(drafts) + 1)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == verified[accepted]:
        accepted += 1
    return accepted


class SpeculativeDecoding:
    """num_speculative_tokens: the most drafts a verification chunk carries (0: off, and then
    every method is a no-op). max_batch_size: the most running requests a step may start with
    and still draft (None: no limit). Holds the commits not yet handed to a step, the requests
    whose verification chunk is in flight, and the counters."""

    def __init__(self, num_speculative_tokens: int = 0, drafter: Drafter | None = None,
                 max_batch_size: int | None = None, gate: AcceptanceGate | None = None) -> None:
        if num_speculative_tokens and drafter is None:
            raise ValueError("num_speculative_tokens > 0 needs a drafter")
        self.num_speculative_tokens = num_speculative_tokens
        self.drafter = drafter
        self.max_batch_size = max_batch_size
        self.gate = gate  # the policy's (engine/speculative/policy.py): None, every request drafts
        self._drafting = bool(num_speculative_tokens)  # this step's, set by begin_step
        self._verifying: set[str] = set()  # request ids whose verification chunk is in flight
        self.stats = SpeculationStats(
            drafter=drafter.name if drafter is not None else "",
            acceptance_lengths=[0] * (num_speculative_tokens + 1),
            depth_proposed=[0] * num_speculative_tokens, depth_accepted=[0] * num_speculative_tokens,
        )
        self._commits: dict[str, CommitOp] = {}  # request id -> position to keep, for the next step
        self._proposals: dict[str, DraftProposal] = {}  # request id -> the worker's last proposal

    def begin_step(self, num_running: int) -> None:
        """Call at the start of each schedule(), with the number of running requests (those
        that cannot run in it counted too): the step drafts only if it is at most
        max_batch_size. Requests it admits do not change that."""
        within = self.max_batch_size is None or num_running <= self.max_batch_size
        self._drafting = bool(self.num_speculative_tokens) and within
        if self.gate is not None:
            self.gate.begin_step(num_running)

    def end_step(self, has_chunks: bool) -> None:
        """Call at the end of each schedule(): a step with chunks that began over
        max_batch_size counts in steps_over_batch_cap (a schedule with nothing to run is no
        step)."""
        if has_chunks and self.num_speculative_tokens and not self._drafting:
            self.stats.steps_over_batch_cap += 1

    def verification_scheduled(self, request_id: str) -> None:
        """A verification chunk of `request_id` was made: it counts as verifying (`waits`)
        until `accept` settles it (a preempted request's chunk still comes back), `finished`,
        or `forget` with in_flight_lost."""
        self._verifying.add(request_id)

    def speculates(self, request: Request) -> bool:
        """Whether `request` drafts in this step (module docstring; with the policy's gate,
        only while its acceptance pays)."""
        params = request.sampling
        drafts = self._drafting and params.greedy and not params.return_logits
        return drafts and (self.gate is None or self.gate.allows(request.request_id))

    def waits(self, request: Request) -> bool:
        """A request with a token pending is not scheduled (nor admitted) until that token is
        known if its verification chunk is in flight, or if it speculates in this step and
        its next chunk may draft (min_tokens met once the pending tokens are known: below it,
        `drafts` gives none, and the request keeps async scheduling's overlap)."""
        if not request.num_pending_tokens:
            return False
        if request.request_id in self._verifying:
            return True
        return _min_tokens_met(request) and self.speculates(request)

    def proposals_wanted(self, request: Request) -> int:
        """ScheduledChunk.propose_drafts of a chunk of `request` that samples (call before the
        chunk counts its token pending): how many drafts the worker should propose after it.
        0: none, a drafter of the scheduler's, or the token it samples leaves the request below
        min_tokens (its next chunk drafts nothing)."""
        on_worker = self.drafter is not None and self.drafter.on_worker
        wanted = on_worker and _min_tokens_met(request, sampling=1) and self.speculates(request)
        return self.num_speculative_tokens if wanted else 0

    def receive(self, request: Request, proposal: DraftProposal | None) -> None:
        """Keep the worker's `proposal` for `request` (after the step that asked for it settled
        and left the request running), replacing the one before; None keeps nothing."""
        if proposal is not None:
            self._proposals[request.request_id] = proposal
        else:
            self._proposals.pop(request.request_id, None)

    def drafts(self, request: Request, budget: int, max_model_len: int) -> tuple[int, ...]:
        """The drafts of `request`'s next chunk, when it is a decode (every token but the last
        computed, none pending) of a speculating request: at most num_speculative_tokens,
        budget - 1, and as many as leave room for the bonus token under max_tokens and
        max_model_len. () otherwise. Uses up the worker's proposal for the request."""
        proposal = self._proposals.pop(request.request_id, None)
        if proposal is not None and proposal.follows != request.num_tokens:
            proposal = None  # it follows other tokens: a stale one
        if not self.speculates(request) or request.num_pending_tokens:
            return ()
        if request.num_output_tokens == 0 or not _min_tokens_met(request):
            return ()
        if request.num_computed_tokens != request.num_tokens - 1:
            return ()
        limit = min(
            self.num_speculative_tokens,
            budget - 1,
            request.sampling.max_tokens - request.num_output_tokens - 1,
            max_model_len - request.num_tokens - 1,
        )
        if limit <= 0:
            return ()
        return self.drafter.draft(request, proposal, limit)

    def accept(self, request: Request, chunk: ScheduledChunk, verified: Sequence[int], max_model_len: int) -> int:
        """The verification `chunk` of `request` came back with the argmax `verified` at each
        position: resolve its pending token into the accepted drafts and the bonus token, one
        by one, stopping after the first that ends the request by a token-level rule (what
        follows is dropped). A running request's num_computed_tokens then stands just before
        its last token, and the commit of the last computed position kept is recorded for the
        next step. Returns the number of tokens kept (>= 1). Mutates the request and the
        counters; the caller ends the request if token_stop_reason says so."""
        self._verifying.discard(request.request_id)
        drafts = chunk.token_ids[1:]
        accepted = greedy_accept(drafts, verified)
        self.stats.count_chunk(len(drafts), accepted)
        if self.gate is not None:
            self.gate.observe(request.request_id, accepted)
        request.num_pending_tokens -= 1
        kept = 0
        for token in verified[: accepted + 1]:
            request.output_token_ids.append(token)
            kept += 1
            if token_stop_reason(request, max_model_len) is not None:
                break
        self.stats.draft_tokens_trimmed += accepted + 1 - kept
        if request.status is RequestStatus.RUNNING:  # else preempted meanwhile: recomputed later
            request.num_computed_tokens = chunk.start_position + kept
            self._commits[request.request_id] = CommitOp(request.request_id, request.state_slot, kept - 1)
        return kept

    def trim(self, request: Request, num_output_tokens: int) -> None:
        """Drop `request`'s output tokens past the first num_output_tokens (a stop string
        ended its text there, inside the tokens its last verification kept), with the computed
        positions and the commit that went with them. Call before the request finishes, so
        its response checkpoint covers exactly the tokens kept. A request preempted while that
        verification ran (`accept` recorded no commit; it computes from 0 again) loses the
        tokens alone. Mutates the request."""
        dropped = request.num_output_tokens - num_output_tokens
        if dropped <= 0:
            return
        self.stats.draft_tokens_trimmed += dropped
        if request.status is not RequestStatus.RUNNING:
            del request.output_token_ids[num_output_tokens:]
            return
        commit = self._commits.get(request.request_id)
        assert commit is not None and commit.index >= dropped and not request.num_pending_tokens, (
            f"{request.request_id}: only tokens of its last verification can be trimmed")
        del request.output_token_ids[num_output_tokens:]
        request.num_computed_tokens -= dropped
        self._commits[request.request_id] = CommitOp(commit.request_id, commit.state_slot, commit.index - dropped)

    def forget(self, request_id: str, *, in_flight_lost: bool = False) -> None:
        """`request_id` lost its state slot (preempted, requeued) before its commit was
        handed to a step: nothing to keep, and its proposal is dropped (it is computed again).
        A verification chunk of it in flight still counts (`waits`) until `accept` settles it,
        unless in_flight_lost (its steps were abandoned: no output of theirs will come)."""
        self._commits.pop(request_id, None)
        self._proposals.pop(request_id, None)
        if in_flight_lost:
            self._verifying.discard(request_id)

    def finished(self, request_id: str) -> None:
        """`request_id` ended: its proposal is dropped (its commit is still handed out)."""
        self._proposals.pop(request_id, None)
        self._verifying.discard(request_id)
        if self.gate is not None:
            self.gate.forget(request_id)

    def take_commits(self) -> tuple[CommitOp, ...]:
        """The commits recorded since the last call, for the step being scheduled (applied at
        its start, before its captures), and forgets them."""
        commits, self._commits = tuple(self._commits.values()), {}
        return commits
