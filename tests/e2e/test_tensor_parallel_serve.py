"""Tensor parallelism through Serve: a tp=2 replica answers like the tp=1 app, and when one of
its rank actors dies mid-stream the requests in flight end with 503, the replica reports
unhealthy, Serve replaces it, and requests after the replacement succeed."""

from __future__ import annotations


import pytest
import ray
from ray import serve

from tests.e2e.in_flight import TwoLongRequests, until_it_answers


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
    expected = greedy_completion(tp2_client)
    server = serve.get_deployment_handle("LLMServer", app_name=TP_APP)
    ranks = server.rank_actors.remote().result()
    assert len(ranks) == 2

    in_flight = TwoLongRequests(str(http.base_url), TP_PREFIX, PROMPT)
    in_flight.start()
    in_flight.wait_running(server)
    ray.kill(ranks[1])
    in_flight.finish()
    in_flight.assert_both_ended_with_503()

    with pytest.raises(Exception, match="not running|RayActorError|died"):
        server.check_health.remote().result(timeout_s=30)

    def replaced() -> None:
        assert greedy_completion(tp2_client) == expected

    until_it_answers(replaced, timeout_s=180)
    new_ranks = server.rank_actors.remote().result()
    assert {r._actor_id for r in new_ranks}.isdisjoint({r._actor_id for r in ranks})
