"""A small Resend send-email API (``POST /emails``) for end-to-end tests of the adapter.

It checks what the real API checks (``Authorization: Bearer``, a JSON body, the required
``from`` / ``to`` / ``subject``, tag names and values limited to ``[A-Za-z0-9_-]``), honours
``Idempotency-Key`` like Resend (the same key and payload get the first 200 again and create
nothing; the same key with another payload is 409 ``invalid_idempotent_request``), answers
``{"id": ...}`` and records every request. Recipients drive failures through their local part:
``+fail429xN`` (429 ``rate_limit_exceeded`` with ``retry-after`` and the ``ratelimit-*``
headers), ``+fail500xN`` / ``+fail503xN`` fail the first N requests for that recipient;
``+invalid`` answers 422 ``validation_error`` and ``+quota`` 429 ``daily_quota_exceeded``.

``POST /emails/batch`` takes 1 to 100 such bodies in a JSON array, one ``Idempotency-Key`` for
the request (the same key and payload replay the first answer), and refuses attachments as
Resend's batch call does. With ``x-batch-validation: permissive`` a refused entry (``+invalid``,
attachments, a missing field) is listed in ``errors`` by index and the rest are created, their
ids in ``data`` in order; in strict mode (the default) one refused entry refuses the request.

Usage: ``stub = ResendStub(api_key="re_test")`` then ``with BackgroundServer(stub.app) as url``.
"""

import json
import re
import threading
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

_FAIL_RE = re.compile(r"^fail(429|500|503)x(\d+)$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_-]{1,256}$")


class ResendStub:
    def __init__(self, api_key: str = "re_test_key", *, retry_after_s: float = 1.0) -> None:
        self.api_key = api_key
        self.retry_after_s = retry_after_s
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []  # every request: headers and raw body
        self.accepted: list[dict[str, Any]] = []  # created emails: body, id, idempotency key
        self.replayed = 0  # requests answered from the idempotency store
        self.answers: dict[str, tuple[bytes, dict[str, Any]]] = {}  # key -> (payload, answer)
        self.failures: dict[str, int] = {}  # recipient -> injected failures so far
        self.batch_requests = 0
        self.app = Starlette(
            routes=[
                Route("/emails", self.send, methods=["POST"]),
                Route("/emails/batch", self.send_batch, methods=["POST"]),
            ]
        )

    async def send(self, request: Request) -> JSONResponse:
        raw = await request.body()
        with self.lock:
            self.requests.append({"headers": dict(request.headers), "raw": raw})
        auth = request.headers.get("authorization", "")
        if not auth:
            return _error(401, "missing_api_key", "Missing API key in the authorization header.")
        if auth != f"Bearer {self.api_key}":
            return _error(403, "invalid_api_key", "API key is invalid.")
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "validation_error", "Invalid JSON body.")
        if not isinstance(body, dict):
            return _error(400, "validation_error", "Invalid JSON body.")
        for field in ("from", "to", "subject"):
            if not body.get(field):
                return _error(422, "missing_required_field", f"Missing `{field}` field.")
        for tag in body.get("tags") or []:
            if not (_TAG_RE.match(str(tag.get("name"))) and _TAG_RE.match(str(tag.get("value")))):
                return _error(
                    422,
                    "validation_error",
                    "Tags should only contain ASCII letters, numbers, underscores, or dashes.",
                )
        key = request.headers.get("idempotency-key")
        if key is not None and not 1 <= len(key) <= 256:
            return _error(400, "invalid_idempotency_key", "The key must be between 1-256 chars.")
        if key is not None:
            with self.lock:
                stored = self.answers.get(key)
                if stored is not None and stored[0] == raw:
                    self.replayed += 1
                    return JSONResponse(stored[1])
            if stored is not None:
                return _error(
                    409,
                    "invalid_idempotent_request",
                    "Same idempotency key used with a different request payload.",
                )
        to = body["to"] if isinstance(body["to"], list) else [body["to"]]
        for address in to:
            failure = self._failure_for(str(address))
            if failure is not None:
                return failure
        answer = {"id": str(uuid.uuid4())}
        with self.lock:
            self.accepted.append({**body, "id": answer["id"], "idempotency_key": key})
            if key is not None:
                self.answers[key] = (raw, answer)
        return JSONResponse(answer)

    async def send_batch(self, request: Request) -> JSONResponse:
        raw = await request.body()
        with self.lock:
            self.requests.append({"headers": dict(request.headers), "raw": raw})
            self.batch_requests += 1
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            return _error(401, "missing_api_key", "Missing API key in the authorization header.")
        try:
            entries = json.loads(raw)
        except ValueError:
            return _error(400, "validation_error", "Invalid JSON body.")
        if not isinstance(entries, list) or not 1 <= len(entries) <= 100:
            return _error(422, "validation_error", "A batch is an array of 1 to 100 emails.")
        key = request.headers.get("idempotency-key")
        if key is not None:
            with self.lock:
                stored = self.answers.get(key)
            if stored is not None:
                if stored[0] != raw:
                    return _error(409, "invalid_idempotent_request", "Different payload.")
                with self.lock:
                    self.replayed += 1
                return JSONResponse(stored[1])
        permissive = request.headers.get("x-batch-validation") == "permissive"
        errors = [
            {"index": index, "message": problem}
            for index, entry in enumerate(entries)
            if (problem := _batch_problem(entry)) is not None
        ]
        if errors and not permissive:
            return _error(422, "validation_error", errors[0]["message"])
        refused = {error["index"] for error in errors}
        data = []
        with self.lock:
            for index, entry in enumerate(entries):
                if index not in refused:
                    data.append({"id": str(uuid.uuid4())})
                    self.accepted.append({**entry, "id": data[-1]["id"], "idempotency_key": key})
            answer: dict[str, Any] = {"data": data, **({"errors": errors} if permissive else {})}
            if key is not None:
                self.answers[key] = (raw, answer)
        return JSONResponse(answer)

    def _failure_for(self, to: str) -> JSONResponse | None:
        local = to.rpartition("<")[2].rstrip(">").rpartition("@")[0].lower()
        for token in local.split("+")[1:]:
            if token == "invalid":
                return _error(
                    422,
                    "validation_error",
                    "Invalid `to` field. The email address needs to follow the "
                    "`email@example.com` or `Name <email@example.com>` format.",
                )
            if token == "quota":
                return _error(
                    429,
                    "daily_quota_exceeded",
                    "You have reached your daily email sending quota.",
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
                wait = f"{self.retry_after_s:g}"
                return _error(
                    429,
                    "rate_limit_exceeded",
                    "Too many requests. You can only make 5 requests per second.",
                    {
                        "retry-after": wait,
                        "ratelimit-limit": "5",
                        "ratelimit-remaining": "0",
                        "ratelimit-reset": wait,
                    },
                )
            return _error(status, "internal_server_error", "An unexpected error occurred.")
        return None


def _batch_problem(entry: Any) -> str | None:
    """Why Resend would refuse one entry of a batch, or None."""
    if not isinstance(entry, dict):
        return "Each email must be an object."
    for field in ("from", "to", "subject"):
        if not entry.get(field):
            return f"Missing `{field}` field."
    if "attachments" in entry or "scheduled_at" in entry:
        return "Attachments and scheduled_at are not supported in batch sending."
    to = entry["to"] if isinstance(entry["to"], list) else [entry["to"]]
    if any("+invalid@" in str(address) for address in to):
        return "Invalid `to` field."
    return None


def _error(
    status: int, name: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"statusCode": status, "name": name, "message": message}, status, headers=headers
    )
