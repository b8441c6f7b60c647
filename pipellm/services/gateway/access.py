"""Who may call the API: the API key (--api-key) and CORS (--allowed-origins), as middlewares.

- API key: every path but the open ones (`/health`, `/ping`, `/metrics`, `/version`) needs
  `Authorization: Bearer KEY` or (as Anthropic's clients send it) `x-api-key: KEY`; otherwise
  401 (code "invalid_api_key").
  CORS preflights (OPTIONS) never need it: browsers send them without credentials.
- CORS, as vLLM does it (default: any origin): an answer to a request with an `Origin` the list
  allows carries `Access-Control-Allow-Origin`; a preflight from one is answered here, 204,
  with the methods and the headers it asked for. Origins the list does not allow get no CORS
  headers (the browser then refuses), and the request is otherwise served as usual.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from pipellm.services.gateway.errors import APIError

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
_PREFLIGHT_MAX_AGE_S = "600"


def api_key_middleware(key: str):
    bearer, bare = f"Bearer {key}".encode(), key.encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler):
        if request.method == "OPTIONS" or request.path in OPEN_PATHS:
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        alt = request.headers.get("x-api-key", "").encode()
        if not (hmac.compare_digest(given, bearer) or hmac.compare_digest(alt, bare)):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer "
                           "<key>' with the key the server was started with.",
                           code="invalid_api_key")
        return await handler(request)

    return check_api_key


class Cors:
    """CORS for `origins`: `preflight`, a middleware answering OPTIONS preflights, and
    `on_prepare`, a response-prepare signal adding the headers to every answer (streams
    included: their headers leave before the handler returns)."""

    def __init__(self, origins: frozenset[str]):
        self.origins, self.any_origin = origins, "*" in origins

    def allow_headers(self, request: web.Request) -> dict[str, str]:
        origin = request.headers.get("Origin")
        if origin is None or not (self.any_origin or origin.rstrip("/") in self.origins):
            return {}
        if self.any_origin:
            return {"Access-Control-Allow-Origin": "*"}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    @web.middleware
    async def preflight(self, request: web.Request, handler):
        allow = self.allow_headers(request)
        if not (allow and request.method == "OPTIONS"
                and "Access-Control-Request-Method" in request.headers):
            return await handler(request)
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers":
                request.headers.get("Access-Control-Request-Headers", "*"),
            "Access-Control-Max-Age": _PREFLIGHT_MAX_AGE_S})

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(self.allow_headers(request))
