"""The LLM server replica (the step loop, and with one rank the model) is killed while requests
are in flight: each ends with 503 and an OpenAI error body (a stream that had started, with an
error event and [DONE]), Serve replaces the replica, and the next request succeeds with the
same output as before. (A rank actor killed: test_tensor_parallel_serve.py; a request whose
steps fail: tests/engine/test_step_faults.py.)"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray
from ray import serve

FAULT_APP, FAULT_PREFIX = "hybrid-serve-e2e-replica-fault", "/replica-fault"
MODEL_NAME = "hybrid-serve-tiny"
PROMPT = "The step loop lives in the replica"


def llm_server_replica_names(app_name: str) -> list[str]:
    """Names (namespace "serve") of the app's live LLM server replica actors."""
    prefix = f"SERVE_REPLICA::{app_name}#LLMServer#"
    return sorted(entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
                  if entry["name"].startswith(prefix))


def greedy(client, max_tokens: int = 12) -> str:
    return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text


@pytest.mark.timeout(400)
def test_killed_llm_server_replica_fails_in_flight_requests_with_503_then_is_replaced(
        deploy_variant, http):
    client = deploy_variant(FAULT_APP, FAULT_PREFIX, worker_num_cpus=0.2, health_check_period_s=1.0)
    expected = greedy(client)
    [victim] = llm_server_replica_names(FAULT_APP)

    long_request = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True}
    results: dict[str, object] = {}
    streamed_first = threading.Event()
    base_url = str(http.base_url)

    def plain() -> None:
        with httpx.Client(base_url=base_url, timeout=120) as c:
            results["plain"] = c.post(f"{FAULT_PREFIX}/v1/completions", json=long_request)

    def streaming() -> None:
        events = []
        with httpx.Client(base_url=base_url, timeout=120) as c:
            with c.stream("POST", f"{FAULT_PREFIX}/v1/completions",
                          json={**long_request, "stream": True}) as response:
                results["stream_status"] = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        streamed_first.set()
        results["stream_events"] = events

    threads = [threading.Thread(target=plain), threading.Thread(target=streaming)]
    for thread in threads:
        thread.start()
    assert streamed_first.wait(60), "the stream produced no first chunk"
    server = serve.get_deployment_handle("LLMServer", app_name=FAULT_APP)
    deadline = time.monotonic() + 30
    while server.pool_usage.remote().result().num_requests < 2:
        assert time.monotonic() < deadline, "both requests never ran together"
        time.sleep(0.05)
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    for thread in threads:
        thread.join(120)

    answer = results["plain"]
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "replica_unavailable"
    assert answer.headers["retry-after"] == "1"
    assert "Error" not in answer.json()["error"]["message"]  # no exception names
    assert results["stream_status"] == 200  # its headers left with the first token
    events = results["stream_events"]
    assert events[-1] == "[DONE]" and '"replica_unavailable"' in events[-2], events[-2:]
    assert len(events) < 400

    deadline = time.monotonic() + 240
    while True:  # Serve starts a new replica; requests meanwhile may get 503
        try:
            assert greedy(client) == expected
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    assert victim not in llm_server_replica_names(FAULT_APP)
    assert len(llm_server_replica_names(FAULT_APP)) == 1
