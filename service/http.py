"""The gateway's HTTP surface: the FastAPI ``app`` the ``Gateway`` deployment serves (its
routes: ``service.gateway``), the refusals made before routing, the JSON error answers and the
dashboard's static files.

A classify request refused before routing is counted once, by the ``CheckBody`` middleware,
whichever layer refused it; a routed one is recorded by ``Gateway._classify``. The handlers
here read the replica's state as ``replica_state.X`` (why: ``service.replica_state``); what
they note about one request travels in its scope as a ``service.request_book.RequestBook``.
"""

import asyncio
from importlib.metadata import version
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import replica_state
from .inputs import ApiError, StrictJSONRoute, charset_refusal, declared_charset
from .request_book import RequestBook
from .schemas import ErrorResponse


class ServiceAPI(FastAPI):
    def openapi(self) -> dict:
        """FastAPI's schema without the ``"example": {}`` it writes for every query parameter
        in a Serve replica: Serve cloudpickles the app, the parameters' "unset" sentinel comes
        back as a different object, and FastAPI then takes it for a real (object) example —
        invalid for a string, boolean or number parameter, and what Swagger UI would send."""
        schema = super().openapi()
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                for param in op.get("parameters", []):
                    if param.get("example") == {}:
                        del param["example"]
        return schema


app = ServiceAPI(
    redirect_slashes=False,  # /v1/classify/ is a 404, not a redirect built from the Host header
    redoc_url=None,  # ReDoc loads its script from a CDN; /docs (Swagger UI) does too
    title="mita-serve",
    version=version("mita-serve"),
    description="Classify long sequences with MiTA (Mixture-of-Top-k Attention) or dense "
                "attention; per-stage timings in responses and as Prometheus metrics.",
)
app.router.route_class = StrictJSONRoute
BINARY_PATH = "/v1/classify/binary"
CLASSIFY_PATHS = ("/v1/classify", "/v1/classify/batch", BINARY_PATH)
# The query parameters each endpoint takes; on these paths any other is refused (422), so a
# ?variant= sent to the JSON endpoint is not silently ignored. Other paths (the dashboard
# page reads its own ?refresh_s=) are not checked.
QUERY_PARAMS = {("POST", "/v1/classify"): (), ("POST", "/v1/classify/batch"): (),
                ("POST", BINARY_PATH): ("variant", "profile", "dtype"),
                ("GET", "/v1/stats"): ("window_s",), ("GET", "/v1/routing"): ()}
MAX_ERRORS_SHOWN = 10


def _error(status: int, message: str, detail=None, headers=None) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=message, detail=detail).model_dump(exclude_none=True),
                        status_code=status, headers=headers)


def route_path(request: Request) -> str:
    """The request's path below the application's route prefix (``/m2/v1/classify`` →
    ``/v1/classify`` under ``route_prefix: /m2``), as Starlette's router matches it: Serve
    passes the prefix as the ASGI ``root_path`` and keeps it in ``path``. Every path-keyed
    rule of the gateway uses this, so none switches off under a prefix."""
    path, root = request.scope["path"], request.scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


def query_refusal(request: Request, path: str) -> tuple[int, str] | None:
    """(422, why) when a checked endpoint (``QUERY_PARAMS``; ``path``: ``route_path``) gets a
    query parameter it does not take, or one parameter more than once (which copy wins is
    ambiguous: refused, as duplicate JSON keys are); else None."""
    known = QUERY_PARAMS.get((request.method, path))  # else routing: 404/405
    if known is None:
        return None
    params = request.query_params
    unknown = sorted(set(params) - set(known))
    if unknown:
        takes = (f"known: {', '.join(known)}" if known else
                 "this endpoint takes none" + (" (variant and profile go in the JSON body)"
                                               if request.method == "POST" else ""))
        return 422, f"unknown query parameter(s) {unknown}; {takes}"
    repeated = sorted(k for k in set(params) if len(params.getlist(k)) > 1)
    if repeated:
        return 422, f"query parameter(s) {repeated} given more than once"
    return None


class CheckBody:
    """Before any parsing: POST bodies to the classify endpoints must be JSON (binary ids for
    ``/v1/classify/binary``) with a Content-Length within the limit (other paths and methods
    go on to routing: 404/405). Opens the request's ``RequestBook`` (its arrival time, which
    the response's ``pre_forward_ms`` and the request latency count from) and runs the book's
    ``after_response`` calls once the response has been handed to Serve.

    The one place a classify request refused before routing is counted
    (``requests_total{variant="none"}`` and the stats window), whichever layer refused it:
    this middleware, routing (404/405), parsing, validation or the endpoint's own checks
    (``replica_state.record_unrouted``). Requests that were routed (the book's ``routed``)
    were recorded with their variant where they were routed.

    A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` (``@app.middleware``) runs
    the app in a task of its own behind a memory stream, a cost on every request
    (``benchmarks/serve_overhead.py``)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        book = RequestBook.open(scope)
        request = Request(scope)
        path = route_path(request)
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        refusal = refusal_of(request, path)
        if refusal is not None:
            await refusal(scope, receive, send_status)
        elif request.method == "POST" and path in CLASSIFY_PATHS:
            replica_state.inflight += 1
            try:
                await self.app(scope, receive, send_status)
            finally:
                replica_state.inflight -= 1
                if book.after_response:
                    # on the loop's next pass: Serve's sender, woken by the response's
                    # messages, is queued before it and ships them first
                    asyncio.get_running_loop().call_soon(book.run_after_response)
        else:
            await self.app(scope, receive, send_status)
        if path in CLASSIFY_PATHS and not book.routed:
            replica_state.record_unrouted(status)


def refusal_of(request: Request, path: str) -> JSONResponse | None:
    """The answer to a request refused before parsing (draining, query parameters, the
    classify endpoints' Content-Type, -Encoding and -Length), or None."""
    if replica_state.draining and path != "/healthz":
        # shutting down: in-flight requests finish, new ones go elsewhere (liveness stays ok)
        return _error(503, "the service is shutting down; retry on another instance",
                      headers={"Retry-After": str(replica_state.retry_after_s)})
    refusal = query_refusal(request, path)
    if refusal is None and request.method == "POST" and path in CLASSIFY_PATHS:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        length = request.headers.get("content-length", "").strip()
        limit = replica_state.max_body_bytes
        want = ("application/octet-stream" if path == BINARY_PATH
                else "application/json")
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if len(request.headers.getlist("content-type")) > 1:
            refusal = (400, "more than one Content-Type header")
        elif ctype != want:
            refusal = (415, f"Content-Type must be {want}, got {ctype[:60] or 'none'!r}")
        elif want == "application/json" and (bad := charset_refusal(
                declared_charset(request.headers.get("content-type", "")))):
            refusal = (415, bad)
        elif encoding != "identity":
            refusal = (415, f"Content-Encoding {encoding[:40]!r} is not accepted: send the "
                            "body uncompressed")
        elif not length:
            refusal = (411, "a Content-Length header is required (chunked uploads are not "
                            "accepted)" if "transfer-encoding" in request.headers else
                            "the request has no body: send the JSON (or binary ids) with a "
                            "Content-Length header")
        elif not length.isdigit():
            refusal = (400, "invalid Content-Length header")
        elif int(length) > limit:
            refusal = (413, f"request body of {length} bytes exceeds the limit of "
                            f"{limit} bytes")
    return None if refusal is None else _error(*refusal)


app.add_middleware(CheckBody)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    raw = exc.errors()
    # A 4 MB body can hold ~10^6 bad items: report the first few, and how many there were.
    errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type")}
              for e in raw[:MAX_ERRORS_SHOWN]]
    more = (f" ({len(raw)} errors; the first {MAX_ERRORS_SHOWN} in detail)"
            if len(raw) > MAX_ERRORS_SHOWN else "")
    if raw and raw[0].get("type") == "json_invalid":
        why = (raw[0].get("ctx") or {}).get("error")
        status, message = 400, f"malformed JSON body: {why}" if why else "malformed JSON body"
    elif any(e["type"] == "missing" and e["loc"] == ["body"] for e in errors):
        what = "'items'" if route_path(request) == "/v1/classify/batch" else "'text' or 'ids'"
        status, message = 400, f"empty request body: send a JSON object with {what}"
        errors = None
    else:
        msg = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}"
                        for e in errors[:5])
        status, message = 422, f"invalid request: {msg}{more}"
    return _error(status, message, errors)


@app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError):
    return _error(exc.status, exc.message, headers=exc.headers)


# The dashboard: one page and its script, shipped inside the package (no CDN), read once.
STATIC = files("service") / "static"
DASHBOARD_HTML = (STATIC / "dashboard.html").read_text(encoding="utf-8")
DASHBOARD_JS = (STATIC / "dashboard.js").read_text(encoding="utf-8")
STATIC_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'",
}

ERRORS = {code: {"model": ErrorResponse} for code in (400, 411, 413, 415, 422, 500, 503, 504)}
# A single classification's answers, with the header gateway.classify_response sets
CLASSIFY_RESPONSES = ERRORS | {200: {"headers": {"Server-Timing": {
    "description": "forward;dur=<ms>: the model forward's milliseconds (the profile's total_ms)",
    "schema": {"type": "string"}}}}}
