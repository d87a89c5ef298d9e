"""What every console request goes through: the state it shares, who is asking, the form it
posted (with its CSRF token and Origin checked), and how pages and errors are answered."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import jinja2
import orjson
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from fencegate.console.auth import ConsoleToken, Session, SessionSigner, TokenSet
from fencegate.errors import StoreUnavailable
from fencegate.lease import LeaseQueue
from fencegate.problems import Problem
from fencegate.store import GatewayStore, open_gateway_store
from fencegate.store.inspect import Inspector
from fencegate.store.release_rule import DEFAULT_RELEASE_MARGIN

COOKIE = "fencegate_console"
MAX_FORM_BYTES = 256 * 1024  # a resolve form carries the answer's body; nothing else is big


@dataclass
class Console:
    """The console's shared state. The stores are opened on first use, on the server's own
    event loop (an asyncpg pool belongs to the loop that made it), and closed at shutdown."""

    database_url: str | None
    tokens: TokenSet
    signer: SessionSigner
    templates: jinja2.Environment
    show_payloads: bool
    refresh_seconds: int
    timeout: float
    # The release rule's margin (seconds), as the gateways use it: resolving waits for it.
    release_margin: float = DEFAULT_RELEASE_MARGIN
    _inspector: Inspector | None = None
    _store: GatewayStore | None = None
    _queue: LeaseQueue | None = None
    _lock: asyncio.Lock | None = None

    async def inspector(self) -> Inspector:
        await self._open()
        assert self._inspector is not None
        return self._inspector

    async def store(self) -> GatewayStore:
        await self._open()
        assert self._store is not None
        return self._store

    async def queue(self) -> LeaseQueue:
        await self._open()
        assert self._queue is not None
        return self._queue

    async def _open(self) -> None:
        if self._queue is not None:
            return
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if self._inspector is None:
                self._inspector = await Inspector.open(self.database_url, timeout=self.timeout)
            if self._store is None:
                self._store = await open_gateway_store(
                    self.database_url, run_migrations=False, pool_max_size=2,
                    timeout=self.timeout,
                )  # fmt: skip
            if self._queue is None:
                self._queue = await LeaseQueue.connect(
                    self.database_url, timeout=self.timeout, pool_max_size=2
                )

    async def close(self) -> None:
        for resource in (self._queue, self._store, self._inspector):
            if resource is not None:
                await resource.close()
        self._inspector = self._store = self._queue = None


@dataclass(frozen=True, slots=True)
class Viewer:
    token: ConsoleToken
    session: Session | None  # None when the request came with a bearer token

    @property
    def name(self) -> str:
        return self.token.name

    @property
    def actor(self) -> str:
        return f"console:{self.token.name}"

    @property
    def tenant(self) -> str | None:
        return self.token.tenant


def console_of(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


def base_path(request: Request) -> str:
    """Where the console is mounted: every link and the cookie path start here."""
    return str(request.scope.get("root_path", "")).rstrip("/")


# The query parameter that carries a console token on a page (RFC 6750 §2.3).
ACCESS_TOKEN = "access_token"


def session_of(request: Request) -> Session | None:
    value = request.cookies.get(COOKIE)
    return console_of(request).signer.loads(value) if value else None


def identify(request: Request) -> Viewer | None:
    """The bearer token, else the signed session; None when neither names a token."""
    console = console_of(request)
    authorization = request.headers.get("authorization")
    if authorization is not None:
        scheme, _, presented = authorization.partition(" ")
        token = console.tokens.match(presented.strip()) if scheme.lower() == "bearer" else None
        if token is None:
            raise Problem(
                401, "not-signed-in", "Not signed in", "that bearer token is not a console token"
            )
        return Viewer(token, None)
    presented_in_query = request.query_params.get(ACCESS_TOKEN)
    if presented_in_query is not None and request.method in ("GET", "HEAD"):
        # RFC 6750 §2.3, for scripts that cannot send a header (a headless browser's
        # --screenshot URL): pages only, never an action (a POST needs the header or a form).
        token = console.tokens.match(presented_in_query.strip())
        if token is None:
            raise Problem(
                401, "not-signed-in", "Not signed in", f"that {ACCESS_TOKEN} is not a console token"
            )
        return Viewer(token, None)
    session = session_of(request)
    if session is None or session.name is None or session.token_tag is None:
        return None
    token = console.tokens.by_name(session.name)
    if token is None or not hmac.compare_digest(token.sha256.hex()[:16], session.token_tag):
        return None
    return Viewer(token, session)


def set_session(response: Response, request: Request, session: Session) -> None:
    console = console_of(request)
    response.set_cookie(
        COOKIE,
        console.signer.dumps(session),
        max_age=int(console.signer.max_age),
        path=base_path(request) or "/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


async def read_form(request: Request, viewer: Viewer | None) -> dict[str, str]:
    """The posted form, after the checks every POST passes: a same-origin request, and the
    session's CSRF token in the form. A bearer request carries no ambient credential a
    browser could replay, so it needs no CSRF token (its Origin is still checked)."""
    check_origin(request)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise Problem(
            415,
            "unsupported-form",
            "Unsupported form",
            "post an application/x-www-form-urlencoded form",
        )
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise Problem(413, "form-too-large", "Form too large", f"at most {MAX_FORM_BYTES} bytes")
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=50)
    except (UnicodeDecodeError, ValueError):
        raise Problem(
            400, "malformed-form", "Malformed form", "the form is not valid UTF-8 form data"
        ) from None
    form = {name: values[0] for name, values in fields.items()}
    if viewer is not None and viewer.session is None:
        return form
    session = session_of(request)
    presented = form.get("csrf", "")
    if session is None or not presented or not hmac.compare_digest(presented, session.csrf):
        raise Problem(
            403, "form-expired-or-forged", "Form expired or forged",
            "the form's CSRF token does not match this session: open the page again and resubmit",
        )  # fmt: skip
    return form


def check_origin(request: Request) -> None:
    """A POST must come from a page of this console. The host is compared, not the scheme:
    behind a TLS-terminating proxy the console itself sees plain HTTP."""
    host = request.headers.get("host", "")
    for header in ("origin", "referer"):
        value = request.headers.get(header)
        if value is None:
            continue
        if value == "null" or urlsplit(value).netloc != host:
            raise Problem(
                403,
                "cross-origin-form-refused",
                "Cross-origin form refused",
                f"{header} {value!r} is not {host}",
            )
        return
    # Neither header: not a browser (browsers send Origin on every POST); the CSRF token
    # (or a bearer token) still decides.


def wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "")


def problem_response(request: Request, problem: Problem) -> Response:
    """A problem as an HTML page for a browser, else as the gateway answers it (problem+json)."""
    if not wants_html(request):
        return Response(
            problem.body(), status_code=problem.status, headers=dict(problem.response_headers())
        )
    try:
        viewer = identify(request)
    except Problem:
        viewer = None
    return render(request, "error.html", {"problem": problem}, viewer=viewer,
                  status=problem.status, refresh=False)  # fmt: skip


def render(
    request: Request,
    template: str,
    context: dict[str, Any],
    *,
    viewer: Viewer | None,
    status: int = 200,
    refresh: bool = True,
) -> HTMLResponse:
    console = console_of(request)
    html = console.templates.get_template(template).render(
        request=request,
        base=base_path(request),
        viewer=viewer,
        csrf=viewer.session.csrf if viewer is not None and viewer.session is not None else "",
        refresh=console.refresh_seconds if refresh else 0,
        show_payloads=console.show_payloads,
        **context,
    )
    return HTMLResponse(html, status_code=status)


def redirect(request: Request, path: str, **query: str) -> RedirectResponse:
    suffix = f"?{urlencode(query)}" if query else ""
    return RedirectResponse(f"{base_path(request)}{path}{suffix}", status_code=303)


Handler = Callable[[Request, Viewer], Awaitable[Response]]


def signed_in(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """Every page but the sign-in form: find the viewer, turn failures into answers."""

    async def endpoint(request: Request) -> Response:
        try:
            viewer = identify(request)
            if viewer is None:
                if wants_html(request) and request.method == "GET":
                    return redirect(request, "/login", next=request.url.path[len(
                        base_path(request)):] + (f"?{request.url.query}" if request.url.query
                                                 else ""))  # fmt: skip
                raise Problem(
                    401, "not-signed-in", "Not signed in", "sign in, or send Authorization: Bearer"
                )
            return await handler(request, viewer)
        except Problem as problem:
            return problem_response(request, problem)
        except StoreUnavailable as exc:
            return problem_response(
                request, Problem(503, "store-unavailable", "Store unavailable", str(exc))
            )
        except ValueError as exc:
            return problem_response(request, Problem(400, "bad-request", "Bad request", str(exc)))

    return endpoint


def when(value: Any) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    return "\u2013" if value is None else str(value)


def seconds(value: Any) -> str:
    return f"{float(value):.1f} s" if isinstance(value, int | float) else "\u2013"


def pretty_json(value: Any) -> str:
    if isinstance(value, str | bytes):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            return str(value)
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()


def templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("fencegate.console", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(when=when, seconds=seconds, pretty_json=pretty_json)
    env.globals["urlencode"] = urlencode
    return env
