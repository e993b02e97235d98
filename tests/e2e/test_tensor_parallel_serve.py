"""Tensor parallelism through Serve: a tp=2 replica answers like the tp=1 app, and when one of
its rank actors dies mid-stream the requests in flight end with 503, the replica reports
unhealthy, Serve replaces it, and requests after the replacement succeed."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray
from ray import serve


TP_APP = "hybrid-serve-e2e-tp2"
TP_PREFIX = "/tp2"
MODEL_NAME = "hybrid-serve-tiny"
PROMPT = "Tensor parallel ranks agree on every token"


@pytest.fixture(scope="module")
def tp2_client(deploy_variant):
    return deploy_variant(TP_APP, TP_PREFIX, engine={"tensor_parallel_size": 2}, worker_num_cpus=0.2,
                          health_check_period_s=1.0)


def greedy_completion(client, max_tokens: int = 16) -> str:
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens,
                                         temperature=0, extra_body={"ignore_eos": True})
    return response.choices[0].text


def test_tp2_replica_matches_tp1_app(tp2_client, client):
    assert greedy_completion(tp2_client) == greedy_completion(client)
    usage = serve.get_deployment_handle("LLMServer", app_name=TP_APP).pool_usage.remote().result()
    assert usage.num_requests == 0


@pytest.mark.timeout(300)
def test_killed_rank_fails_in_flight_requests_with_503_then_replica_recovers(tp2_client, http):
    base_url = str(http.base_url)
    expected = greedy_completion(tp2_client)
    server = serve.get_deployment_handle("LLMServer", app_name=TP_APP)
    ranks = server.rank_actors.remote().result()
    assert len(ranks) == 2

    long_request = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True}
    results: dict[str, object] = {}
    streamed_first = threading.Event()

    def non_streaming() -> None:
        with httpx.Client(base_url=base_url, timeout=120) as http:
            results["plain"] = http.post(f"{TP_PREFIX}/v1/completions", json=long_request)

    def streaming() -> None:
        events = []
        with httpx.Client(base_url=base_url, timeout=120) as http:
            with http.stream("POST", f"{TP_PREFIX}/v1/completions",
                             json={**long_request, "stream": True}) as response:
                results["stream_status"] = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        streamed_first.set()
        results["stream_events"] = events

    threads = [threading.Thread(target=non_streaming), threading.Thread(target=streaming)]
    for thread in threads:
        thread.start()
    assert streamed_first.wait(60), "the stream produced no first chunk"
    _wait_for_running_requests(server, 2)
    ray.kill(ranks[1])
    for thread in threads:
        thread.join(120)

    plain = results["plain"]
    assert plain.status_code == 503, plain.text
    assert plain.json()["error"]["code"] == "replica_unavailable"
    assert results["stream_status"] == 200  # headers left with the first token
    events = results["stream_events"]
    assert events[-1] == "[DONE]"
    assert '"replica_unavailable"' in events[-2], events[-2]
    assert len(events) < 400  # the stream ended early, with the error

    with pytest.raises(Exception, match="not running|RayActorError|died"):
        server.check_health.remote().result(timeout_s=30)

    deadline = time.monotonic() + 180
    while True:
        try:
            assert greedy_completion(tp2_client) == expected
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    new_ranks = server.rank_actors.remote().result()
    assert {r._actor_id for r in new_ranks}.isdisjoint({r._actor_id for r in ranks})


def _wait_for_running_requests(server, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while server.pool_usage.remote().result().num_requests < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{count} requests never ran together")
        time.sleep(0.05)
