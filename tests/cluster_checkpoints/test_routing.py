"""Checkpoint-aware routing across LLM server replicas (issue 20: routing and overload).

Three apps of the session's Serve instance, all with E2E_CONFIG's engine: the session's own
app (one LLM server replica: the single-replica baseline), ROUTER_APP (three replicas,
checkpoint_routing on, max_model_len ROUTER_MAX_MODEL_LEN for the overload test's long
generations) and DEFAULT_APP (three replicas, Serve's power-of-two router). The
workload is 4 instructions (system prompts) x 24 users, one request at a time, each run under
a fresh cache_salt so every measurement starts empty. Token hit rate = cached tokens / tokens
a perfect instruction cache restores (every request after the first of its instruction: the
instruction's tokens), cached tokens from usage.prompt_tokens_details.

Replicas get a quarter CPU each (one torch thread) so both three-replica apps fit next to the
session's app on the 2-core CI box; both are deleted at the end of the module.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

import deployments.app
from deployments.cluster.index import get_index
from tests.e2e.serve_fixtures import E2E_CONFIG, MODEL_NAME

pytestmark = pytest.mark.e2e

ROUTER_APP, ROUTER_PREFIX = "hybrid-serve-checkpoint-routing", "/checkpoint-routing"
DEFAULT_APP, DEFAULT_PREFIX = "hybrid-serve-default-routing", "/default-routing"
REPLICAS = 3
QUEUE_THRESHOLD = 2
SMALL = dict(worker_num_cpus=0.25, llm_server_num_cpus=0.05, ingress_num_cpus=0.05,
             renderer_num_cpus=0.05)

INSTRUCTIONS = [
    "You are the help desk of a hardware store. Answer in one short sentence, name the aisle "
    "when you know it, never invent prices, and suggest a safer tool when one exists.",
    "You are a travel agent for rail journeys in Europe. Be brief, give the main stations, "
    "mention night trains when they fit, and always remind the traveller about reservations.",
    "You are a cooking assistant. Reply with a numbered list of at most three steps, use metric "
    "units, flag common allergens, and never recommend raw eggs for children or pregnant people.",
    "You are a patient maths tutor for teenagers. Explain one idea at a time, give a tiny "
    "worked example, ask a check question at the end, and do not give the final answer away.",
]
USERS = [f"Customer {n} here: {q}" for n, q in enumerate([
    "where are the screws?", "what time is it?", "can you help me?", "is this open on Sunday?",
    "I need something quick.", "what do you recommend?", "how long will it take?",
    "is there a cheaper option?", "what about for beginners?", "can I bring my dog?",
    "does it work in winter?", "tell me more.", "what is the first step?", "is it safe?",
    "which one is the best?", "can you repeat that?", "what should I avoid?", "any tips?",
    "how much does it weigh?", "what do most people pick?", "is there a short version?",
    "what if I make a mistake?", "where do I start?", "thanks, and one more question?"])]
# The router app's max_model_len, and the tokens its long generations may run to (after a
# ~60-token prompt): far more than the short requests sent meanwhile need.
ROUTER_MAX_MODEL_LEN = 4096
LONG_RUN_TOKENS = 3900


@dataclass
class Tally:
    cached: int = 0
    shareable: int = 0

    @property
    def rate(self) -> float:
        return self.cached / self.shareable


def chat(client, system: str, user: str, salt: str, max_tokens: int = 1):
    return client.chat.completions.create(
        model=MODEL_NAME, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        extra_body={"ignore_eos": True, "cache_salt": salt})


@pytest.fixture(scope="module")
def boundaries(tokenizer) -> dict[str, int]:
    """Each instruction's tokens: the length of the system message rendered alone."""
    return {system: len(tokenizer.apply_chat_template(
        [{"role": "system", "content": system}], add_generation_prompt=False, tokenize=True,
        return_dict=False)) for system in INSTRUCTIONS}


def deploy_three(deploy_variant, name: str, prefix: str, **overrides):
    """deploy_variant with REPLICAS LLM server replicas (build_app keeps num_replicas from
    the deployment it binds) and a warm-up request."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deployments.app, "LLMServer",
                      deployments.app.LLMServer.options(num_replicas=REPLICAS))
        client = deploy_variant(name, prefix, **SMALL, **overrides)
    chat(client, "warm up", "hello", salt="warm-up")
    return client


@pytest.fixture(scope="module")
def router_client(deploy_variant):
    return deploy_three(deploy_variant, ROUTER_APP, ROUTER_PREFIX, checkpoint_routing=True,
                        routing_queue_threshold=QUEUE_THRESHOLD,
                        engine={"max_model_len": ROUTER_MAX_MODEL_LEN})


def measure(client, salt: str, boundaries: dict[str, int]) -> Tally:
    """The workload, one request at a time, users in turn, each user's four instructions."""
    tally, seen = Tally(), set()
    for user in USERS:
        for system in INSTRUCTIONS:
            response = chat(client, system, user, salt)
            if system in seen:
                tally.shareable += boundaries[system]
                tally.cached += response.usage.prompt_tokens_details.cached_tokens
            seen.add(system)
    return tally


def holders(salt: str, system: str, tokenizer) -> frozenset[str]:
    """The replicas the router app's index lists as holding `system`'s longest checkpoint."""
    import ray

    ids = tokenizer.apply_chat_template([{"role": "system", "content": system}],
                                        add_generation_prompt=False, tokenize=True,
                                        return_dict=False)
    lookup = get_index(ROUTER_APP).lookup.remote((E2E_CONFIG.engine.model_dir, salt), list(ids))
    return ray.get(lookup, timeout=30).replica_ids


def test_router_keeps_the_single_replica_hit_rate_and_the_default_router_does_not(
        client, router_client, deploy_variant, boundaries, new_salt, tokenizer):
    started = time.monotonic()
    single = measure(client, new_salt(), boundaries)
    routed_salt = new_salt()
    routed = measure(router_client, routed_salt, boundaries)
    default = measure(deploy_three(deploy_variant, DEFAULT_APP, DEFAULT_PREFIX), new_salt(),
                      boundaries)
    held_by = [len(holders(routed_salt, system, tokenizer)) for system in INSTRUCTIONS]
    print(f"token hit rate: single replica {single.rate:.3f}, checkpoint router "
          f"{routed.rate:.3f}, default router {default.rate:.3f} "
          f"({routed.cached}/{routed.shareable}, {default.cached}/{default.shareable}); "
          f"replicas holding each instruction with the router: {held_by}; "
          f"{time.monotonic() - started:.1f} s")
    assert single.rate > 0.9
    assert routed.rate >= 0.9 * single.rate
    assert default.rate < routed.rate


def served_by(salt: str, messages: list[dict], tokenizer) -> str:
    """The replica that served a request: the one the router app's index lists as holding a
    checkpoint of exactly its prompt (its prompt checkpoint; replicas report in batches)."""
    import ray

    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))

    def exact_holders() -> frozenset[str] | None:
        lookup = get_index(ROUTER_APP).lookup.remote((E2E_CONFIG.engine.model_dir, salt), ids)
        result = ray.get(lookup, timeout=30)
        return result.replica_ids if result.length == len(ids) else None

    (replica,) = wait_for(exact_holders, 10.0, f"no replica reported the prompt of {messages[-1]}")
    return replica


def test_an_overloaded_holder_is_passed_over(router_client, boundaries, new_salt, tokenizer):
    """The holder of an instruction runs QUEUE_THRESHOLD long generations with it; requests
    with the same instruction sent meanwhile go to other replicas. Which replica served each
    request is read from the index (served_by), and "meanwhile" is an order of events: each
    short request is sent and answered while both long generations are still streaming (a
    short one queued behind them would be answered after they end). The long generations
    could run to LONG_RUN_TOKENS; they are closed once the checks are done."""
    salt, system = new_salt(), INSTRUCTIONS[0]
    assert chat(router_client, system, "first", salt).usage.prompt_tokens_details.cached_tokens == 0
    first_holders = wait_for(lambda: holders(salt, system, tokenizer), 10.0,
                             "the index never listed the instruction's holder")
    (holder,) = first_holders

    # QUEUE_THRESHOLD long generations with the instruction: routed to its holder (from the
    # router's mirror of the index, or its recent placement of the first request)
    longs = [[{"role": "system", "content": system}, {"role": "user", "content": f"long story {n}"}]
             for n in range(QUEUE_THRESHOLD)]
    started = [threading.Event() for _ in longs]
    ended = [threading.Event() for _ in longs]
    close = threading.Event()

    def long_generation(n: int) -> None:
        try:
            stream = router_client.chat.completions.create(
                model=MODEL_NAME, max_tokens=LONG_RUN_TOKENS, temperature=0, stream=True,
                messages=longs[n], extra_body={"ignore_eos": True, "cache_salt": salt})
            for _ in stream:
                started[n].set()
                if close.is_set():
                    stream.close()
                    return
        finally:
            ended[n].set()

    threads = [threading.Thread(target=long_generation, args=(n,), daemon=True) for n in range(len(longs))]
    for thread in threads:
        thread.start()
    try:
        for n, event in enumerate(started):
            assert event.wait(timeout=60), f"long generation {n} did not start"

        # the holder is at the threshold: requests with its instruction go elsewhere
        shorts = []
        for n in range(3):
            assert not any(e.is_set() for e in ended), "a long generation ended before the short requests"
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"quick question {n}"}]
            response = chat(router_client, system, messages[-1]["content"], salt, max_tokens=2)
            assert not any(e.is_set() for e in ended), (
                f"short request {n} was answered only after a long generation ended: it waited "
                f"for the holder (or the long generations ran too few tokens to overlap it)")
            shorts.append((messages, response.usage.prompt_tokens_details.cached_tokens))
    finally:
        close.set()
    for thread in threads:
        thread.join(timeout=60)

    long_servers = [served_by(salt, messages, tokenizer) for messages in longs]
    short_servers = [served_by(salt, messages, tokenizer) for messages, _ in shorts]
    print(f"holder {holder}; long generations served by {long_servers}; short requests served "
          f"by {short_servers} (cached tokens {[cached for _, cached in shorts]})")
    assert long_servers == [holder] * QUEUE_THRESHOLD
    assert holder not in short_servers
    assert shorts[0][1] == 0  # the first went to a replica without the checkpoint
    # and the index lists the replica that took the first short as a holder too
    wait_for(lambda: short_servers[0] in holders(salt, system, tokenizer), 10.0,
             "the replica that took the first short request never reported the instruction")


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return value


def test_a_restarted_index_is_refilled_by_the_replicas(router_client, new_salt, tokenizer):
    import ray

    salt, system = new_salt(), INSTRUCTIONS[1]
    chat(router_client, system, "before the restart", salt)
    before = wait_for(lambda: holders(salt, system, tokenizer), 10, "the index never listed it")
    index = get_index(ROUTER_APP)
    old = ray.get(index.incarnation.remote(), timeout=30)
    started = time.monotonic()
    ray.kill(index, no_restart=False)  # Ray restarts it, empty
    assert chat(router_client, system, "while it restarts", salt).choices  # still answered

    def refilled() -> bool:
        try:
            fresh = ray.get(index.incarnation.remote(), timeout=5) != old
            return fresh and before <= holders(salt, system, tokenizer)
        except ray.exceptions.RayError:
            return False

    # a report in flight to the killed actor waits out its call timeout (reporter.py
    # CALL_TIMEOUT_S, 10 s) before the next one reaches the restarted actor
    wait_for(refilled, 45, "the replicas did not report again to the restarted index")
    print(f"index refilled {time.monotonic() - started:.1f} s after the kill")
