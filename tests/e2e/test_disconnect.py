"""A client that goes away mid-stream gets its request aborted and its cache freed."""

from __future__ import annotations

import httpx

MODEL_NAME = "hybrid-serve-tiny"


def test_disconnect_mid_stream_aborts_and_frees_pools(http, app_handle, wait_until_idle):
    idle = wait_until_idle()
    aborted_before = app_handle.num_aborted_requests.remote().result()
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Talk for a long time."}],
            "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=str(http.base_url), timeout=60) as own_connection:
        with own_connection.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    busy = app_handle.pool_usage.remote().result()  # still streaming
                    break
        # Leaving the loop closes the unread response, and with it the TCP connection.
    assert busy.num_requests == 1 and not busy.idle
    after = wait_until_idle(timeout_s=20)  # the aborted request holds nothing any more
    assert after.num_requests == 0 and after.idle
    assert after.free_state_slots == idle.total_state_slots
    assert app_handle.num_aborted_requests.remote().result() == aborted_before + 1
