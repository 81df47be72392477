"""A SendGrid Mail Send v3 stand-in: ``POST /v3/mail/send`` with SendGrid's auth, validation,
answers and error bodies, recording what it received.

Faults come from the recipient's local part: ``+fail429x2`` answers 429 (with SendGrid's
``X-RateLimit-*`` headers) to the first two requests for that address, ``+fail503x1`` /
``+fail500x1`` answer 5xx once, and ``+invalid`` always answers SendGrid's 400 for a bad ``to``.
SendGrid has no idempotency key, so failures are counted per recipient address.
"""

import json
import math
import re
import secrets
import time
from collections import Counter
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

_FAIL_RE = re.compile(r"\+fail(429|500|503)x(\d+)")
HELP = "http://sendgrid.com/docs/API_Reference/Web_API_v3/Mail/errors.html"
INVALID_TO = (
    "The to array is required for all personalization objects, and must have at least one "
    "email object with a valid email address."
)


def _errors(status: int, errors: list[tuple[str | None, str]], **headers: str) -> Response:
    body = {"errors": [{"message": m, "field": f, "help": HELP if f else None} for f, m in errors]}
    return JSONResponse(body, status_code=status, headers=headers)


def _validate(body: Any) -> list[tuple[str | None, str]]:
    if not isinstance(body, dict):
        return [(None, "Bad Request")]
    problems: list[tuple[str | None, str]] = []
    personalizations = body.get("personalizations")
    if not isinstance(personalizations, list) or not personalizations:
        problems.append(
            (
                "personalizations",
                "The personalizations field is required and must have at least one "
                "personalization.",
            )
        )
    else:
        for i, p in enumerate(personalizations):
            to = p.get("to") if isinstance(p, dict) else None
            if not to or not all(isinstance(t, dict) and "@" in str(t.get("email")) for t in to):
                problems.append((f"personalizations.{i}.to", INVALID_TO))
    sender = body.get("from")
    if not isinstance(sender, dict) or not sender.get("email"):
        problems.append(("from.email", "The from email parameter is required."))
    if not body.get("subject"):
        problems.append(("subject", "The subject is required."))
    content = body.get("content")
    if not isinstance(content, list) or not content or not all(c.get("value") for c in content):
        problems.append(("content", "The content value must be a string at least one character."))
    elif len(content) > 1 and content[0].get("type") != "text/plain":
        problems.append(("content", "text/plain content must be first, then text/html."))
    scopes = [("custom_args", body.get("custom_args"))]
    if isinstance(personalizations, list):
        scopes += [
            (f"personalizations.{i}.custom_args", p.get("custom_args"))
            for i, p in enumerate(personalizations)
            if isinstance(p, dict)
        ]
    for field, args in scopes:
        for key, value in (args or {}).items():
            if not isinstance(value, str):
                kind = type(value).__name__.replace("int", "integer")
                problems.append(
                    (f"{field}.{key}", f"Invalid type. Expected: string, given: {kind}.")
                )
        if args and len(json.dumps(args).encode()) > 10_000:
            problems.append((field, "The custom_args may not exceed 10,000 bytes."))
    return problems


class SendGridStub:
    """``with BackgroundServer(stub.app) as url:``; then read ``requests`` and ``accepted``."""

    def __init__(self, api_key: str = "SG.test-key", *, reset_in_s: float = 0.5) -> None:
        self.api_key = api_key
        self.reset_in_s = reset_in_s
        self.requests: list[dict] = []  # every authenticated request: headers and JSON body
        self.accepted: list[dict] = []  # {"message_id", "body"} of each 202
        self._failed: Counter[str] = Counter()
        self.app = Starlette(routes=[Route("/v3/mail/send", self._send, methods=["POST"])])

    async def _send(self, request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            return _errors(
                401, [(None, "The provided authorization grant is invalid, expired, or revoked")]
            )
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _errors(400, [(None, "Bad Request")])
        self.requests.append({"headers": dict(request.headers), "body": body})
        problems = _validate(body)
        if problems:
            return _errors(400, problems)
        to = body["personalizations"][0]["to"][0]["email"]
        local = to.partition("@")[0]
        if "+invalid" in local:
            return _errors(400, [("personalizations.0.to", INVALID_TO)])
        fault = _FAIL_RE.search(local)
        if fault and self._failed[to] < int(fault.group(2)):
            self._failed[to] += 1
            if fault.group(1) == "429":
                return _errors(
                    429,
                    [(None, "too many requests")],
                    **{
                        "X-RateLimit-Limit": "600",
                        "X-RateLimit-Remaining": "0",
                        "X-RateLimit-Reset": str(math.ceil(time.time() + self.reset_in_s)),
                    },
                )
            return _errors(int(fault.group(1)), [(None, "internal server error")])
        message_id = secrets.token_urlsafe(16)
        self.accepted.append({"message_id": message_id, "body": body})
        return Response(status_code=202, headers={"X-Message-Id": message_id})
