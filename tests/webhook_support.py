"""Helpers for webhook tests: sign sandbox events like the sandbox does, and the ``Signer`` that
describes one provider to the shared suite (integration/test_webhooks_contract.py) - how a payload
is signed into a request, forged or left unsigned, how one is built about a given message, and what
each of its fixtures must normalize to - plus the receiver, inbox and ingestion helpers every
webhook test module uses.
"""

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine, select
from starlette.testclient import TestClient

from email_platform.common.timeutil import utcnow
from email_platform.db.schema import email_events, email_messages, webhook_inbox
from email_platform.providers.base import OutgoingEmail
from email_platform.store import messages, outbox, suppressions
from email_platform.webhooks.ingest import IngestOutcome, WebhookIngestor
from email_platform.webhooks.receiver import create_receiver_app
from email_platform.webhooks.registry import WebhookProvider
from email_platform.webhooks.standard import sign
from tests.paths import WEBHOOK_FIXTURES

SECRET = "whsec_" + "c2VjcmV0LWtleS1mb3ItdGVzdHMtb25seQ=="  # base64("secret-key-for-tests-only")
SETTINGS = {"sandbox_webhook_secret": SECRET}
FIXTURE_ROOT = WEBHOOK_FIXTURES

#: What is posted to the receiver: the body and the headers.
Request = tuple[bytes, dict[str, str]]


def sandbox_event(
    kind: str,
    *,
    message_id: str = "sbx_1",
    to: str = "u1@example.com",
    event_id: str | None = None,
    idempotency_key: str | None = None,
    **data,
) -> dict:  # type: ignore[no-untyped-def]
    return {
        "id": "evt_" + os.urandom(8).hex(),
        "type": kind,
        "created_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "data": {
            "message_id": message_id,
            "to": to,
            "metadata": {"event_id": event_id, "idempotency_key": idempotency_key},
            **data,
        },
    }


def signed(
    event: dict,
    *,
    secret: str = SECRET,
    timestamp: int | None = None,
    webhook_id: str | None = None,
) -> Request:
    body = json.dumps(event).encode()
    return body, standard_headers(body, secret, webhook_id or event["id"], timestamp)


def standard_headers(
    body: bytes,
    secret: str,
    webhook_id: str | None = None,
    timestamp: int | None = None,
    *,
    prefix: str = "webhook",
) -> dict[str, str]:
    """Standard Webhooks headers for ``body`` (``prefix`` "svix" for Resend's names)."""
    webhook_id = webhook_id or "msg_" + os.urandom(12).hex()
    timestamp = int(time.time()) if timestamp is None else timestamp
    return {
        "content-type": "application/json",
        f"{prefix}-id": webhook_id,
        f"{prefix}-timestamp": str(timestamp),
        f"{prefix}-signature": sign(secret, webhook_id, timestamp, body),
    }


def outgoing_email(**changes: Any) -> OutgoingEmail:
    """A message as the send path hands it to an adapter (to read its ids back from webhooks)."""
    fields: dict[str, Any] = {
        "message_id": 1,
        "event_id": "01KDVFF0NRVB039663SGXKY95F",
        "idempotency_key": "order-7781:receipt",
        "sender": "Example <no-reply@example.com>",
        "to": "jane@example.com",
        "subject": "Your receipt",
        "text": "Thanks",
        "html": None,
        "template": "receipt",
        "lane": "transactional",
    }
    return OutgoingEmail(**{**fields, **changes})


# --- what a provider's fixtures must normalize to ---------------------------------------------


@dataclass(frozen=True)
class Expected:
    """The normalized event one fixture stands for (its only event)."""

    event_type: str
    recipient: str
    event_id: str | None  # our id, read back from the provider's metadata field
    idempotency_key: str | None  # None where the provider cannot carry it back exactly
    provider_message_id: str | None
    occurred_at: datetime
    bounce_type: str | None = None
    suppression: str | None = None
    reason: str | None = None  # how reject_reason starts (None: no reject reason)
    machine_open: bool | None = None
    click_url: str | None = None
    user_agent: str | None = None
    ip: str | None = None
    provider_event_id: str | None = None  # None: the provider gives none, a stable sha256


@dataclass(frozen=True)
class Ids:
    """Whom a built payload is about: our ids and the provider's message id."""

    event_id: str
    idempotency_key: str
    recipient: str
    provider_message_id: str


@dataclass(frozen=True, repr=False)
class Signer:
    """One provider as the shared suite sees it.

    A *payload* is the provider's event document before transport signing (for Mailgun the body
    without its signature block, for SES the SES event an SNS notification carries); ``sign``
    turns it into an authentic request with a fresh delivery id.
    """

    name: str
    settings: Mapping[str, str]
    provider: Callable[[], WebhookProvider]  # a fresh verifier factory and normalizer
    sign: Callable[[bytes], Request]
    forge: Callable[[bytes], Request]  # the payload signed with a key that is not ours
    strip: Callable[[bytes], Request]  # the payload with no signature at all
    delivery_id: Callable[[Request], str | None]  # what the receiver must store as delivery id
    dedupes_deliveries: bool  # whether the scheme has a delivery id to refuse a replay on
    #: ``sign`` at a given unix time; None where the scheme carries no clock (no freshness).
    sign_at: Callable[[bytes, int], Request] | None
    window: tuple[int, int]  # (oldest, furthest ahead) seconds a signature may be from now
    #: A payload about ``Ids``, built from a template (a fixture name, or an event type for the
    #: sandbox); the provider's own event id is derived from the ids, so two builds for
    #: different messages never collide and the same build is the same event.
    build: Callable[[str, Ids], bytes]
    templates: Mapping[str, str]  # vocabulary event -> the template ``build`` starts from
    malformed: tuple[bytes, ...]  # payloads that authenticate but cannot be read
    kept_headers: tuple[str, ...]  # request headers stored next to the body
    secret_headers: tuple[str, ...] = ()  # request headers that must never be stored
    fixtures: Path | None = None
    expected: Mapping[str, Expected] = field(default_factory=dict)
    not_events: tuple[str, ...] = ()  # fixtures in the folder that carry no email event
    raw: Callable[[Any], Any] = lambda document: document  # a fixture's part kept as ``raw``

    @property
    def path(self) -> str:
        return f"/webhooks/{self.name}"

    def providers(self) -> dict[str, WebhookProvider]:
        return {self.name: self.provider()}

    def fixture(self, name: str) -> bytes:
        assert self.fixtures is not None
        return (self.fixtures / f"{name}.json").read_bytes()

    def event(self, kind: str, ids: Ids) -> bytes:
        """A payload of vocabulary event ``kind`` (a hard bounce for ``bounced``)."""
        return self.build(self.templates[kind], ids)

    def __str__(self) -> str:  # the pytest id, and what a failing example shows
        return self.name

    __repr__ = __str__


def rewrite(document: str, expected: Expected, ids: Ids) -> str:
    """``document`` (a fixture's text) about ``ids`` instead of the message it was written for."""
    replacements = [
        (expected.idempotency_key, ids.idempotency_key),
        (expected.event_id, ids.event_id),  # also inside a sanitized key such as "<id>_welcome"
        (expected.provider_message_id, ids.provider_message_id),
        (expected.recipient, ids.recipient),
    ]
    for old, new in replacements:
        if old:
            document = document.replace(old, new)
    return document


def derived_id(ids: Ids, template: str) -> str:
    """A provider event id for the event ``template`` about ``ids``: stable, and unique per pair."""
    return hashlib.sha256(f"{ids.event_id}/{template}".encode()).hexdigest()[:22]


# --- receiver, inbox, ingestion ---------------------------------------------------------------


def receiver(
    engine: Engine, signer: Signer, settings: Mapping[str, str] | None = None, **kwargs: Any
) -> TestClient:
    settings = signer.settings if settings is None else settings
    return TestClient(
        create_receiver_app(engine, settings=settings, providers=signer.providers(), **kwargs)
    )


def post(client: TestClient, signer: Signer, request: Request) -> httpx.Response:
    body, headers = request
    return client.post(signer.path, content=body, headers=headers)


def inbox_rows(engine: Engine) -> list[Any]:
    with engine.connect() as connection:
        return list(connection.execute(select(webhook_inbox).order_by(webhook_inbox.c.inbox_id)))


def event_rows(engine: Engine) -> list[Any]:
    with engine.connect() as connection:
        return list(
            connection.execute(select(email_events).order_by(email_events.c.email_event_id))
        )


def ingest(engine: Engine, signer: Signer, ids: list[int] | None = None) -> IngestOutcome:
    if ids is None:
        ids = [row.inbox_id for row in inbox_rows(engine) if row.status == "pending"]
    return WebhookIngestor(engine, providers=signer.providers()).run(ids, run_id="test-webhooks")


def seed_sent_message(
    engine: Engine,
    *,
    provider: str,
    event_id: str,
    recipient: str,
    provider_message_id: str | None,
    idempotency_key: str | None = None,
) -> int:
    """An outbox event and its message, sent through ``provider``, as the send job leaves them."""
    now = utcnow()
    with engine.begin() as connection:
        outbox.insert_event(
            connection,
            {
                "event_id": event_id,
                "event_type": "user.signed_up",
                "event_version": 2,
                "aggregate_id": f"user_{event_id[-8:].lower()}",
                "occurred_at": now,
                "published_at": now,
                "payload": {"email": recipient, "first_name": "Jane"},
                "event_metadata": {},
                "lane": "transactional",
                "available_at": now,
                "status": "done",
                "resolution": "sent",
            },
        )
        row = messages.create(
            connection,
            {
                "event_id": event_id,
                "route": "welcome",
                "template": "welcome",
                "template_version": 1,
                "lane": "transactional",
                "recipient": recipient,
                "recipient_domain": recipient.rsplit("@", 1)[1],
                "idempotency_key": idempotency_key or f"{event_id}:welcome",
                "status": "sent",
                "created_at": now,
                "updated_at": now,
                "sent_at": now,
                "provider": provider,
                "provider_message_id": provider_message_id,
            },
        )
    return row.message_id


def delivery_status(engine: Engine, message_id: int) -> str | None:
    with engine.connect() as connection:
        return connection.execute(
            select(email_messages.c.delivery_status).where(
                email_messages.c.message_id == message_id
            )
        ).scalar_one()


def reasons(engine: Engine, *recipients: str) -> dict[str, str]:
    with engine.connect() as connection:
        return suppressions.reasons_for(connection, list(recipients))
