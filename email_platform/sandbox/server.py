"""Sandbox email provider: a real HTTP server on loopback that behaves like a transactional
email API, so the demo, the tests and the benchmarks exercise the genuine network path
(connection pooling, timeouts, retries, idempotency) without sending real mail.

Behaviour worth knowing when writing tests against it:

* ``POST /v1/send`` needs an ``Idempotency-Key`` header. The first *accepted* (200) answer
  for a key is stored and replayed verbatim for every later request with that key, with
  ``Idempotent-Replayed: true``. Faults are never stored, so a retry after a fault can
  succeed.
* Faults are decided in this order:

  1. directives in the recipient's local part after ``+``: ``429x2``, ``500x1``, ``503x3``,
     ``timeoutx1``, ``accepttimeoutx1``, ``resetx1``, ``acceptresetx1``, ``reject`` (422),
     ``400``, ``401``. ``xN`` covers the first N attempts of that idempotency key; a directive
     without ``xN`` applies to every attempt. Several directives run one after the other, so
     ``jane+429x1+500x1@example.com`` answers 429, then 500, then accepts. Unknown ``+tags``
     are ignored.
  2. rules added through ``POST /_sandbox/faults``; each firing uses up one of its ``times``;
     ``DELETE /_sandbox/faults`` drops them all (an outage ends).
  3. the random rates of :class:`SandboxConfig`, only on the first attempt of a key. The 5xx
     rate answers 500 or 503, the 4xx rate answers 400.

* ``timeout`` stalls ``timeout_delay_s`` and then answers 503 (nothing recorded);
  ``accept_timeout`` records the message first and then stalls before answering 200, which
  is the "provider accepted but the client gave up" case that idempotency must absorb.
  ``reset`` and ``accept_reset`` start a 200 answer and close the connection halfway through
  its body, before or after recording the message: the client cannot tell which. In a batch
  answer either cuts the whole answer; what was accepted stays accepted.
* ``POST /v1/send/batch`` takes ``{"messages": [...]}`` (1 to ``BATCH_MAX`` messages, each the
  body ``/v1/send`` takes plus its own ``idempotency_key``) and answers 200 with one result per
  message, in order: ``{"status": 200, "id", "accepted_at", "replayed"}`` or ``{"status": 429 |
  5xx | 4xx, "error": {...}, "retry_after"}``. Each message goes through the same keys and faults
  as a single send. A ``timeout`` or ``accept_timeout`` fault on any message stalls the whole
  answer, as a slow provider would; what was accepted before the stall stays accepted.
* ``GET /_sandbox/webhooks[?offset=&limit=]`` lists the webhook events planned so far, oldest
  first: ``{"webhooks": [{"event", "attempts", "last_status", "delivered", "outcome"}],
  "total", "posting"}`` (``outcome``: null while posting, ``delivered``, ``refused`` or
  ``exhausted``; ``posting``: messages whose events are still being posted).
* ``GET /_sandbox/requests`` lists when each send request arrived (epoch seconds, the latest
  200,000): ``{"times": [...]}``, for counting a client's rate over any window.
* ``POST /email`` and ``POST /email/batch`` answer in Postmark's shapes (``sandbox/postmark.py``):
  the Postmark adapter can send to the sandbox, one message a call or in batches.
* ``api_key`` only guards the send endpoints; the ``/_sandbox/*`` control endpoints stay open so
  a test harness can inspect the server without knowing the key.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import sys
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from email_platform.sandbox.asgi import BackgroundServer, bind, url_for, uvicorn_config
from email_platform.sandbox.faults import (
    CUT_KINDS,
    RETRY_AFTER_STYLES,
    parse_rule,
    retry_after_header,
)
from email_platform.sandbox.postmark import postmark_routes
from email_platform.sandbox.state import SandboxConfig, SandboxState, dumps
from email_platform.sandbox.templates import ProviderTemplates

__all__ = ["SandboxConfig", "SandboxServer", "create_app", "serve"]


_JSON = "application/json"
#: Most messages one ``/v1/send/batch`` call takes (Postmark's batch endpoint takes 500 too).
BATCH_MAX = 500


def _json(status: int, obj: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status_code=status, headers=headers, media_type=_JSON)


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return _json(status, {"error": {"code": code, "message": message}}, headers)


def _validate(payload: Any, templates: ProviderTemplates | None = None) -> Response | None:
    problem = _problem(payload, templates)
    return _error(*problem) if problem is not None else None


def _problem(
    payload: Any, templates: ProviderTemplates | None = None
) -> tuple[int, str, str] | None:
    """Why one message cannot be accepted: (status, error code, message), or None."""
    if not isinstance(payload, dict):
        return 422, "invalid_request", "request body must be a JSON object"
    # A provider template is rendered first: its subject and body are then checked as any.
    if templates is not None and (unrendered := templates.fill(payload)) is not None:
        return unrendered
    to = payload.get("to")
    if not isinstance(to, str) or not to.strip():
        return 422, "invalid_recipient", "'to' is required"
    if "@" not in to:
        return 422, "invalid_recipient", f"'to' is not an email address: {to!r}"
    for field in ("from", "subject"):
        value = payload.get(field)
        if not isinstance(value, str) or not value.strip():
            return 422, "invalid_request", f"'{field}' is required"
    for field, kind in (("text", str), ("html", str), ("headers", dict), ("metadata", dict)):
        value = payload.get(field)
        if value is not None and not isinstance(value, kind):
            return 422, "invalid_request", f"'{field}' must be a {kind.__name__}"
    tags = payload.get("tags")
    if tags is not None and (
        not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)
    ):
        return 422, "invalid_request", "'tags' must be a list of strings"
    for field in ("reply_to", "cc", "bcc"):
        value = payload.get(field)
        if value is not None and not (
            isinstance(value, list) and all(isinstance(v, str) and "@" in v for v in value)
        ):
            return 422, "invalid_request", f"'{field}' must be a list of addresses"
    attachments = payload.get("attachments")
    if attachments is not None and not (
        isinstance(attachments, list)
        and all(
            isinstance(a, dict)
            and all(isinstance(a.get(k), str) for k in ("filename", "content_type", "content"))
            for a in attachments
        )
    ):
        return 422, "invalid_request", "'attachments' must be a list of files"
    return None


_FAULT_ANSWER: dict[str, tuple[int, str, str]] = {
    "429": (429, "rate_limited", "rate limit exceeded"),
    "500": (500, "server_error", "provider error"),
    "503": (503, "server_error", "provider error"),
    "timeout": (503, "server_error", "provider error"),
    "422": (422, "invalid_recipient", "recipient rejected by provider"),
    "401": (401, "unauthorized", "invalid API key"),
    "400": (400, "bad_request", "request rejected by provider"),
}


def _batch_fault(kind: str, retry_after: str) -> dict[str, Any]:
    """A fault as one result of a batch answer: the single send's status, code and message."""
    status, code, message = _FAULT_ANSWER[kind]
    result: dict[str, Any] = {"status": status, "error": {"code": code, "message": message}}
    if kind == "429":
        result["retry_after"] = retry_after
    return result


def _batch_error(status: int, code: str, message: str) -> dict[str, Any]:
    return {"status": status, "error": {"code": code, "message": message}}


def _fault_response(kind: str, retry_after: str) -> Response:
    status, code, message = _FAULT_ANSWER[kind]
    return _error(status, code, message, {"Retry-After": retry_after} if kind == "429" else None)


class _CutAnswer(Response):
    """Starts a 200 answer and hangs up halfway through its body: the connection reset in the
    middle of a request that a client sees as a broken answer, accepted or not."""

    def __init__(self, body: bytes) -> None:
        super().__init__(body, media_type=_JSON)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        half = bytes(self.body[: len(self.body) // 2])
        await send({"type": "http.response.body", "body": half, "more_body": True})
        # Returning unfinished makes uvicorn close the connection, which is the fault.


class _QuietCuts(logging.Filter):
    """Drops uvicorn's complaint about the answers ``_CutAnswer`` leaves unfinished."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing response."


def _quiet_cuts() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _QuietCuts) for f in logger.filters):
        logger.addFilter(_QuietCuts())


def create_app(config: SandboxConfig) -> Starlette:
    """Build the sandbox provider ASGI app; its state lives on ``app.state.sandbox``."""
    state = SandboxState(config)
    templates = ProviderTemplates(config.provider_templates)
    _quiet_cuts()
    expected_auth = f"Bearer {config.api_key}".encode() if config.api_key is not None else None
    if config.retry_after_style not in RETRY_AFTER_STYLES:
        raise ValueError(f"retry_after_style must be one of {RETRY_AFTER_STYLES}")
    retry_after_rng = random.Random(config.seed)

    def retry_after() -> str:
        return retry_after_header(config.retry_after_s, config.retry_after_style, retry_after_rng)

    latency_s = max(0.0, config.latency_ms) / 1000.0

    async def admit(request: Request, *, batch: bool) -> Response | None:
        """What both send endpoints do first: count, configured latency, the API key."""
        with state.lock:
            state.arrived(batch=batch)
            state.in_flight += 1
            state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
        try:
            if latency_s:
                await asyncio.sleep(latency_s)
        finally:
            with state.lock:
                state.in_flight -= 1
        if expected_auth is not None:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected_auth):
                return _error(401, "unauthorized", "missing or invalid API key")
        return None

    async def send(request: Request) -> Response:
        refused = await admit(request, batch=False)
        if refused is not None:
            return refused

        key = request.headers.get("idempotency-key", "").strip()
        if not key:
            return _error(400, "missing_idempotency_key", "Idempotency-Key header is required")

        # Replay before parsing: a duplicate must get the stored answer whatever its body is.
        with state.lock:
            stored = state.answers.get(key) if config.idempotency else None
            if stored is not None:
                state.send_attempts += 1
                state.repeated_keys += 1
        if stored is not None:
            status, body = stored
            return Response(
                body, status_code=status, media_type=_JSON, headers={"Idempotent-Replayed": "true"}
            )

        raw = await request.body()
        try:
            payload = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return _error(400, "invalid_json", "request body is not valid JSON")
        invalid = _validate(payload, templates)
        if invalid is not None:
            return invalid

        # Re-checks the key: a concurrent request with it may have been accepted while this one
        # was reading its body.
        stored, fault, answer = state.decide(key, payload)
        body = dumps(answer) if answer is not None else b""
        if stored is not None:
            return Response(
                stored[1],
                status_code=stored[0],
                media_type=_JSON,
                headers={"Idempotent-Replayed": "true"},
            )
        if fault is None:
            return Response(body, media_type=_JSON)
        if fault in CUT_KINDS:
            return _CutAnswer(body or dumps({"id": None}))
        if fault in ("timeout", "accept_timeout"):
            await asyncio.sleep(config.timeout_delay_s)
            if fault == "accept_timeout":
                return Response(body, media_type=_JSON)
        return _fault_response(fault, retry_after())

    async def send_batch(request: Request) -> Response:
        refused = await admit(request, batch=True)
        if refused is not None:
            return refused
        try:
            payload = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            return _error(400, "invalid_json", "request body is not valid JSON")
        items = payload.get("messages") if isinstance(payload, dict) else None
        if not isinstance(items, list) or not items:
            return _error(422, "invalid_request", "body must be {'messages': [...]}, not empty")
        if len(items) > BATCH_MAX:
            return _error(
                422, "batch_too_large", f"{len(items)} messages; a batch takes at most {BATCH_MAX}"
            )
        results: list[dict[str, Any]] = []
        stall = cut = False
        for item in items:
            key = item.get("idempotency_key") if isinstance(item, dict) else None
            if not isinstance(key, str) or not key.strip():
                results.append(
                    _batch_error(400, "missing_idempotency_key", "idempotency_key is required")
                )
                continue
            problem = _problem(item, templates)
            if problem is not None:
                results.append(_batch_error(*problem))
                continue
            stored, fault, answer = state.decide(key.strip(), item)
            if stored is not None:
                status, stored_body = stored
                results.append({"status": status, **json.loads(stored_body), "replayed": True})
            elif answer is not None:
                results.append({"status": 200, **answer, "replayed": False})
            elif fault in CUT_KINDS:
                results.append(_batch_fault("500", retry_after()))  # never read: cut below
            else:
                results.append(_batch_fault(fault, retry_after()))
            stall = stall or fault in ("timeout", "accept_timeout")
            cut = cut or fault in CUT_KINDS
        if stall:
            await asyncio.sleep(config.timeout_delay_s)
        if cut:
            return _CutAnswer(dumps({"results": results}))
        return _json(200, {"results": results})

    async def list_messages(request: Request) -> Response:
        event_id = request.query_params.get("event_id")
        with state.lock:
            messages = list(state.messages)
        if event_id is not None:
            messages = [m for m in messages if m["metadata"].get("event_id") == event_id]
        return _json(200, {"messages": messages})

    async def list_webhooks(request: Request) -> Response:
        emitter = state.emitter
        try:
            offset = max(0, int(request.query_params.get("offset", "0")))
            limit = request.query_params.get("limit")
            count = None if limit is None else max(0, int(limit))
        except ValueError:
            return _error(422, "invalid_request", "offset and limit must be integers")
        records = emitter.planned(offset, count) if emitter is not None else []
        total = len(emitter.records) if emitter is not None else 0
        posting = len(emitter.tasks) if emitter is not None else 0
        return _json(200, {"webhooks": records, "total": total, "posting": posting})

    async def stats(request: Request) -> Response:
        return _json(200, state.stats())

    async def request_times(request: Request) -> Response:
        with state.lock:
            times = list(state.request_times)
        return _json(200, {"times": times})

    async def add_faults(request: Request) -> Response:
        try:
            payload = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            return _error(400, "invalid_json", "request body is not valid JSON")
        raw_rules = payload.get("rules") if isinstance(payload, dict) else None
        if not isinstance(raw_rules, list):
            return _error(422, "invalid_request", "body must be {'rules': [...]}")
        try:
            new_rules = [parse_rule(raw) for raw in raw_rules]
        except ValueError as exc:
            return _error(422, "invalid_request", str(exc))
        with state.lock:
            state.rules.extend(new_rules)
            rules = [rule.as_dict() for rule in state.rules]
        return _json(200, {"added": len(new_rules), "rules": rules})

    async def clear_faults(request: Request) -> Response:
        with state.lock:
            cleared = len(state.rules)
            state.rules.clear()
        return _json(200, {"cleared": cleared})

    async def list_faults(request: Request) -> Response:
        with state.lock:
            rules = [rule.as_dict() for rule in state.rules]
        return _json(200, {"rules": rules})

    async def reset(request: Request) -> Response:
        state.reset()
        return _json(200, {"ok": True})

    async def health(request: Request) -> Response:
        return _json(200, {"ok": True})

    app = Starlette(
        routes=[
            Route("/v1/send", send, methods=["POST"]),
            Route("/v1/send/batch", send_batch, methods=["POST"]),
            Route("/_sandbox/messages", list_messages, methods=["GET"]),
            Route("/_sandbox/webhooks", list_webhooks, methods=["GET"]),
            Route("/_sandbox/stats", stats, methods=["GET"]),
            Route("/_sandbox/requests", request_times, methods=["GET"]),
            Route("/_sandbox/faults", add_faults, methods=["POST"]),
            Route("/_sandbox/faults", list_faults, methods=["GET"]),
            Route("/_sandbox/faults", clear_faults, methods=["DELETE"]),
            Route("/_sandbox/reset", reset, methods=["POST"]),
            Route("/_sandbox/health", health, methods=["GET"]),
            # Postmark's shapes, for the Postmark adapter (sandbox/postmark.py).
            *postmark_routes(state, admit, _problem, config.timeout_delay_s),
        ],
        # A sender killed while uploading its body: nothing was read, so nothing is accepted,
        # and there is no one to answer (not an error of the sandbox's).
        exception_handlers={ClientDisconnect: _client_gone},
    )
    app.state.sandbox = state
    return app


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=400)


class SandboxServer(BackgroundServer):
    """Runs the sandbox provider in a daemon thread; ``with SandboxServer(cfg) as url: ...``."""

    def __init__(
        self,
        config: SandboxConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        shutdown_timeout: float = 2.0,
    ) -> None:
        self.config = config if config is not None else SandboxConfig()
        super().__init__(create_app(self.config), host, port, shutdown_timeout=shutdown_timeout)


def serve(config: SandboxConfig, host: str, port: int) -> None:
    """Serve the sandbox provider in the foreground until interrupted (CLI entry point)."""
    sock = bind(host, port)
    url = url_for(host, sock.getsockname()[1])
    print(f"sandbox provider listening on {url}", file=sys.stderr, flush=True)
    try:
        uvicorn.Server(uvicorn_config(create_app(config), None)).run(sockets=[sock])
    finally:
        sock.close()
