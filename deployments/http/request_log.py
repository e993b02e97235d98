"""One structured log line for every request that reaches an ingress route, written when it
ends (HTTP and handle calls alike).

    request_done {"cached_tokens": 96, "duration_s": 0.41, "finish_reason": "length", ...}

The fields: request id (null for a request refused before it was given one), status ("ok",
"error" with its HTTP status, or "cancelled" when the client went away first), finish reason,
prompt, cached and output tokens, the prompt's render time, time to first token (which includes
it), duration and end time in seconds.
Requests a middleware answers (401, 413, 429) and bodies that fail validation never reach a
route and have no line. Never the prompt or the output text. Lines go to the "ray.serve"
logger, so Serve writes them to the ingress replica's log file.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

logger = logging.getLogger("ray.serve")
PREFIX = "request_done "


@dataclass
class RequestRecord:
    request_id: str | None  # None: refused before an id was given (validation, rendering)
    status: str = "cancelled"
    http_status: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    duration_s: float = 0.0
    render_s: float | None = None  # None: refused before its prompt was rendered

    def line(self) -> str:
        """The log line: PREFIX, then the fields as one JSON object with the time the line is
        written (end_time, Unix seconds)."""
        fields = {**asdict(self), "end_time": round(time.time(), 3)}
        for key in ("ttft_s", "duration_s", "render_s"):
            if fields[key] is not None:
                fields[key] = round(fields[key], 4)
        return PREFIX + json.dumps(fields, sort_keys=True)


def log_request(record: RequestRecord) -> None:
    logger.info(record.line())
