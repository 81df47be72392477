"""A small Postmark Email API (``POST /email``) for end-to-end tests of the adapter.

It checks what the real API checks first (the ``X-Postmark-Server-Token``, a JSON body, the
required ``From`` / ``To`` and a ``TextBody`` or ``HtmlBody``), answers the documented 200
body with a fresh ``MessageID``, and records every request. Recipients drive failures through
their local part: ``+fail429xN`` / ``+fail500xN`` / ``+fail503xN`` fail the first N requests for
that recipient (429 ``{"ErrorCode": 429}``, 5xx with a plain-text body), ``+invalid`` answers
422 ErrorCode 300 and ``+inactive`` 422 ErrorCode 406, every time.

Usage: ``stub = PostmarkStub(server_token="t")`` then ``with BackgroundServer(stub.app) as url``.
"""

import re
import threading
import uuid
from datetime import UTC, datetime
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

_FAIL_RE = re.compile(r"^fail(429|500|503)x(\d+)$")


class PostmarkStub:
    def __init__(
        self, server_token: str = "postmark-test-token", *, retry_after_s: float | None = None
    ) -> None:
        self.server_token = server_token
        #: Postmark documents no Retry-After; set one to see the adapter honour it anyway.
        self.retry_after_s: float | None = retry_after_s
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []  # every request: headers and body
        self.accepted: list[dict[str, Any]] = []  # accepted bodies, with the MessageID given
        self.failures: dict[str, int] = {}  # recipient -> injected failures so far
        self.app = Starlette(routes=[Route("/email", self.send, methods=["POST"])])

    async def send(self, request: Request) -> Response:
        raw = await request.body()
        token = request.headers.get("x-postmark-server-token")
        with self.lock:
            self.requests.append({"headers": dict(request.headers), "raw": raw})
        if not token:
            return _error(
                401,
                10,
                "No Account or Server API tokens were supplied in the HTTP headers. Please add "
                "a header for either X-Postmark-Server-Token or X-Postmark-Account-Token.",
            )
        if token != self.server_token:
            return _error(401, 10, "Request does not contain a valid Server token.")
        if not request.headers.get("content-type", "").startswith("application/json"):
            return _error(422, 409, "JSON required. Please send the request as JSON.")
        try:
            body = await request.json()
        except ValueError:
            return _error(422, 402, "Received invalid JSON input.")
        if not isinstance(body, dict):
            return _error(422, 403, "Incompatible JSON input.")
        if not body.get("From"):
            return _error(422, 300, "Invalid 'From' address: ''.")
        to = body.get("To")
        if not isinstance(to, str) or "@" not in to:
            return _error(422, 300, "Zero recipients specified")
        if not body.get("TextBody") and not body.get("HtmlBody"):
            return _error(422, 300, "Provide either email TextBody or HtmlBody or both.")
        failure = self._failure_for(to)
        if failure is not None:
            return failure
        answer = {
            "To": to,
            "SubmittedAt": datetime.now(UTC).isoformat(),
            "MessageID": str(uuid.uuid4()),
            "ErrorCode": 0,
            "Message": "OK",
        }
        with self.lock:
            self.accepted.append({**body, "MessageID": answer["MessageID"]})
        return JSONResponse(answer)

    def _failure_for(self, to: str) -> Response | None:
        local = to.rpartition("@")[0].lower()
        for token in local.split("+")[1:]:
            if token == "invalid":
                return _error(422, 300, f"Error parsing 'To': Illegal email address '{to}'.")
            if token == "inactive":
                return _error(
                    422,
                    406,
                    "You tried to send to recipient(s) that have been marked as inactive. "
                    f"Found inactive addresses: {to}. Inactive recipients are ones that have "
                    "generated a hard bounce, a spam complaint, or a manual suppression.",
                )
            match = _FAIL_RE.match(token)
            if match is None:
                continue
            status, times = int(match.group(1)), int(match.group(2))
            with self.lock:
                done = self.failures.get(to, 0)
                if done >= times:
                    return None
                self.failures[to] = done + 1
            if status == 429:
                headers = (
                    {"Retry-After": f"{self.retry_after_s:g}"}
                    if self.retry_after_s is not None
                    else None
                )
                return _error(429, 429, "Rate limit exceeded.", headers)
            # Postmark documents no body for its 5xx answers; a plain one is the hard case.
            return PlainTextResponse("Service Unavailable" if status == 503 else "Error", status)
        return None


def _error(
    status: int, code: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"ErrorCode": code, "Message": message}, status, headers=headers)
