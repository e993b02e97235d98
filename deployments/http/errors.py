"""API errors: one exception type that carries an HTTP status, and the FastAPI handlers that turn
every failure (validation, unknown route, engine refusal, bug) into an OpenAI error body.

APIError crosses Serve handle calls intact (plain args, picklable), so the Python handle API
raises the same errors the HTTP API returns.
"""

from __future__ import annotations

import logging
import math
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.http.protocol import ErrorInfo, ErrorResponse
from engine.execution.executor import ExecutorDiedError
from engine.interfaces.sampling_params import InvalidRequestError

logger = logging.getLogger("ray.serve")

# The Retry-After of a 503: a full queue drains, a lost replica is replaced, within seconds.
RETRY_AFTER_S = 1.0
M = TypeVar("M", bound=BaseModel)


class APIError(Exception):
    """A request failure with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(status_code, message, type, param, code, retry_after_s)  # all pickled
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # sent as the Retry-After header (whole seconds)

    def __str__(self) -> str:
        return f"{self.status_code} {self.type}: {self.message}"

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> APIError:
        return cls(400, message, "invalid_request_error", param)

    @classmethod
    def model_not_found(cls, model: str) -> APIError:
        return cls(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                   "model_not_found")

    @classmethod
    def unavailable(cls) -> APIError:
        return cls(503, "The model replica lost a process and is being replaced; retry the "
                   "request.", "server_error", None, "replica_unavailable", RETRY_AFTER_S)

    @classmethod
    def overloaded(cls) -> APIError:
        return cls(503, "The server's request queues are full; retry after the Retry-After "
                   "delay.", "server_error", None, "overloaded", RETRY_AFTER_S)

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code))


def as_api_error(exc: BaseException) -> APIError:
    """Map any exception (possibly wrapped by Ray, several times) to an APIError.

    InvalidRequestError (from the engine, or a check the ingress runs) becomes 400 naming its
    param; a dead executor or a dead actor of the replica (it is being replaced) becomes 503;
    anything unknown is logged and becomes 500.
    """
    root = exc
    while getattr(root, "cause", None) is not None:  # RayTaskError keeps the original here
        root = root.cause
    if isinstance(root, APIError):
        return APIError(*root.args)
    if isinstance(root, BackPressureError):  # a deployment's max_queued_requests is reached
        return APIError.overloaded()
    if isinstance(root, InvalidRequestError):
        return APIError.bad_request(str(root.args[0]) if root.args else str(root), root.param)
    if isinstance(root, ExecutorDiedError) or _is_dead_actor(root):
        logger.warning("a process of the model replica is gone: %s: %s", type(root).__name__, root)
        return APIError.unavailable()
    logger.exception("internal error while serving a request", exc_info=exc)
    return APIError(500, "Internal server error", "server_error", None, "internal_error")


def _is_dead_actor(exc: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


def error_json(error: APIError) -> JSONResponse:
    headers = None
    if error.retry_after_s is not None:
        headers = {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
    return JSONResponse(error.to_response().model_dump(), status_code=error.status_code,
                        headers=headers)


async def send_error(scope, receive, send, error: APIError, headers: dict | None = None) -> None:
    """Answer an ASGI request with `error` (for middlewares, which answer before any route)."""
    response = error_json(error)
    response.headers.update(headers or {})
    await response(scope, receive, send)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """One 400 from pydantic/FastAPI validation errors; `param` is the first bad field's path."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError.bad_request(f"Malformed JSON body: {detail}".rstrip(": "))
    messages = []
    for err in errors:
        path = _param_path(err.get("loc", ()))
        messages.append(f"{path}: {_clean(err.get('msg', ''))}" if path else _clean(err.get("msg", "")))
    return APIError.bad_request("; ".join(messages), _param_path(first.get("loc", ())) or None)


def validated(model: type[M], value: Any) -> M:
    """`value` validated as the request model `model`: a handle caller's request object (maybe
    built with model_construct, which validates nothing) or a dict. Raises the APIError 400 the
    HTTP API answers to a body that fails the same validation."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


def install_error_handlers(app: FastAPI) -> None:
    """Replace FastAPI's 422 and HTML-ish defaults with OpenAI error bodies."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_json(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_json(APIError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(APIError)
    async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_json(exc)

    @app.exception_handler(Exception)
    async def _on_internal(_: Request, exc: Exception) -> JSONResponse:
        return error_json(as_api_error(exc))


def _param_path(loc: tuple | list) -> str:
    """("body", "messages", 0, "content", "str") -> "messages[0].content".

    pydantic appends the union member it tried ("str", "list[int]", "function-after[...]");
    those tags are not field names and are dropped.
    """
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path") else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part:
            break
        else:
            out += f".{part}" if out else part
    return out


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _clean(msg: str) -> str:
    return msg.removeprefix("Value error, ")
