"""Signing in with a token (the cookie then carries the session) and signing out."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from fencegate.console.auth import Session
from fencegate.console.web import (
    COOKIE,
    base_path,
    console_of,
    identify,
    problem_response,
    read_form,
    redirect,
    render,
    session_of,
    set_session,
)
from fencegate.problems import Problem


def _next(value: str | None) -> str:
    """Only a path of this console: never another site (an open redirect)."""
    if value and value.startswith("/") and not value.startswith("//") and "\\" not in value:
        return value
    return "/"


async def login_form(request: Request) -> Response:
    # A session before signing in carries only the CSRF token of the sign-in form.
    session = session_of(request) or Session.fresh()
    context = {
        "next": _next(request.query_params.get("next")),
        "error": None,
        "csrf_login": session.csrf,
    }
    response = render(request, "login.html", context, viewer=None, refresh=False)
    response.headers["cache-control"] = "no-store"
    set_session(response, request, session)
    return response


async def login(request: Request) -> Response:
    try:
        form = await read_form(request, None)
    except Problem as problem:
        return problem_response(request, problem)
    token = console_of(request).tokens.match(form.get("token", "").strip())
    if token is None:
        session = session_of(request) or Session.fresh()
        context = {
            "next": _next(form.get("next")),
            "error": "That token is not valid.",
            "csrf_login": session.csrf,
        }
        response = render(request, "login.html", context, viewer=None, status=401, refresh=False)
        response.headers["cache-control"] = "no-store"
        set_session(response, request, session)
        return response
    # A new CSRF token on signing in: a token planted before it is worth nothing after.
    done = redirect(request, _next(form.get("next")))
    set_session(done, request, Session.fresh(token))
    return done


async def logout(request: Request) -> Response:
    try:
        read = identify(request)
        await read_form(request, read)
    except Problem as problem:
        return problem_response(request, problem)
    response = redirect(request, "/login")
    response.delete_cookie(COOKIE, path=base_path(request) or "/")
    return response
