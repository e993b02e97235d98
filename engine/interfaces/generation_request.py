"""What a client asks the engine for: one frozen object from the API edge to the scheduler.

The ingress builds a GenerationRequest from the renderer's output and the request's sampling
fields; the LLM server replica, its AsyncLLMEngine and `LLMEngine.add_request` pass the same
object on unchanged (docs/design.md section 6). The scheduler's mutable
`engine.interfaces.request.Request` is made from it when the engine accepts it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.interfaces.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One generation request, as the edge validated it.

    request_id: unique among the engine's unfinished requests.
    prompt_token_ids: the whole prompt (chat template and generation prompt included).
    sampling: how to pick tokens and when to stop.
    instruction_boundary: the renderer-verified end of the leading system/developer messages
        (0 < boundary < len(prompt_token_ids)), where an instruction checkpoint may be
        captured; None when there is none (docs/design.md section 3).
    cache_breakpoints: the renderer-verified prompt positions of the client's cache_control
        markers (each 0 < position < len(prompt_token_ids)), where breakpoint checkpoints may be
        captured; empty when there are none (docs/design.md section 3).
    cache_salt: checkpoints are shared only between requests with the same salt (and model);
        None or "" is the shared namespace.
    tenant: who owns the checkpoints the request captures, for the checkpoint budget's fair
        share (cache/checkpoint_ledger.py); the API key's tenant id, "" without keys. (The
        ingress also puts it in front of cache_salt, which keeps tenants' namespaces apart.)
    arrival_time: when the edge received the request (time.time(), before rendering); the
        ingress measures the time to first token from it (deployments/metrics.py). The
        scheduler orders requests by when the engine accepted them, not by this clock, which
        may differ between hosts.
    pause_positions: prompt positions at which a prefill chunk must end, so the hidden row
        there can be read (engine-level tools and tests; the API never sets it).

    The engine checks what depends on the model (token id range, context length) in
    add_request and raises InvalidRequestError there.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    instruction_boundary: int | None = None
    cache_breakpoints: tuple[int, ...] = ()
    cache_salt: str | None = None
    tenant: str = ""
    arrival_time: float = field(default_factory=time.time)
    pause_positions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # tuples of plain ints, so the object pickles small and compares by value. A prompt that
        # is a tuple already is kept as given (the renderer's: converting 8,000 ids again took
        # 0.3 ms on the event loop before the request's submission); add_request refuses one
        # whose items are not ints. Any other sequence (a list, an array) is converted here.
        if type(self.prompt_token_ids) is not tuple:
            object.__setattr__(self, "prompt_token_ids", tuple(map(int, self.prompt_token_ids)))
        object.__setattr__(self, "pause_positions", tuple(int(p) for p in self.pause_positions))
        object.__setattr__(self, "cache_breakpoints", tuple(int(p) for p in self.cache_breakpoints))
