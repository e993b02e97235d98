"""One structured log line for every request the ingress serves, written when it ends.

    request_done {"cached_tokens": 96, "duration_s": 0.41, "finish_reason": "length", ...}

The fields: request id (null for an HTTP request refused before it was given one), status
("ok", "error" with its HTTP status, or "cancelled" when the client went away first), finish
reason, prompt, cached and output tokens, time to first token
and duration in seconds. Never the prompt or the output text. Lines go to the "ray.serve"
logger, so Serve writes them to the ingress replica's log file.
"""

from __future__ import annotations

import json
import logging
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

    def line(self) -> str:
        fields = asdict(self)
        for key in ("ttft_s", "duration_s"):
            if fields[key] is not None:
                fields[key] = round(fields[key], 4)
        return PREFIX + json.dumps(fields, sort_keys=True)


def log_request(record: RequestRecord) -> None:
    logger.info(record.line())
