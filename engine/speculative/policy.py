"""Whether speculative decoding is on when the configuration leaves it unset
(num_speculative_tokens None), with which drafter, how many drafts and up to which batch size,
and, while it runs, which requests keep drafting.

The choice is made from measured figures, never assumed ones:

- step costs (step_costs.json beside this module, written by `benchmarks/spec_decode.py
  --policy-table`): for a model (its config.json's architecture and size, and the dtype) on a
  CUDA GPU, the wall time of a plain decode step and of a verification step of k drafts at
  each measured batch size, and what drafting adds to a step (the MTP head's passes);
- the acceptance at each draft depth d (the share of drafts at depth d that the greedy rule
  accepts): the MTP head's own, measured when it was trained (its model dir's mtp_head.json,
  scripts/train_mtp_head.py), else the step-cost entry's figure for the model's head.

With a share a_d accepted at depth d, a verification step of k drafts yields E_k = 1 + a_1 +
... + a_k tokens (the bonus token and the accepted drafts) for the cost of a speculating step
(verification plus drafting) instead of E_k plain decode steps, so it wins at batch b when
E_k decode(b) > verify(k, b) + draft(k, b). The policy takes the k that wins most at batch 1,
caps drafting at the largest measured batch size where it still wins, and speculation stays
off where nothing wins: on the CPU (no figures), for a model without figures or without an MTP
head, and with the n-gram drafter, whose acceptance depends on whether the outputs copy the
prompt (users turn it on themselves).

While it runs, AcceptanceGate adapts to the acceptance observed: each request keeps an
exponential moving average of the tokens its verification steps yield, and stops drafting
when it falls below the break-even of the current batch size (verify + draft over decode: the
tokens a step must yield to pay); it probes again after PROBE_STEPS steps without drafting.

Pure Python apart from reading the figures; tested with given costs and acceptance
(tests/unit/test_speculation_policy.py).
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.engine_config import EngineConfig
from engine.model_config import HybridModelConfig

STEP_COSTS_PATH = Path(__file__).resolve().parent / "step_costs.json"
# Another table to read instead, when set: benchmarks/spec_decode.py points its "auto" rows at
# the figures it has just measured.
STEP_COSTS_ENV = "HYBRID_SERVE_STEP_COSTS"
# A model dir's trained MTP head (engine/speculative/mtp.py load_trained_head), in a folder of
# its own (the loader reads every *.safetensors at the top), and what training measured of it
# (acceptance_by_depth): benchmarks/train_mtp_head.py writes both.
TRAINED_HEAD_FILE = "mtp_head/head.safetensors"
TRAINED_HEAD_REPORT = "mtp_head/report.json"
MIN_SPEEDUP = 1.05  # a choice must win by this much at batch 1 (timings vary by a few per cent)
EMA_WEIGHT = 0.25  # weight of the latest verification step in a request's moving average
PROBE_STEPS = 64  # steps a request waits before it drafts again after falling below break-even


@dataclass(frozen=True)
class StepCosts:
    """One model's measured step costs on one GPU (milliseconds, by batch size, at `context`
    tokens of context): decode_ms[b] a plain decode step; verify_ms[k][b] a verification step
    of k drafts per request (drafting not included); draft_ms[drafter][k][b] what drafting adds
    to a step (absent: nothing, as for the n-gram drafter, which runs in the scheduler);
    acceptance[drafter] the share accepted at each depth measured with the model's own head."""

    device: str
    decode_ms: Mapping[int, float]
    verify_ms: Mapping[int, Mapping[int, float]]
    draft_ms: Mapping[str, Mapping[int, Mapping[int, float]]] = field(default_factory=dict)
    acceptance: Mapping[str, Sequence[float]] = field(default_factory=dict)
    context: int = 0

    def step_ratio(self, drafter: str, k: int, batch: int) -> float:
        """(verify + draft) / decode at `batch`: the tokens a verification step of k drafts
        must yield to pay (interpolated linearly between measured batch sizes, flat past them)."""
        speculating = _at(self.verify_ms[k], batch) + _at(self.draft_ms.get(drafter, {}).get(k, {}), batch)
        return speculating / _at(self.decode_ms, batch)

    def batch_sizes(self, k: int) -> list[int]:
        return sorted(set(self.decode_ms) & set(self.verify_ms[k]))


def _at(by_batch: Mapping[int, float], batch: int) -> float:
    """by_batch at `batch`, linear between the measured sizes, the nearest one outside them;
    0.0 when nothing is measured (a cost that is not there)."""
    if not by_batch:
        return 0.0
    sizes = sorted(by_batch)
    if batch <= sizes[0]:
        return by_batch[sizes[0]]
    if batch >= sizes[-1]:
        return by_batch[sizes[-1]]
    i = bisect.bisect_right(sizes, batch)
    lo, hi = sizes[i - 1], sizes[i]
    return by_batch[lo] + (by_batch[hi] - by_batch[lo]) * (batch - lo) / (hi - lo)


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """Tokens a verification step of k drafts yields on average: 1 + a_1 + ... + a_k (a_d the
    share accepted at depth d; a depth past the measured ones counts as never accepted)."""
    return 1.0 + sum(acceptance[:k])


@dataclass(frozen=True)
class SpeculationChoice:
    """What the policy turned on: `drafter`, k drafts, drafting only in steps that start with
    at most max_batch_size running requests; break_even[b]: the tokens per verification step
    that pay at batch b (the measured sizes, StepCosts.step_ratio); speedup: the expected
    speed-up at batch 1."""

    drafter: str
    k: int
    max_batch_size: int
    break_even: Mapping[int, float]
    expected_tokens: float
    speedup: float


def choose(costs: StepCosts | None, drafter: str, acceptance: Sequence[float] | None,
           max_k: int) -> SpeculationChoice | None:
    """The (k, batch cap) that pays most at batch 1 for `drafter` with the measured costs and
    acceptance, k among the measured ones up to max_k (and the acceptance's depths); None when
    nothing wins by MIN_SPEEDUP at batch 1 or a figure is missing."""
    if costs is None or not acceptance:
        return None
    best = None
    for k in sorted(costs.verify_ms):
        if not 1 <= k <= min(max_k, len(acceptance)) or (drafter in costs.draft_ms and k not in costs.draft_ms[drafter]):
            continue
        sizes = costs.batch_sizes(k)
        if not sizes:
            continue
        tokens = expected_tokens(acceptance, k)
        speedup = tokens / costs.step_ratio(drafter, k, 1)
        winning = [b for b in sizes if tokens / costs.step_ratio(drafter, k, b) >= MIN_SPEEDUP]
        if speedup < MIN_SPEEDUP or not winning or (best is not None and speedup <= best.speedup):
            continue
        cap = max(b for b in sizes if all(tokens / costs.step_ratio(drafter, k, s) >= MIN_SPEEDUP
                                           for s in sizes if s <= b))
        best = SpeculationChoice(drafter, k, cap, {b: costs.step_ratio(drafter, k, b) for b in sizes},
                                 tokens, speedup)
    return best


# ----------------------------------------------------------------- the figures on disk


def model_signature(model_config: HybridModelConfig, dtype: str) -> dict:
    """What a step-cost entry is measured for: the architecture, its size and the dtype."""
    return {"model_type": model_config.model_type, "hidden_size": model_config.hidden_size,
            "num_hidden_layers": model_config.num_hidden_layers, "dtype": dtype}


def load_step_costs(model_config: HybridModelConfig, dtype: str, path: Path = STEP_COSTS_PATH) -> StepCosts | None:
    """The first entry of the step-cost table measured for this model and dtype (None: none)."""
    if not path.exists():
        return None
    wanted = model_signature(model_config, dtype)
    for entry in json.loads(path.read_text())["entries"]:
        if entry["model"] == wanted:
            return step_costs_from_json(entry)
    return None


def step_costs_from_json(entry: dict) -> StepCosts:
    """A StepCosts from a table entry (JSON keys are strings; batch sizes and k become ints)."""
    by_batch = lambda table: {int(b): float(ms) for b, ms in table.items()}  # noqa: E731
    return StepCosts(
        device=entry["device"], decode_ms=by_batch(entry["decode_ms"]),
        verify_ms={int(k): by_batch(t) for k, t in entry["verify_ms"].items()},
        draft_ms={d: {int(k): by_batch(t) for k, t in by_k.items()} for d, by_k in entry.get("draft_ms", {}).items()},
        acceptance={d: tuple(float(a) for a in shares) for d, shares in entry.get("acceptance", {}).items()},
        context=int(entry.get("context", 0)),
    )


def trained_head_acceptance(model_dir: str | Path) -> tuple[float, ...] | None:
    """The acceptance by depth measured when the model dir's MTP head was trained (None: no
    trained head, or no figure)."""
    report = Path(model_dir) / TRAINED_HEAD_REPORT
    if not (Path(model_dir) / TRAINED_HEAD_FILE).exists() or not report.exists():
        return None
    shares = json.loads(report.read_text()).get("acceptance_by_depth")
    return tuple(float(a) for a in shares) if shares else None


def has_mtp_head(config: EngineConfig, model_config: HybridModelConfig) -> bool:
    """Whether the mtp drafter has a head of the model's own to run: its mtp.* weights or a
    trained head in its model dir (a random head is for benchmarks: never chosen)."""
    return model_config.num_mtp_layers == 1 or (Path(config.model_dir) / TRAINED_HEAD_FILE).exists()


def resolve_speculation(
    config: EngineConfig, model_config: HybridModelConfig, costs_path: Path | None = None,
) -> tuple[EngineConfig, SpeculationChoice | None]:
    """config with num_speculative_tokens set: as given when it is set (no choice), else the
    policy's (module docstring): the MTP drafter, its k and batch cap, on CUDA where the
    figures say it wins, else 0 (off). Deterministic in its inputs (config, config.json, the
    model dir's head report, the table: costs_path, else $HYBRID_SERVE_STEP_COSTS, else
    STEP_COSTS_PATH), so the engine and every rank resolve alike."""
    if config.num_speculative_tokens is not None:
        return config, None
    if costs_path is None:
        costs_path = Path(os.environ.get(STEP_COSTS_ENV) or STEP_COSTS_PATH)
    choice = None
    if config.device.startswith("cuda") and config.random_mtp_head_seed is None and has_mtp_head(config, model_config):
        costs = load_step_costs(model_config, config.dtype, costs_path)
        acceptance = trained_head_acceptance(config.model_dir)
        if acceptance is None and costs is not None:
            acceptance = costs.acceptance.get("mtp")
        choice = choose(costs, "mtp", acceptance, max_k=16)
    if choice is None:
        return replace(config, num_speculative_tokens=0), None
    return replace(config, num_speculative_tokens=choice.k, speculative_drafter=choice.drafter,
                   speculative_max_batch_size=choice.max_batch_size), choice


# ----------------------------------------------------------------- at run time


class AcceptanceGate:
    """Which requests keep drafting, from the acceptance they see (module docstring): a
    request drafts while the moving average of the tokens its verification steps yielded is
    at least the break-even of the step's batch size; below it, it decodes plainly and drafts
    again (one probe) PROBE_STEPS steps later. A request starts at the expected tokens of the
    choice."""

    def __init__(self, choice: SpeculationChoice, ema_weight: float = EMA_WEIGHT, probe_steps: int = PROBE_STEPS) -> None:
        self.choice = choice
        self.ema_weight = ema_weight
        self.probe_steps = probe_steps
        self._tokens: dict[str, float] = {}  # request id -> moving average of tokens per verification
        self._off_since: dict[str, int] = {}  # request id -> the step it stopped drafting
        self._step = 0
        self._break_even = choice.break_even[min(choice.break_even)]
        self.requests_stopped = 0  # times a request stopped drafting (counters)

    def begin_step(self, num_running: int) -> None:
        self._step += 1
        self._break_even = _at(self.choice.break_even, num_running)

    def allows(self, request_id: str) -> bool:
        """Whether `request_id` drafts in this step."""
        stopped = self._off_since.get(request_id)
        if stopped is not None:
            return self._step - stopped >= self.probe_steps
        return self._tokens.get(request_id, self.choice.expected_tokens) >= self._break_even

    def observe(self, request_id: str, num_accepted: int) -> None:
        """A verification step of `request_id` kept num_accepted drafts (and the bonus token)."""
        previous = self._tokens.get(request_id, self.choice.expected_tokens)
        current = (1 - self.ema_weight) * previous + self.ema_weight * (num_accepted + 1)
        self._tokens[request_id] = current
        if current < self._break_even:
            if request_id not in self._off_since:
                self.requests_stopped += 1
            self._off_since[request_id] = self._step
        else:
            self._off_since.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
        self._off_since.pop(request_id, None)
