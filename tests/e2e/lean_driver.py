"""A driver run by tests/e2e/test_serve_main_stop.py against a lean-path server it started with
`python -m deployments.serve_main`: it joins that server's Ray (RAY_ADDRESS, and the cluster's
RAY_SERVE_* environment, so that its handles speak Serve's gRPC data plane as the replicas'
do), runs one scenario and prints one JSON line of what it saw; the test asserts on it.

    python tests/e2e/lean_driver.py handles BASE_URL APP
    python tests/e2e/lean_driver.py routing BASE_URL APP REPLICAS

handles: the Python DeploymentHandle API on the lean path (the app's ingress is the LLM server
    deployment): synchronous and asyncio calls, streamed and not, a refused request's APIError,
    and whether the calls went by gRPC (DeploymentResponse.by_reference False).
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


def handles(app: str) -> dict:
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
    return seen


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
    result = handles(app) if scenario == "handles" else routing(base_url, app, int(argv[3]))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
