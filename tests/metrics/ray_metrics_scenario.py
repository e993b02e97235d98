"""Scenario for test_ray_metrics.py, run as a script in a process of its own:

    python tests/metrics/ray_metrics_scenario.py OUT_JSON METRICS_PORT HTTP_PORT

Starts a local Ray instance of its own with a metrics export port (its own process, so it never
meets the test session's Ray instance), deploys the app with TWO LLM server replicas and
speculative decoding on (n-gram), sends chat and completion requests (and one refused by its
model name, and one whose prompt repeats a span so that drafts are accepted), then scrapes Ray's
metrics agent at http://127.0.0.1:METRICS_PORT/metrics until the sums over replicas equal what
the clients saw (Ray exports with a lag) and the speculation counters agree with each other, or
a deadline. Writes to OUT_JSON what the clients saw (`expected`), the sums scraped (`totals`,
`speculation`), the replicas seen in the series and every ray_hybrid_serve_* sample name
scraped; the test asserts on them.
"""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from deployments.config import AppConfig  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402

APP_NAME = "hybrid-serve-metrics"
MODEL_NAME = "hybrid-serve-tiny"
NUM_LLM_REPLICAS = 2
BATCH = 8  # concurrent requests per batch: both replicas get some
MAX_BATCHES = 5
MAX_TOKENS = 8
NUM_SPECULATIVE_TOKENS = 4
REPEATING_MAX_TOKENS = 16
CONVERGE_DEADLINE_S = 90.0
KINDS = ("system", "user", "completion")
SYSTEM = "You are a careful assistant for a hardware store. Answer in one short sentence."
QUESTIONS = ("Where are the wood screws?", "Do you sell drills?", "Is there a paint aisle?",
             "Can I rent a ladder?", "Where are the hinges?", "Do you cut keys?")

CONFIG = AppConfig(  # tests/e2e/conftest.py's E2E_CONFIG, half a CPU per model replica
    served_model_name=MODEL_NAME,
    worker_num_cpus=0.5,
    engine=EngineConfig(
        max_model_len=512, block_size=16, max_num_batched_tokens=256, max_num_seqs=16,
        kv_cache_bytes=32 * 1024 * 1024, state_cache_bytes=32 * 1024 * 1024,
        checkpoint_slots=("prompt", "response", "instruction"),
        checkpoint_cache_bytes=32 * 1024 * 1024, num_speculative_tokens=NUM_SPECULATIVE_TOKENS),
)


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    """The ray_hybrid_serve_* samples the metrics agent serves now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("ray_hybrid_serve_")]


def total(samples: Iterable[tuple[str, dict, float]], name: str, **labels: str) -> float:
    """The sum over every series (replica) of `name` whose labels include `labels`."""
    return sum(value for sample_name, sample_labels, value in samples
               if sample_name == name and labels.items() <= sample_labels.items())


def totals(samples) -> dict[str, float]:
    return {
        "requests_ok": total(samples, "ray_hybrid_serve_requests_total", status="ok"),
        "requests_error_4xx": total(samples, "ray_hybrid_serve_requests_total", status="error",
                                    http_status="4xx"),
        "requests_finished_by_length": total(samples, "ray_hybrid_serve_requests_total",
                                             finish_reason="length"),
        "output_tokens": total(samples, "ray_hybrid_serve_output_tokens_total"),
        "prompt_tokens": total(samples, "ray_hybrid_serve_prompt_tokens_restored_total")
        + total(samples, "ray_hybrid_serve_prompt_tokens_computed_total"),
        "ttft_count": total(samples, "ray_hybrid_serve_time_to_first_token_seconds_count"),
        "ttft_bucket_inf": total(samples, "ray_hybrid_serve_time_to_first_token_seconds_bucket",
                                 le="+Inf"),
        "request_latency_count": total(samples, "ray_hybrid_serve_request_latency_seconds_count"),
        "inter_token_latency_count": total(
            samples, "ray_hybrid_serve_inter_token_latency_seconds_count"),
        "boundary_rejections_no_leading_instructions": total(
            samples, "ray_hybrid_serve_instruction_boundary_rejections_total",
            reason="no_leading_instructions"),
        "state_slots_used_after": total(samples, "ray_hybrid_serve_state_slots", state="used"),
    }


def speculation(samples) -> dict:
    """The speculative decoding counters summed over replicas (every drafter): chunks, drafts
    proposed, accepted, trimmed, and chunks by accepted drafts ("0".."k")."""
    prefix = "ray_hybrid_serve_speculative_"
    lengths: dict[str, float] = {}
    for name, labels, value in samples:
        if name == prefix + "acceptance_lengths_total":
            lengths[labels["accepted"]] = lengths.get(labels["accepted"], 0) + value
    return {
        "chunks": total(samples, prefix + "verification_chunks_total"),
        "proposed": total(samples, prefix + "draft_tokens_proposed_total"),
        "accepted": total(samples, prefix + "draft_tokens_accepted_total"),
        "trimmed": total(samples, prefix + "draft_tokens_trimmed_total"),
        "lengths": dict(sorted(lengths.items())),
    }


def speculation_adds_up(counters: dict) -> bool:
    """Chunks by length sum to the chunks, and their accepted drafts to the drafts accepted:
    true once one export of each replica has reached the scrape whole."""
    lengths = {int(a): n for a, n in counters["lengths"].items()}
    return (sum(lengths.values()) == counters["chunks"]
            and sum(a * n for a, n in lengths.items()) == counters["accepted"])


def repeating_prompt() -> list[int]:
    """P + C + P, P a random span of token ids and C the model's greedy continuation of it
    (computed here with an engine of the same model): after the second P the model mostly
    says C again, which the n-gram drafter proposes (tests/engine/test_speculative.py)."""
    from engine.interfaces.generation_request import GenerationRequest
    from engine.core.llm_engine import LLMEngine
    from engine.interfaces.sampling_params import SamplingParams

    rng = random.Random(25)
    span = [rng.randrange(100, 2000) for _ in range(rng.randint(12, 24))]
    engine = LLMEngine(replace(CONFIG.engine, num_speculative_tokens=0))
    engine.add_request(GenerationRequest("span", span, SamplingParams(
        max_tokens=REPEATING_MAX_TOKENS, temperature=0, ignore_eos=True)))
    continuation: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            continuation += out.new_token_ids
    engine.shutdown()
    return span + continuation + span


def replicas(samples, name: str) -> list[str]:
    return sorted({labels.get("replica", "") for sample_name, labels, _ in samples
                   if sample_name == name})


def send(client: httpx.Client, index: int, kind: str,
         prompt_token_ids: list[int] | None = None) -> tuple[int, dict]:
    """Request number `index` of `kind`: a chat with the shared system prompt ("system"), a
    chat without one ("user"), a completion, or a completion of `prompt_token_ids` for
    REPEATING_MAX_TOKENS ("repeating"). Returns the status and the body."""
    question = QUESTIONS[index % len(QUESTIONS)] + f" ({index})"
    sampling = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if kind == "repeating":
        response = client.post("/v1/completions", json={
            **sampling, "max_tokens": REPEATING_MAX_TOKENS, "prompt": prompt_token_ids})
    elif kind == "completion":
        response = client.post("/v1/completions", json={**sampling, "prompt": question})
    else:
        messages = [{"role": "user", "content": question}]
        if kind == "system":
            messages.insert(0, {"role": "system", "content": SYSTEM})
        response = client.post("/v1/chat/completions", json={**sampling, "messages": messages})
    return response.status_code, response.json()


def main(out_path: str, metrics_port: int, http_port: int) -> None:
    import ray
    from ray import serve

    import deployments.app
    from deployments.app import build_app

    prompt_token_ids = repeating_prompt()  # before Ray: the driver's engine is gone by then
    ray.init(address="local", num_cpus=4, object_store_memory=256 * 1024 * 1024,
             include_dashboard=False, log_to_driver=False, namespace=APP_NAME,
             _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        # build_app's LLMServer.options(...) keeps num_replicas from this one
        deployments.app.LLMServer = deployments.app.LLMServer.options(num_replicas=NUM_LLM_REPLICAS)
        serve.run(build_app(CONFIG), name=APP_NAME, route_prefix="/")
        result = run_traffic_and_scrape(metrics_port, http_port, prompt_token_ids)
    finally:
        serve.shutdown()
        ray.shutdown()
    Path(out_path).write_text(json.dumps(result, indent=1))


def run_traffic_and_scrape(metrics_port: int, http_port: int, prompt_token_ids: list[int]) -> dict:
    expected = dict.fromkeys(("requests_ok", "output_tokens", "prompt_tokens",
                              "boundary_rejections_no_leading_instructions"), 0)
    statuses: list[int] = []

    def count(kind: str, status: int, body: dict) -> None:
        statuses.append(status)
        if status == 200:
            expected["requests_ok"] += 1
            expected["output_tokens"] += body["usage"]["completion_tokens"]
            expected["prompt_tokens"] += body["usage"]["prompt_tokens"]
            expected["boundary_rejections_no_leading_instructions"] += int(kind == "user")

    with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=120) as client:
        refused = client.post("/v1/chat/completions", json={
            "model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
        statuses.append(refused.status_code)
        sent = 0
        for _ in range(MAX_BATCHES):  # concurrent batches until both replicas have served some
            kinds = [KINDS[i % 3] for i in range(sent, sent + BATCH)]
            with ThreadPoolExecutor(BATCH) as pool:
                answers = list(pool.map(lambda i: send(client, i, kinds[i - sent]),
                                        range(sent, sent + BATCH)))
            for kind, (status, body) in zip(kinds, answers):
                count(kind, status, body)
            sent += BATCH
            time.sleep(2.5)  # two exports of each replica and a Ray report
            served = replicas(scrape(metrics_port), "ray_hybrid_serve_prompt_tokens_computed_total")
            if len(served) == NUM_LLM_REPLICAS:
                break
        # one after the other: two of three reach the same replica, and the later one restores
        # the instruction checkpoint the earlier one left there
        for index in range(sent, sent + 3):
            count("system", *send(client, index, "system"))
        count("repeating", *send(client, sent + 3, "repeating", prompt_token_ids))
    expected.update(requests_error_4xx=int(refused.status_code // 100 == 4),
                    requests_finished_by_length=expected["requests_ok"],
                    ttft_count=expected["requests_ok"], ttft_bucket_inf=expected["requests_ok"],
                    request_latency_count=expected["requests_ok"],
                    inter_token_latency_count=expected["requests_ok"], state_slots_used_after=0)

    started = time.monotonic()
    while True:
        samples = scrape(metrics_port)
        converged = totals(samples) == expected and speculation_adds_up(speculation(samples))
        if converged or time.monotonic() - started > CONVERGE_DEADLINE_S:
            break
        time.sleep(1.0)
    return {
        "statuses": statuses,
        "expected": expected,
        "totals": totals(samples),
        "speculation": speculation(samples),
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        "seconds_to_converge": round(time.monotonic() - started, 1),
        "llm_server_replicas": NUM_LLM_REPLICAS,
        "gauge_replicas": replicas(samples, "ray_hybrid_serve_kv_blocks"),
        "counter_replicas": replicas(samples, "ray_hybrid_serve_prompt_tokens_computed_total"),
        "names": sorted({name for name, _, _ in samples}),
    }


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
