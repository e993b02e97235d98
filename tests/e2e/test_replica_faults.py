"""The LLM server replica (the step loop, and with one rank the model) is killed while requests
are in flight: each ends with 503 and an OpenAI error body (a stream that had started, with an
error event and [DONE]), Serve replaces the replica, and the next request succeeds with the
same output as before. (A rank actor killed: test_tensor_parallel_serve.py; a request whose
steps fail: tests/engine/test_step_faults.py.)"""

from __future__ import annotations

import pytest
import ray
from ray import serve

from tests.e2e.in_flight import TwoLongRequests, until_it_answers

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
    in_flight = TwoLongRequests(str(http.base_url), FAULT_PREFIX, PROMPT)
    in_flight.start()
    in_flight.wait_running(serve.get_deployment_handle("LLMServer", app_name=FAULT_APP))
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    in_flight.finish()
    in_flight.assert_both_ended_with_503()
    assert in_flight.plain.headers["retry-after"] == "1"
    assert "Error" not in in_flight.plain.json()["error"]["message"]  # no exception names

    def replaced() -> None:  # Serve starts a new replica; requests meanwhile may get 503
        assert greedy(client) == expected

    until_it_answers(replaced, timeout_s=240)
    assert victim not in llm_server_replica_names(FAULT_APP)
    assert len(llm_server_replica_names(FAULT_APP)) == 1
