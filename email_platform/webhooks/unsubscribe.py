"""``POST /unsubscribe/{token}`` (RFC 8058 one-click) and a ``GET`` confirmation page.

POST: a token that verifies suppresses its address (reason ``unsubscribe``, source
``one_click:<route>``) and is answered 200, also when the address was suppressed already. The
body must be the one-click form field ``List-Unsubscribe=One-Click`` (urlencoded or
multipart); an empty body is accepted too, since some clients send none. Answers:

* 404: unsubscribe is not configured, or the token is malformed, truncated, tampered with or
  signed under another secret - a forged link looks like no link at all;
* 410: an authentic token past its expiry;
* 400: a body that is not the one-click field; 413: a body over ``MAX_BODY_BYTES``; 408: a body
  too slow to arrive;
* 503: the database cannot take the write (the client may retry; nothing the sender controls).

GET never unsubscribes: mail scanners fetch links. It shows a form that POSTs the field.
Neither the token nor the address is logged (the token carries the address).
"""

import html
import logging
import re
from collections.abc import Callable
from datetime import datetime
from urllib.parse import parse_qs

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from email_platform.db.errors import refused_by_database
from email_platform.mail.unsubscribe import POST_VALUE, Claim, ExpiredToken, InvalidToken, Keys
from email_platform.store import suppressions

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024
SOURCE = "one_click"
_MULTIPART_FIELD = re.compile(
    rb'name="?List-Unsubscribe"?[^\r\n]*\r?\n(?:[^\r\n]+\r?\n)*\r?\nOne-Click\r?\n'
)
# The token is in the URL: no caching, no indexing, and no Referer carrying it elsewhere.
_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Robots-Tag": "noindex",
    "Content-Security-Policy": "default-src 'none'; form-action 'self'",
}


class _TooLarge(Exception):
    pass


def _page(status: int, title: str, text: str, form: bool = False) -> HTMLResponse:
    button = (
        '<form method="post"><input type="hidden" name="List-Unsubscribe" value="One-Click">'
        '<button type="submit">Unsubscribe</button></form>'
        if form
        else ""
    )
    body = (
        f"<!doctype html><html><head><meta charset=utf-8><title>{html.escape(title)}</title>"
        f"</head><body><h1>{html.escape(title)}</h1><p>{html.escape(text)}</p>{button}"
        "</body></html>"
    )
    return HTMLResponse(body, status_code=status, headers=_HEADERS)


_NOT_FOUND = ("Link not found", "This unsubscribe link is not valid.")
_EXPIRED = ("Link expired", "This unsubscribe link has expired. Use the link in a newer email.")


def one_click_body(content_type: str, body: bytes) -> bool:
    """Whether ``body`` is RFC 8058's ``List-Unsubscribe=One-Click`` (or empty)."""
    if not body.strip():
        return True
    if content_type.split(";")[0].strip().lower() == "multipart/form-data":
        return _MULTIPART_FIELD.search(body) is not None
    try:
        fields = parse_qs(body.decode("ascii").strip(), keep_blank_values=True, strict_parsing=True)
    except (UnicodeDecodeError, ValueError):
        return False
    return fields.get("List-Unsubscribe") == ["One-Click"]


async def _read_limited(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _TooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def unsubscribe_routes(
    engine: Engine, keys: Keys | None, clock: Callable[[], datetime]
) -> list[Route]:
    """The ``/unsubscribe/{token}`` routes; with ``keys`` None every request is a 404."""

    def check(token: str) -> Claim | HTMLResponse:
        """The claim of ``token``, or the error page to answer with."""
        if keys is None:
            return _page(404, *_NOT_FOUND)
        try:
            return keys.verify(token, clock())
        except ExpiredToken:
            return _page(410, *_EXPIRED)
        except InvalidToken:
            return _page(404, *_NOT_FOUND)

    async def confirm(request: Request) -> HTMLResponse:
        claim = check(request.path_params["token"])
        if isinstance(claim, HTMLResponse):
            return claim
        return _page(200, "Unsubscribe", "Stop receiving these emails?", form=True)

    async def unsubscribe(request: Request) -> HTMLResponse:
        claim = check(request.path_params["token"])
        if isinstance(claim, HTMLResponse):
            return claim
        try:
            body = await _read_limited(request)
        except _TooLarge:
            return _page(413, "Request too large", "The request body is too large.")
        except ClientDisconnect:
            return _page(408, "Request too slow", "The request body did not arrive in time.")
        if not one_click_body(request.headers.get("content-type", ""), body):
            return _page(400, "Bad request", f"Expected the form field {POST_VALUE}.")
        now = clock()

        def store() -> bool:
            with engine.begin() as connection:
                return suppressions.add(
                    connection,
                    claim.address,
                    reason=suppressions.UNSUBSCRIBE,
                    source=f"{SOURCE}:{claim.route}"[:100],
                    now=now,
                )

        try:
            added = await run_in_threadpool(store)
        except Exception as exc:
            if refused_by_database(exc):  # an address the table cannot hold: retrying is futile
                log.warning("one-click unsubscribe refused by the database: %s", type(exc).__name__)
                return _page(400, "Bad request", "This unsubscribe link cannot be recorded.")
            if not isinstance(exc, SQLAlchemyError):
                raise
            log.error("one-click unsubscribe: storage unavailable: %s", type(exc).__name__)
            return _page(503, "Try again later", "The unsubscribe could not be recorded yet.")
        log.info(
            "one-click unsubscribe from %s mail (%s)", claim.route, "new" if added else "again"
        )
        return _page(200, "Unsubscribed", "You will not receive these emails any more.")

    return [
        Route("/unsubscribe/{token}", confirm, methods=["GET"]),
        Route("/unsubscribe/{token}", unsubscribe, methods=["POST"]),
    ]
