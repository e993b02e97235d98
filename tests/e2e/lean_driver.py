"""A driver run by tests/e2e/test_serve_main_stop.py against a lean-path server it started with
`python -m deployments.serve_main`: it joins that server's Ray (RAY_ADDRESS, and the cluster's
RAY_SERVE_* environment, so that its handles speak Serve's gRPC data plane as the replicas'
do), runs one scenario and prints one JSON line of what it saw; the test asserts on it.

    python tests/e2e/lean_driver.py handles BASE_URL APP
    python tests/e2e/lean_driver.py routing BASE_URL APP REPLICAS

handles: the Python DeploymentHandle API on the lean path (the app's ingress is the LLM server
    deployment): synchronous and asyncio calls, streamed and not, a refused request's APIError,
    and whether the calls went by gRPC (DeploymentResponse.by_reference False); then a client
    that closes its HTTP connection mid-stream: whether its request was aborted and the pools
    freed (the replica's direct-ingress wrapper cancels the request when the client goes).
routing: checkpoint-aware ingress routing through HAProxy: for each of PROMPTS system prompts,
    one chat request, a pause for the index to hear of its checkpoint, then FOLLOW_UPS more
    with other user messages; each request's cached tokens, and each LLM server replica's
    instruction checkpoints captured and evicted (LLMServer.replica_stats through a handle,
    asked until every replica answered).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx

PROMPTS = 3
FOLLOW_UPS = 4
INDEX_SETTLE_S = 2.5  # report period 0.2 s + the router mirror's next delta
MAX_TOKENS = 4
DISCONNECT_WAIT_S = 20


def handles(base_url: str, app: str) -> dict:
    from ray import serve

    from deployments.http.errors import APIError
    from deployments.http.protocol import ChatCompletionRequest, CompletionRequest

    handle = serve.get_app_handle(app)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "Hello!"}], max_tokens=5,
                                 temperature=0)
    seen: dict = {}
    response = handle.chat.remote(chat)
    seen["by_reference"] = response.by_reference
    seen["sync_text"] = response.result().choices[0].message.content
    seen["sync_stream"] = "".join(c.choices[0].delta.content or "" for c in
                                  handle.options(stream=True).chat_stream.remote(chat) if c.choices)
    seen["completion_tokens"] = handle.completions.remote(
        CompletionRequest(prompt=[5, 6, 7], max_tokens=3, temperature=0)).result().usage.completion_tokens
    seen["models"] = [card.id for card in handle.models.remote().result().data]
    try:
        handle.chat.remote(chat.model_copy(update={"model": "no-such-model"})).result()
        seen["refused"] = None
    except APIError as exc:
        seen["refused"] = exc.status_code

    async def in_asyncio() -> None:
        seen["async_text"] = (await handle.chat.remote(chat)).choices[0].message.content
        chunks = [c async for c in handle.options(stream=True).chat_stream.remote(chat)]
        seen["async_stream"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    asyncio.run(in_asyncio())
    seen.update(disconnect(base_url, handle))
    return seen


def disconnect(base_url: str, handle) -> dict:
    """A streamed chat of 200 tokens (the stop test's context is 256) whose client closes its
    connection after three events: the requests in flight while it streamed, and whether within
    DISCONNECT_WAIT_S the replica counted one abort more and held no request, block or slot of
    it any more."""
    aborted_before = handle.num_aborted_requests.remote().result()
    body = {"messages": [{"role": "user", "content": "Talk for a long time."}], "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}
    busy, lines, events = None, [], 0
    with httpx.Client(base_url=base_url, timeout=60) as own_connection:
        with own_connection.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                lines.append(line)
                events += line.startswith("data: ")
                if events == 3:
                    busy = handle.pool_usage.remote().result()
                    break  # leaving closes the unread response and its connection
    if busy is None:  # the stream ended (or failed) before its third event
        return {"disconnect_status": response.status_code, "disconnect_lines": lines[:5]}
    deadline = time.monotonic() + DISCONNECT_WAIT_S
    while True:
        usage = handle.pool_usage.remote().result()
        aborted = handle.num_aborted_requests.remote().result() - aborted_before
        if (aborted == 1 and usage.num_requests == 0 and usage.idle) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {"disconnect_busy_requests": busy.num_requests, "disconnect_aborted": aborted,
            "disconnect_idle_after": usage.idle and usage.num_requests == 0}


def routing(base_url: str, app: str, replicas: int) -> dict:
    from ray import serve

    requests = []
    with httpx.Client(base_url=base_url, timeout=120) as http:
        for p in range(PROMPTS):
            system = f"Instruction set {p}: answer as a terse pirate in at most four words. " * 2
            for turn in range(1 + FOLLOW_UPS):
                body = {"messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": f"Question {turn} of set {p}?"}],
                        "max_tokens": MAX_TOKENS, "temperature": 0}
                answer = http.post("/v1/chat/completions", json=body)
                answer.raise_for_status()
                usage = answer.json()["usage"]
                requests.append({"prompt": p, "turn": turn, "prompt_tokens": usage["prompt_tokens"],
                                 "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]})
                if turn == 0:
                    time.sleep(INDEX_SETTLE_S)
    handle = serve.get_deployment_handle("LLMServer", app)
    captured: dict[str, int] = {}
    evicted: dict[str, int] = {}
    deadline = time.monotonic() + 60
    while len(captured) < replicas and time.monotonic() < deadline:
        for stats in [handle.replica_stats.remote().result() for _ in range(2 * replicas)]:
            captured[stats.replica_id] = stats.engine.checkpoints["instruction"].captured
            evicted[stats.replica_id] = stats.engine.checkpoints["instruction"].evicted
    return {"requests": requests, "instruction_captured": captured, "instruction_evicted": evicted}


def main(argv: list[str]) -> None:
    import ray

    ray.init(log_to_driver=False)  # RAY_ADDRESS: the server's cluster
    scenario, base_url, app = argv[:3]
    result = handles(base_url, app) if scenario == "handles" else routing(base_url, app, int(argv[3]))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
