"""The console as one Starlette application: routes, static files, security headers, and
errors that are pages or problem+json, never a traceback."""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from importlib import resources

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fencegate.console import actions, metrics, pages, signin
from fencegate.console.auth import ConsoleToken, SessionSigner, TokenSet, load_tokens
from fencegate.console.web import Console, problem_response, signed_in, templates
from fencegate.problems import Problem
from fencegate.store.release_rule import DEFAULT_RELEASE_MARGIN

log = logging.getLogger("fencegate.console")

SESSION_SECONDS = 12 * 3600.0  # one night shift

# Every script and style is shipped in the package; nothing may load from elsewhere, and no
# other site may frame the console (clickjacking an action button).
_HEADERS = [
    (b"content-security-policy",
     b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
     b"form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    # Not no-referrer: under it a browser sends "Origin: null" with forms, which the
    # Origin check must refuse.
    (b"referrer-policy", b"same-origin"),
]  # fmt: skip


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {name.lower() for name, _ in headers}
                headers += [(k, v) for k, v in _HEADERS if k not in names]
                if b"cache-control" not in names and not scope["path"].startswith(
                    f"{scope.get('root_path', '')}/static/"
                ):
                    headers.append((b"cache-control", b"no-store"))  # pages may hold secrets
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def create_console_app(
    database_url: str | None,
    *,
    tokens: Sequence[ConsoleToken] | None = None,
    show_payloads: bool = False,
    refresh_seconds: int = 15,
    session_secret: bytes | None = None,
    release_margin: float = DEFAULT_RELEASE_MARGIN,
    timeout: float = 10.0,
) -> Starlette:
    """The console over the store at ``database_url``. ``tokens`` None reads them from
    ``FENCEGATE_CONSOLE_TOKENS``; none at all raises `TokenConfigError`. ``release_margin``
    (seconds) is the release rule's, as the gateways use it."""
    token_set = TokenSet(tokens if tokens is not None else load_tokens(None, os.environ))
    console = Console(
        database_url=database_url,
        tokens=token_set,
        signer=SessionSigner(session_secret or secrets.token_bytes(32), max_age=SESSION_SECONDS),
        templates=templates(),
        show_payloads=show_payloads,
        refresh_seconds=max(0, int(refresh_seconds)),
        timeout=timeout,
        release_margin=float(release_margin),
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await console.close()

    routes = [
        # Browsers ask for /favicon.ico on every page: answer it, not with a 404.
        Route("/favicon.ico", _favicon, methods=["GET"]),
        Route("/login", signin.login_form, methods=["GET"]),
        Route("/login", signin.login, methods=["POST"]),
        Route("/logout", signin.logout, methods=["POST"]),
        Route("/", signed_in(pages.overview), methods=["GET"]),
        Route("/jobs", signed_in(pages.jobs), methods=["GET"]),
        Route("/jobs/{job_id:int}", signed_in(pages.job), methods=["GET"]),
        Route("/jobs/{job_id:int}/{action:str}", signed_in(actions.job_action), methods=["POST"]),
        Route("/keys", signed_in(pages.keys), methods=["GET"]),
        Route("/key", signed_in(pages.key), methods=["GET"]),
        Route("/key/resolve", signed_in(actions.resolve), methods=["POST"]),
        Route("/trace", signed_in(pages.trace), methods=["GET"]),
        Route("/audit", signed_in(pages.audit), methods=["GET"]),
        Route("/metrics", signed_in(metrics.metrics), methods=["GET"]),
        Mount("/static", StaticFiles(packages=[("fencegate.console", "static")]), name="static"),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    app.state.console = console
    app.add_middleware(SecurityHeaders)
    return app


_FAVICON = resources.files("fencegate.console").joinpath("static", "favicon.svg").read_bytes()


async def _favicon(request: Request) -> Response:
    return Response(
        _FAVICON, media_type="image/svg+xml", headers={"cache-control": "public, max-age=86400"}
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    titles = {404: ("not-found", "Not found"), 405: ("method-not-allowed", "Method not allowed")}
    kind, title = titles.get(exc.status_code, ("error", "Error"))
    problem = Problem(exc.status_code, kind, title, str(exc.detail))
    return problem_response(request, problem)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("console request failed: %s %s", request.method, request.url.path)
    problem = Problem(
        500, "console-error", "Console error", "the console failed on this request; see its log"
    )
    return problem_response(request, problem)
