"""Two long completions in flight on one app, one plain and one streamed, for the fault tests
(a process of the app is killed while they run): start them, wait until both run, then read
how each ended."""

from __future__ import annotations

import threading
import time

import httpx

MODEL_NAME = "hybrid-serve-tiny"
LONG_TOKENS = 400


class TwoLongRequests:
    """`start()` sends a plain and a streamed completion of LONG_TOKENS tokens to
    `base_url + prefix`; `wait_running(server)` returns once the stream has its first chunk and
    the LLM server (a deployment handle) holds both; `finish()` joins them. Then `plain` is
    the plain answer, `stream_status` and `stream_events` (the `data:` payloads) the stream's."""

    def __init__(self, base_url: str, prefix: str, prompt: str) -> None:
        self._url = f"{base_url.rstrip('/')}{prefix}/v1/completions"
        self._body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": LONG_TOKENS,
                      "temperature": 0, "ignore_eos": True}
        self._first_chunk = threading.Event()
        self._threads = [threading.Thread(target=self._plain), threading.Thread(target=self._streamed)]
        self.plain: httpx.Response | None = None
        self.stream_status: int | None = None
        self.stream_events: list[str] = []

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def wait_running(self, server, timeout_s: float = 60.0) -> None:
        assert self._first_chunk.wait(timeout_s), "the stream produced no first chunk"
        deadline = time.monotonic() + timeout_s
        while server.pool_usage.remote().result().num_requests < 2:
            assert time.monotonic() < deadline, "both requests never ran together"
            time.sleep(0.05)

    def finish(self, timeout_s: float = 120.0) -> None:
        for thread in self._threads:
            thread.join(timeout_s)

    def assert_both_ended_with_503(self) -> None:
        """The plain answer is a 503 replica_unavailable; the stream, whose headers had left
        with its first token, ends early with that error as its last event before [DONE]."""
        assert self.plain is not None and self.plain.status_code == 503, self.plain
        assert self.plain.json()["error"]["code"] == "replica_unavailable"
        assert self.stream_status == 200
        events = self.stream_events
        assert events[-1] == "[DONE]" and '"replica_unavailable"' in events[-2], events[-2:]
        assert len(events) < LONG_TOKENS

    def _plain(self) -> None:
        with httpx.Client(timeout=120) as client:
            self.plain = client.post(self._url, json=self._body)

    def _streamed(self) -> None:
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", self._url, json={**self._body, "stream": True}) as response:
                self.stream_status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.stream_events.append(line.removeprefix("data: "))
                        self._first_chunk.set()


def until_it_answers(check, timeout_s: float) -> None:
    """Call `check()` every second until it passes (a replaced replica starts; requests
    meanwhile may fail); re-raise its last failure after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
