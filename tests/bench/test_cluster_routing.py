"""benchmarks/cluster_routing.py's pure parts: the modes (and skipping one this checkout cannot
run), the rotated schedule, per-replica counter deltas, the summary row and the table; and the
text benchmarks/prefix_affinity_router.py gives Ray's PrefixCacheAffinityRouter. No Ray
cluster, no deployment."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import cluster_routing as cr  # noqa: E402  (benchmarks/ is a folder of scripts)

APP_FIELDS = ["engine", "checkpoint_routing", "routing_queue_threshold", "checkpoint_transfer",
              "direct_ingress"]


def record(round_index: int, cached: int | None, shareable: int, ttft_s: float | None = 0.1,
           error: str | None = None, prompt: int = 700) -> dict:
    return {"round": round_index, "workload": "shared-instructions", "target": "m",
            "conversation": "c", "turn": 0, "rate": None, "start_s": 0.0, "first_chunk_s": ttft_s,
            "ttft_s": ttft_s, "itl_s": None, "e2e_s": 0.2, "prompt_tokens": prompt,
            "completion_tokens": 8, "cached_tokens": cached, "shareable_tokens": shareable,
            "finish_reason": "length", "error": error}


def counters(imported=0, imported_bytes=0, exported=0, exported_bytes=0, rejected=None,
             computed=0) -> dict:
    return {"scheduler": {"prompt_tokens_computed": computed, "preemptions": 0},
            "num_checkpoints": 3,
            "transfers": {"exported": exported, "exported_bytes": exported_bytes,
                          "imported": imported, "imported_bytes": imported_bytes,
                          "deduplicated": 0, "rejected": rejected or {}}}


def test_the_five_modes_and_their_keys():
    assert cr.MODE_NAMES == ("default", "prefix_affinity", "routing", "routing+transfer",
                             "ingress_routing")
    keys = {m.name: m.keys for m in cr.MODES}
    classic = {"direct_ingress": False}
    assert keys["default"] == {"checkpoint_routing": False, **classic}
    assert keys["prefix_affinity"] == {"checkpoint_routing": False, **classic}  # no checkpoint router
    assert [m.name for m in cr.MODES if m.affinity_router] == ["prefix_affinity"]
    assert keys["routing"] == {"checkpoint_routing": True, **classic}
    assert keys["routing+transfer"] == {"checkpoint_routing": True, "checkpoint_transfer": True,
                                        **classic}
    assert keys["ingress_routing"] == {"checkpoint_routing": True, "direct_ingress": True}


def test_a_mode_whose_key_this_checkout_lacks_is_skipped_with_a_reason():
    modes, skipped = cr.select_modes(list(cr.MODE_NAMES), APP_FIELDS)
    assert [m.name for m in modes] == list(cr.MODE_NAMES) and skipped == {}
    without = [f for f in APP_FIELDS if f != "checkpoint_transfer"]
    modes, skipped = cr.select_modes(["routing+transfer", "default"], without)
    assert [m.name for m in modes] == ["default"]  # MODES order, not the order asked
    assert "checkpoint_transfer" in skipped["routing+transfer"]
    with pytest.raises(ValueError, match="unknown mode"):
        cr.select_modes(["round-robin"], APP_FIELDS)


def test_prefix_affinity_is_skipped_with_the_reason_its_router_does_not_import(monkeypatch):
    reason = "Ray Serve LLM's PrefixCacheAffinityRouter does not import: No module named 'vllm'"
    modes, skipped = cr.select_modes(["prefix_affinity", "routing"], APP_FIELDS, reason)
    assert [m.name for m in modes] == ["routing"] and skipped == {"prefix_affinity": reason}
    modes, skipped = cr.select_modes(["prefix_affinity"], APP_FIELDS, None)
    assert [m.name for m in modes] == ["prefix_affinity"] and skipped == {}
    monkeypatch.setitem(sys.modules, "prefix_affinity_router", None)  # import raises ImportError
    error = cr.affinity_import_error()
    assert error is not None and error.startswith("Ray Serve LLM's PrefixCacheAffinityRouter")


def test_the_schedule_runs_every_mode_once_a_round_in_rotated_order():
    a, b, c, d, e = cr.MODES
    passes = cr.schedule(cr.MODES, 2)
    assert passes == [(0, a), (0, b), (0, c), (0, d), (0, e), (1, b), (1, c), (1, d), (1, e), (1, a)]
    assert cr.schedule([a, b], 3) == [(0, a), (0, b), (1, b), (1, a), (2, a), (2, b)]
    assert cr.schedule([], 2) == []


def test_counter_deltas_are_per_replica_and_transfers_sum_over_replicas_and_passes():
    before = {"r1": counters(imported=1, imported_bytes=100, computed=50), "r2": counters()}
    after = {"r1": counters(imported=3, imported_bytes=700, exported=1, exported_bytes=40,
                            computed=90, rejected={"mismatch": 1}),
             "r2": counters(exported=2, exported_bytes=600), "r3": counters(computed=7)}
    delta = cr.counters_delta(before, after)
    assert delta["r1"]["transfers"]["imported_bytes"] == 600
    assert delta["r1"]["scheduler"]["prompt_tokens_computed"] == 40
    assert delta["r1"]["transfers"]["rejected"] == {"mismatch": 1}
    assert delta["r3"]["scheduler"]["prompt_tokens_computed"] == 7  # a replica new since
    second = {"r9": counters(imported=1, imported_bytes=5)}
    assert cr.transfer_totals([delta, second]) == {
        "imports": 3, "imported_bytes": 605, "exports": 3, "exported_bytes": 640,
        "import_rejections": 1, "fetches": 0, "fetch_import_s": 0.0}
    tier = {"r1": {**counters(imported=1), "tier": {"fetched": 2, "fetch_seconds": 0.25,
                                                    "import_seconds": 0.5}},
            "r2": {**counters(), "tier": None}}
    totals = cr.transfer_totals([tier])
    assert totals["fetches"] == 2 and totals["fetch_import_s"] == pytest.approx(0.75)
    assert cr.transfer_totals([delta, {}]) is None  # a pass without counters: not measured
    assert cr.transfer_totals([]) is None


METRICS_PAGE = """\
# HELP ray_hybrid_serve_routed_to_checkpoint_holder_total Generation requests ...
# TYPE ray_hybrid_serve_routed_to_checkpoint_holder_total counter
ray_hybrid_serve_routed_to_checkpoint_holder_total{application="app-a",deployment="OpenAIIngress",replica="i1"} 7.0
ray_hybrid_serve_routed_to_checkpoint_holder_total{application="app-a",deployment="OpenAIIngress",replica="i2"} 3.0
ray_hybrid_serve_routed_to_checkpoint_holder_total{application="app-b",deployment="OpenAIIngress",replica="i3"} 50.0
# HELP ray_hybrid_serve_routing_fallbacks_total Generation requests the router left ...
# TYPE ray_hybrid_serve_routing_fallbacks_total counter
ray_hybrid_serve_routing_fallbacks_total{application="app-a",reason="no_holder",replica="i1"} 4.0
ray_hybrid_serve_routing_fallbacks_total{application="app-a",reason="overloaded",replica="i2"} 2.0
ray_hybrid_serve_routing_fallbacks_total{application="app-a",reason="no_holder",replica="i2"} 1.0
# HELP ray_hybrid_serve_requests_total Requests
# TYPE ray_hybrid_serve_requests_total counter
ray_hybrid_serve_requests_total{application="app-a",status="ok"} 99.0
"""


def test_router_decisions_are_read_per_application_and_subtracted():
    counts = cr.routing_counts(METRICS_PAGE, "app-a")
    assert counts == {"holder": 10, "fallbacks": {"no_holder": 5, "overloaded": 2}}
    assert cr.routing_counts(METRICS_PAGE, "app-c") == {"holder": 0, "fallbacks": {}}
    before = {"holder": 4, "fallbacks": {"no_holder": 5}}
    assert cr.routing_delta(before, counts) == {"holder": 6, "fallbacks": {"overloaded": 2}}
    first = {"holder": 6, "fallbacks": {"overloaded": 2}}
    second = {"holder": 40, "fallbacks": {"no_holder": 3, "overloaded": 1}}
    assert cr.sum_routing([first, second]) == (46, {"no_holder": 3, "overloaded": 3})
    assert cr.sum_routing([first, None]) == (None, None)  # a pass without the router
    assert cr.sum_routing([]) == (None, None)


def test_replica_stats_become_plain_counters_with_the_tier_beside_them():
    from dataclasses import dataclass

    @dataclass
    class Engine:
        transfers: dict

    @dataclass
    class Tier:
        fetched: int

    @dataclass
    class ReplicaStats:
        replica_id: str
        engine: Engine
        tier: Tier | None

    assert cr.replica_counters(ReplicaStats("r", Engine({"imported": 1}), Tier(2))) == {
        "transfers": {"imported": 1}, "tier": {"fetched": 2}}
    assert cr.replica_counters(ReplicaStats("r", Engine({}), None))["tier"] is None
    assert cr.replica_counters(Engine({"imported": 3})) == {"transfers": {"imported": 3},
                                                           "tier": None}


def test_a_mode_row_sums_its_rounds():
    records = [record(0, 0, 0, 0.50), record(0, 400, 500, 0.10), record(1, 0, 0, 0.40),
               record(1, 500, 500, 0.05), record(1, None, 500, None, error="HTTP 503")]
    deltas = [{"r1": counters(imported=1, imported_bytes=2 * 2**20)}, {"r1": counters()}]
    routing = [{"holder": 3, "fallbacks": {"no_holder": 2}},
               {"holder": 4, "fallbacks": {"no_holder": 1, "overloaded": 1}}]
    row = cr.summarize_mode("routing+transfer", records, [3.0, 4.0], deltas, routing)
    assert tuple(row) == cr.ROW_FIELDS
    assert (row["requests"], row["errors"], row["rounds"]) == (5, 1, 2)
    assert row["cached_tokens"] == 900 and row["shareable_tokens"] == 1000
    assert row["token_hit_rate"] == pytest.approx(0.9)
    assert row["hit_rate_by_round"] == [pytest.approx(0.8), pytest.approx(1.0)]
    assert row["ttft_p50_ms"] == pytest.approx(100.0)  # nearest rank of 4: the second
    assert row["ttft_p95_ms"] == pytest.approx(500.0)
    assert row["prompt_tokens_computed"] == 4 * 700 - 900
    assert (row["imports"], row["imported_bytes"]) == (1, 2 * 2**20)
    assert row["wall_s"] == 7.0
    assert row["routed_to_holder"] == 7
    assert row["routing_fallbacks"] == {"no_holder": 3, "overloaded": 1}


def test_a_row_without_counters_or_usage_reports_none_not_zero():
    row = cr.summarize_mode("default", [record(0, None, 0), record(0, None, 500)], [1.0], [{}])
    assert row["cached_tokens"] is None and row["token_hit_rate"] is None
    assert row["imported_bytes"] is None and row["imports"] is None
    assert row["routed_to_holder"] is None and row["routing_fallbacks"] is None  # no router


def test_the_table_has_one_line_a_mode():
    rows = [cr.summarize_mode("default", [record(0, 0, 0), record(0, 250, 500)], [1.0],
                              [{"r1": counters()}]),
            cr.summarize_mode("routing+transfer", [record(0, 0, 0), record(0, 500, 500)], [1.0],
                              [{"r1": counters(imported=2, imported_bytes=3 * 2**20,
                                               exported=1, exported_bytes=512)}],
                              [{"holder": 1, "fallbacks": {"no_holder": 1}}]),
            cr.summarize_mode("routing", [record(0, None, 500)], [1.0], [{}]),
            cr.summarize_mode("prefix_affinity", [record(0, 0, 0, 0.3), record(0, 500, 500, 0.1)],
                              [1.0], [{"r1": counters()}], [None])]
    lines = cr.format_table(rows).splitlines()
    assert len(lines) == 2 + 4
    assert lines[0].startswith("| mode | requests (errors) | token hit rate")
    assert "| default | 2 (0) | 0.500 | 0.500 | 250 / 500 |" in lines[2]
    assert "| 1 / 1 (no_holder 1) | 2 (0) | 3.0 MiB | 512 B |" in lines[3]
    assert lines[4].count("| - ") >= 3  # nothing reported: dashes
    # Ray's router reports no decisions of ours: its routing cell is a dash, not 0 / 0
    assert lines[5].startswith("| prefix_affinity | 2 (0) | 1.000 | 1.000 | 500 / 500 | 100.0 | 300.0 |")
    assert lines[5].endswith("| 900 | - | 0 (0) | 0 B | 0 B |")


# ----- benchmarks/prefix_affinity_router.py (needs Ray's router class, not a Ray cluster)

def _affinity():
    return pytest.importorskip("prefix_affinity_router",
                               reason="Ray Serve LLM's PrefixCacheAffinityRouter does not import")


def generation_request(ids=(5, 6, 7)):
    from engine.interfaces.generation_request import GenerationRequest
    from engine.interfaces.sampling_params import SamplingParams

    return GenerationRequest(request_id="r", prompt_token_ids=ids, sampling=SamplingParams())


class Pending:
    """The one attribute of Serve's PendingRequest the text extraction reads."""

    def __init__(self, *args):
        self.args = list(args)


def test_the_affinity_router_reads_the_text_of_the_generation_requests_token_ids():
    par = _affinity()
    decoded = []

    def decode(ids):
        decoded.append(ids)
        return "|".join(map(str, ids))

    assert par.prompt_text(["not a request", generation_request((1, 2))], decode) == "1|2"
    assert decoded == [[1, 2]]
    assert par.prompt_text([], decode) is None and par.prompt_text(["x"], decode) is None

    class Tokenizer:
        pass

    router = object.__new__(par.RenderedPromptAffinityRouter)  # no Serve state: only the text
    router._tokenizer = Tokenizer()
    router._tokenizer.decode = decode
    assert router._extract_text_from_request(Pending(generation_request((3,)))) == "3"

    class Completion:
        prompt = "raw text"

    assert router._extract_text_from_request(Pending(Completion())) == "raw text"  # Ray's reading


def test_rays_own_reading_finds_no_text_in_our_llm_servers_argument():
    """Why the adapter exists: the unchanged router refuses a GenerationRequest."""
    par = _affinity()
    router = object.__new__(par.PrefixCacheAffinityRouter)
    with pytest.raises(ValueError, match="message or prompt"):
        router._extract_text_from_request(Pending(generation_request()))


def test_the_affinity_router_config_names_the_adapter_and_the_tokenizer():
    par = _affinity()
    config = par.router_config("/models/m")
    assert config.request_router_class == "prefix_affinity_router.RenderedPromptAffinityRouter"
    assert config.request_router_kwargs == {"model_dir": "/models/m"}
    assert config.get_request_router_class().__mro__[1] is par.PrefixCacheAffinityRouter
