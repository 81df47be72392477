"""The sandbox speaking Postmark's Email API: ``POST /email`` and ``POST /email/batch``.

A stub for the benchmarks and the batch tests: the real Postmark adapter
(``providers/postmark.py``) sends to it unchanged (``EMAIL_PLATFORM_POSTMARK_BASE_URL`` at the
sandbox). Each message goes through the sandbox's own keys (Metadata ``idempotency_key``),
faults and latency, and is answered in Postmark's shapes, as documented at
https://postmarkapp.com/developer/api/email-api: ``{"To", "SubmittedAt", "MessageID",
"ErrorCode": 0, "Message": "OK"}``, or an ErrorCode (406 inactive recipient, 300 invalid
request, 429 rate limit, 100 maintenance, 10 bad token) with its message. A batch answers 200
with one such object per message, in order. Messages are listed with the sandbox's own.
"""

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from email_platform.sandbox.state import SandboxState, dumps

Problem = tuple[int, str, str] | None

#: The sandbox's fault kinds as Postmark answers them: (HTTP status alone, ErrorCode, message).
_FAULTS: dict[str, tuple[int, int, str]] = {
    "429": (429, 429, "Rate limit exceeded."),
    "500": (500, 100, "Maintenance."),
    "503": (503, 100, "Maintenance."),
    "timeout": (503, 100, "Maintenance."),
    "401": (401, 10, "Bad or missing API token."),
    "400": (422, 300, "Invalid email request."),
    "422": (422, 406, "You tried to send to recipient(s) that have been marked as inactive."),
}
_STALLS = ("timeout", "accept_timeout")


def as_sandbox_message(body: Any) -> Any:
    """A Postmark ``/email`` body as the body the sandbox's ``/v1/send`` takes."""
    if not isinstance(body, dict):
        return body
    headers = body.get("Headers") or []
    return {
        "from": body.get("From"),
        "to": body.get("To"),
        "subject": body.get("Subject"),
        "text": body.get("TextBody") or "",
        "html": body.get("HtmlBody"),
        "headers": {h.get("Name"): h.get("Value") for h in headers if isinstance(h, dict)},
        "metadata": body.get("Metadata") or {},
        "tags": [body["Tag"]] if isinstance(body.get("Tag"), str) else [],
    }


def postmark_routes(
    state: SandboxState,
    admit: Callable[..., Awaitable[Response | None]],
    problem: Callable[[Any], Problem],
    timeout_delay_s: float,
) -> list[Route]:
    """Postmark's send endpoints on the sandbox app; ``admit`` and ``problem`` are the
    sandbox's own (counting and latency; a message's validation)."""

    def answer(body: Any) -> tuple[int, dict[str, Any], str | None]:
        """One message: (the HTTP status a single send gets, Postmark's answer, fault)."""
        payload = as_sandbox_message(body)
        refused = problem(payload)
        if refused is not None:
            return 422, {"ErrorCode": 300, "Message": refused[2]}, None
        key = str(payload["metadata"].get("idempotency_key") or "")
        if not key:
            return 422, {"ErrorCode": 300, "Message": "Metadata.idempotency_key is required"}, None
        stored, fault, accepted = state.decide(key, payload)
        if stored is not None:
            accepted = json.loads(stored[1])
        if accepted is not None:
            return (
                200,
                {
                    "To": payload["to"],
                    "SubmittedAt": accepted["accepted_at"],
                    "MessageID": accepted["id"],
                    "ErrorCode": 0,
                    "Message": "OK",
                },
                fault,
            )
        status, code, message = _FAULTS.get(fault or "500", _FAULTS["500"])
        return status, {"ErrorCode": code, "Message": message}, fault

    async def send(request: Request) -> Response:
        refused = await admit(request, batch=False)
        if refused is not None:
            return refused
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            return _json(422, {"ErrorCode": 300, "Message": "Invalid JSON."})
        status, result, fault = answer(body)
        if fault in _STALLS:
            await asyncio.sleep(timeout_delay_s)
        return _json(status, result)

    async def send_batch(request: Request) -> Response:
        refused = await admit(request, batch=True)
        if refused is not None:
            return refused
        try:
            items = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            return _json(422, {"ErrorCode": 300, "Message": "Invalid JSON."})
        if not isinstance(items, list) or not 1 <= len(items) <= 500:
            return _json(422, {"ErrorCode": 300, "Message": "A batch is 1 to 500 messages."})
        results = [answer(item) for item in items]
        if any(fault in _STALLS for _, _, fault in results):
            await asyncio.sleep(timeout_delay_s)
        return _json(200, [result for _, result, _ in results])

    return [
        Route("/email", send, methods=["POST"]),
        Route("/email/batch", send_batch, methods=["POST"]),
    ]


def _json(status: int, obj: Any) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")
