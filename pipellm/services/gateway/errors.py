"""API errors: raise `APIError` anywhere in a handler; the `errors_as_json` middleware answers
with its status and body (and turns any other failure into one), in OpenAI's shape or, under a
path prefix given its own shape (Anthropic's /v1/messages), in that one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from aiohttp import web

log = logging.getLogger("pipellm.gateway")

_DEFAULT_TYPES = {500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error to answer with HTTP `status` and the body `{"error": {...}}` OpenAI clients parse.

    `type` defaults to "invalid_request_error" for 4xx, "service_unavailable" for 503 and
    "server_error" for anything else; `param` names the offending request field (or None);
    `code` is a machine-readable code such as "model_not_found" (or None).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        if type is None:
            type = "invalid_request_error" if 400 <= status < 500 else (
                _DEFAULT_TYPES.get(status, "server_error"))
        self.type = type

    def body(self) -> dict:
        """The JSON error body, exactly `{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return (f"APIError({self.status}, {self.message!r}, param={self.param!r}, "
                f"code={self.code!r}, type={self.type!r})")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request is malformed or asks for something unsupported."""
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """404: e.g. an unknown model (code "model_not_found")."""
    return APIError(404, message, param=param, code=code)


def unknown_model(name: str) -> APIError:
    """404 model_not_found: a request named a model this server does not serve."""
    return not_found(f"The model `{name}` does not exist."[:300], "model", "model_not_found")


def payload_too_large(message: str = "Request body is too large.", param: str | None = None,
                      code: str | None = None) -> APIError:
    """413: the request body exceeds the gateway's size limit."""
    return APIError(413, message, param=param, code=code)


def too_many_requests(message: str = "Too many requests; retry later.", param: str | None = None,
                      code: str | None = "rate_limit_exceeded") -> APIError:
    """429: admission control refused the request (code "rate_limit_exceeded" by default)."""
    return APIError(429, message, param=param, code=code)


def unavailable(message: str = "The server is temporarily unavailable.",
                param: str | None = None, code: str | None = None) -> APIError:
    """503 (type "service_unavailable"): e.g. the engine is down or shutting down."""
    return APIError(503, message, param=param, code=code)


def errors_as_json(shapes: Mapping[str, Callable[[APIError], dict]] | None = None):
    """The middleware: every failure leaves as a JSON error, never a stack trace; its body
    is `APIError.body`, or `shapes[prefix](error)` for a path under one of the prefixes."""
    shapes = dict(shapes or {})

    def body(request: web.Request, err: APIError) -> dict:
        shape = next((f for p, f in shapes.items() if request.path.startswith(p)), None)
        return shape(err) if shape is not None else err.body()

    @web.middleware
    async def middleware(request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as e:
            headers = {"Retry-After": "1"} if e.status in (429, 503) else None
            return web.json_response(body(request, e), status=e.status, headers=headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = APIError(e.status, e.reason or "error", code=None)
            return web.json_response(body(request, err), status=e.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:  # a bug: log it, answer 500, keep serving
            log.exception("unhandled error on %s", request.path)
            err = APIError(500, "Internal server error.")
            return web.json_response(body(request, err), status=500)

    return middleware
