"""The webhook receiver: ``POST /webhooks/{provider}``, and the one-click unsubscribe links of
bulk mail (``/unsubscribe/{token}``, see ``unsubscribe.py``).

Order matters: verify the signature (401, nothing stored), read at most the size limit (413),
store the raw body durably, and only then answer 2xx. A body that verifies but cannot be read
is stored as ``malformed`` for inspection and answered 400. A database that cannot take the
write answers 503, so the provider keeps the event and retries.

Nothing the sender controls gets a 5xx: a signature check that fails in any way (an absurd
timestamp, a header it cannot parse) is a 401; a body the normalizer cannot read in any way is
``malformed``; text the database cannot store (NUL) is stored with a replacement character
and marked ``malformed``; an over-long delivery id is kept as its SHA-256. Header count and
size and the time to read a request are bounded (``serving.py``).
"""

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from email_platform.common.errors import ConfigurationError
from email_platform.common.text import storable_text, text_problem
from email_platform.common.timeutil import utcnow
from email_platform.db.errors import refused_by_database
from email_platform.mail.unsubscribe import Keys
from email_platform.observability import logs
from email_platform.observability.metrics import metrics_endpoint
from email_platform.observability.redaction import loggable
from email_platform.store import inbox
from email_platform.webhooks import registry
from email_platform.webhooks.errors import WebhookMalformed, WebhookRejected, WebhookUnavailable
from email_platform.webhooks.serving import RequestLimits
from email_platform.webhooks.unsubscribe import unsubscribe_routes

log = logging.getLogger(__name__)

# Headers worth keeping next to the body (signatures, ids, content type) - not cookies.
_KEPT_HEADERS = (
    "content-type",
    "user-agent",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "svix-id",
    "svix-timestamp",
    "svix-signature",
    "x-twilio-email-event-webhook-signature",
    "x-twilio-email-event-webhook-timestamp",
    "x-amz-sns-message-type",
    "x-amz-sns-message-id",
    "x-amz-sns-topic-arn",
)


class _TooLarge(Exception):
    pass


async def _read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _TooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _what(exc: Exception) -> str:
    return storable_text(f"unreadable body: {type(exc).__name__}: {exc}", 500) or ""


def create_receiver_app(
    engine: Engine,
    *,
    settings: Mapping[str, str],
    max_body_bytes: int = 1024 * 1024,
    providers: Mapping[str, registry.WebhookProvider] | None = None,
    clock: Callable[[], datetime] = utcnow,
    unsubscribe_keys: Keys | None = None,
) -> RequestLimits:
    """``settings`` holds the webhook secrets (``config.webhook_settings()``);
    ``unsubscribe_keys`` verify one-click unsubscribe links (None: ``/unsubscribe`` is 404)."""
    known = dict(providers or registry.available())
    verifiers: dict[str, registry.Verifier] = {}

    def verifier_for(name: str) -> registry.Verifier:
        if name not in verifiers:
            verifiers[name] = known[name].verifier(settings)
        return verifiers[name]

    async def receive(request: Request) -> JSONResponse:
        name = request.path_params["provider"]
        if name not in known:
            return JSONResponse({"error": f"unknown provider {name!r}"}, status_code=404)
        try:
            body = await _read_limited(request, max_body_bytes)
        except _TooLarge:
            return JSONResponse({"error": "body too large"}, status_code=413)
        except ClientDisconnect:  # gone, or too slow (serving.RequestLimits): nothing stored
            return JSONResponse({"error": "request body too slow"}, status_code=408)
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            # In a worker thread: a verifier may fetch a certificate (SNS) on first use.
            verifier = await run_in_threadpool(verifier_for, name)
            delivery_id = await run_in_threadpool(verifier.verify, headers, body, clock())
        except ConfigurationError as exc:
            log.error("webhook receiver for %s is not configured: %s", name, exc)
            return JSONResponse({"error": "receiver not configured"}, status_code=503)
        except WebhookUnavailable as exc:
            log.warning("webhook from %s cannot be verified right now: %s", name, exc)
            return JSONResponse({"error": "verification unavailable, retry later"}, status_code=503)
        except WebhookRejected as exc:
            log.warning(f"webhook from {name} rejected: {exc.reason}", **logs.fields(provider=name))
            return JSONResponse({"error": exc.reason}, status_code=401)
        except Exception as exc:  # a check that cannot even run on this input is a failed check
            log.warning(
                "webhook from %s failed verification: %s: %s", name, type(exc).__name__, exc
            )
            return JSONResponse({"error": "signature could not be verified"}, status_code=401)

        status, error, normalized = inbox.PENDING, None, []
        try:
            text = body.decode("utf-8")
            normalized = known[name].normalize(body)
        except Exception as exc:  # undecodable, or a shape the normalizer cannot read
            text = body.decode("utf-8", errors="replace")
            status = inbox.MALFORMED
            error = (
                storable_text(str(exc), 2000)
                if isinstance(exc, WebhookMalformed) and str(exc)
                else _what(exc)
            )
        problem = text_problem(text)
        if problem is not None:
            text = storable_text(text) or ""
            status, error = inbox.MALFORMED, f"body {problem}"
        kept = {k: storable_text(v, 2000) for k, v in headers.items() if k in _KEPT_HEADERS}

        def store() -> int | None:
            with engine.begin() as connection:
                return inbox.store(
                    connection,
                    provider=name,
                    delivery_id=delivery_id,
                    headers=kept,
                    body=text,
                    now=clock(),
                    status=status,
                    error=error,
                )

        try:
            inbox_id = await run_in_threadpool(store)
        except Exception as exc:
            if refused_by_database(exc):  # what this sender sent; retrying changes nothing
                log.warning("webhook from %s refused by the database: %s", name, exc)
                return JSONResponse({"error": "body cannot be stored"}, status_code=400)
            if not isinstance(exc, SQLAlchemyError):
                raise
            log.error("webhook inbox unavailable: %s", exc)
            return JSONResponse({"error": "storage unavailable, retry later"}, status_code=503)
        ids = _ids_of(normalized) if status != inbox.MALFORMED else {}
        where = logs.fields(provider=name, delivery_id=delivery_id, inbox_id=inbox_id, **ids)
        if status == inbox.MALFORMED:
            log.warning(
                f"webhook from {name} stored as malformed: {loggable(error or '')}", **where
            )
            return JSONResponse({"error": error, "inbox_id": inbox_id}, status_code=400)
        if inbox_id is None:
            log.info(f"webhook from {name} already stored", **where)
            return JSONResponse({"status": "duplicate"}, status_code=200)
        log.info(f"webhook from {name} stored", **where)
        return JSONResponse({"status": "stored", "inbox_id": inbox_id}, status_code=200)

    async def health(request: Request) -> JSONResponse:
        # The process id tells apart the receiver processes sharing one port.
        return JSONResponse({"ok": True, "providers": sorted(known), "process": os.getpid()})

    app = Starlette(
        routes=[
            Route("/webhooks/{provider}", receive, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            # Prometheus scrapes the receiver too (the same series as ``metrics serve``).
            Route("/metrics", metrics_endpoint(engine), methods=["GET"]),
            *unsubscribe_routes(engine, unsubscribe_keys, clock),
        ]
    )
    return RequestLimits(app)


def _ids_of(events: Sequence[Any]) -> dict[str, Any]:
    """The ids a stored webhook names, for its log line: its first event's, when it has one
    (a batch of events logs each one as it is applied)."""
    if not events:
        return {}
    first = events[0]
    return {
        "event_id": first.event_id,
        "idempotency_key": first.idempotency_key,
        "provider_message_id": first.provider_message_id,
        "webhook_event": first.event_type,
        "events": len(events),
    }


def receiver_app_from_environment() -> RequestLimits:
    """The receiver with every setting from the environment: what ``webhooks serve --workers N``
    has uvicorn build in each of its worker processes (by import path, so each builds its own
    engine)."""
    from email_platform.common import config
    from email_platform.db.engine import make_engine
    from email_platform.mail.unsubscribe import receiver_keys

    try:
        keys = receiver_keys(config.unsubscribe_settings())
    except (ConfigurationError, ValueError) as exc:  # webhooks still flow; /unsubscribe is 404
        log.error("one-click unsubscribe is off: %s", exc)
        keys = None
    return create_receiver_app(
        make_engine(config.database_url()),
        settings=config.webhook_settings(),
        max_body_bytes=config.webhook_max_body_bytes(),
        unsubscribe_keys=keys,
    )
