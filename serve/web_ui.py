"""The chat page at `/` and CORS for the /v1 routes.

The page is a few static files shipped in the package (serve/static/: HTML, CSS, JavaScript; no
build step, nothing fetched from elsewhere) that talk to the same server's /v1 routes. The files
are read once when the app is created and served from memory with an ETag, `Cache-Control:
no-cache` and a strict Content-Security-Policy (no inline script or style, connections to the
page's own origin only; images also from `data:` URLs, as the page shows the images attached to a
message inline). They hold no data, so they are open without the API key; the page sends
the key the user types (kept in the page's memory only) on every /v1 call.

CORS is off unless origins are configured (`--allowed_origins`): then a preflight OPTIONS on a
/v1 route from one of them is answered (before the API-key check, as browsers send no key on it)
and /v1 responses to them carry `Access-Control-Allow-Origin`. No cookies are used anywhere, so
credentials are never allowed.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Iterable

from aiohttp import web

from serve.protocol import error_body

STATIC_DIR = Path(__file__).parent / "static"
# file name -> content type; the page is index.html at "/", the others under /static/.
STATIC_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
                           "frame-ancestors 'none'")
_PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_ORIGIN = re.compile(r"^https?://(\[[0-9a-f:.]+\]|[^\s/?#@:\[\]]+)(:\d{1,5})?$", re.IGNORECASE)
_HEADER_LIST = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*$")
_CORS_PREFIX = ("/v1/", "/tokenize", "/detokenize")  # the API routes (str.startswith takes a tuple)


def setup(app: web.Application, *, page: bool, allowed_origins: Iterable[str]) -> None:
    """The page's routes when `page`; the CORS response headers when origins are allowed (the
    preflight middleware comes from cors_middlewares)."""
    if page:
        add_web_ui_routes(app)
    origins = parse_allowed_origins(allowed_origins)
    if origins:
        app.on_response_prepare.append(cors_response_hook(origins))


# ---- the page ----

def add_web_ui_routes(app: web.Application) -> None:
    """GET (and HEAD) `/` and `/static/<file>` for the files of STATIC_FILES."""
    for name, content_type in STATIC_FILES.items():
        body = (STATIC_DIR / name).read_bytes()
        handler = _static_handler(body, content_type)
        app.router.add_get("/" if name == "index.html" else f"/static/{name}", handler)


def _static_handler(body: bytes, content_type: str) -> Any:
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'

    async def handle(request: web.Request) -> web.Response:
        headers = {**_PAGE_HEADERS, "ETag": etag}
        if etag in (tag.strip() for tag in request.headers.get("If-None-Match", "").split(",")):
            return web.Response(status=304, headers=headers)
        return web.Response(body=body, headers={**headers, "Content-Type": content_type})

    handle.open_without_api_key = True  # read by serve.app's auth middleware through is_public
    return handle


def is_public(request: web.Request) -> bool:
    """Whether the request goes to one of the page's routes (open without the API key)."""
    match_info = getattr(request, "match_info", None)
    return getattr(getattr(match_info, "handler", None), "open_without_api_key", False) is True


# ---- CORS ----

def parse_allowed_origins(values: Iterable[str]) -> tuple[str, ...]:
    """`scheme://host[:port]` entries (or `*`, any origin) as browsers send them in `Origin`;
    ValueError naming the first that is not one."""
    origins = []
    for value in values:
        value = value.strip()
        if not value:
            continue
        origin = value.rstrip("/")
        if origin != "*" and not _ORIGIN.match(origin):
            raise ValueError(f"not an origin: {value!r} (expected scheme://host[:port], e.g. "
                             f"http://localhost:3000, or *)")
        origins.append(origin if origin == "*" else origin.lower())
    return tuple(origins)


def cors_middlewares(allowed_origins: Iterable[str]) -> list[Any]:
    """[] without allowed origins; else the middleware answering CORS preflights on /v1 routes
    from them (to run before the API-key check)."""
    allowed = frozenset(parse_allowed_origins(allowed_origins))
    if not allowed:
        return []

    @web.middleware
    async def cors(request: web.Request, handler: Any) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        method = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or method is None or \
                not request.path.startswith(_CORS_PREFIX):
            return await handler(request)
        if isinstance(getattr(request.match_info, "http_exception", None), web.HTTPNotFound):
            return await handler(request)  # no such route: the JSON 404, whatever the origin
        if "*" not in allowed and origin not in allowed:
            # A JSON error like every refusal; without CORS headers the browser blocks the call.
            return web.json_response(error_body(f"origin {origin!r} is not allowed", "invalid_request_error",
                                                code="origin_not_allowed"), status=403)
        headers = {"Access-Control-Allow-Methods": "GET, POST, OPTIONS", "Access-Control-Max-Age": "600",
                   "Vary": "Origin, Access-Control-Request-Headers"}
        requested = request.headers.get("Access-Control-Request-Headers", "").strip()
        if requested and _HEADER_LIST.match(requested):
            headers["Access-Control-Allow-Headers"] = requested
        return web.Response(status=204, headers=headers)  # Allow-Origin: added by add_cors_headers

    return [cors]


def cors_response_hook(allowed_origins: Iterable[str]) -> Any:
    """An on_response_prepare hook adding `Access-Control-Allow-Origin` to /v1 responses (errors
    and SSE streams included) for the allowed origins."""
    allowed = frozenset(parse_allowed_origins(allowed_origins))

    async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if not request.path.startswith(_CORS_PREFIX):
            return
        response.headers["Vary"] = _vary(response.headers.get("Vary"), "Origin")
        if origin is not None and ("*" in allowed or origin in allowed):
            response.headers["Access-Control-Allow-Origin"] = "*" if "*" in allowed else origin
            if request.method != "OPTIONS":
                response.headers["Access-Control-Expose-Headers"] = "Retry-After"

    return add_cors_headers


def _vary(existing: str | None, name: str) -> str:
    names = [n.strip() for n in (existing or "").split(",") if n.strip()]
    return ", ".join(names if name.lower() in (n.lower() for n in names) else [*names, name])

