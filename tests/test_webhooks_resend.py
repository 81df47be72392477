"""Resend webhooks are verified with Svix (Standard Webhooks) signatures, read in Resend's
documented shape, mapped onto the vocabulary, linked back to our messages and applied once
(DESIGN.md invariant 7), on SQLite and PostgreSQL.

* Every fixture (each documented ``email.*`` event, bounces permanent and transient) normalizes
  to its expected event: hard vs soft, reasons, timestamps, recipient, click URL and agent.
* Our ids come back through tags sanitized by the send adapter's ``tag_value``: the event id
  (a ULID) is recovered exactly; a value ``tag_value`` may have changed - every idempotency key -
  is never taken, and a property test checks that whatever is read is the original.
* End to end: each fixture, signed like Svix signs it and posted through the receiver, then
  ingested, lands as one ``email_events`` row linked to its message by ``email_id`` (or, when the
  send never recorded it, by the event id tag), and the hard bounce and the complaint suppress.
* Security: wrong secret, tampered body, stale and future timestamps, missing headers are refused
  (401) with nothing stored; a replayed ``svix-id`` is acknowledged and not stored again; a body
  that verifies but cannot be read is stored as malformed and answered 400.
"""

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import Engine, select
from starlette.testclient import TestClient

from email_platform.db.schema import email_events, email_messages, webhook_inbox
from email_platform.errors import ConfigurationError
from email_platform.ids import new_ulid
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.resend import ResendProvider
from email_platform.store import messages, outbox, suppressions
from email_platform.tags import tag_value
from email_platform.timeutil import utcnow
from email_platform.webhooks import registry
from email_platform.webhooks.errors import WebhookMalformed, WebhookRejected
from email_platform.webhooks.ingest import IngestOutcome, WebhookIngestor
from email_platform.webhooks.receiver import create_receiver_app
from email_platform.webhooks.resend import build_verifier, normalize
from email_platform.webhooks.standard import sign

FIXTURES = Path(__file__).parent / "fixtures" / "webhooks" / "resend"
SECRET = "whsec_" + "cmVzZW5kLXdlYmhvb2stdGVzdC1zZWNyZXQ="  # base64("resend-webhook-test-secret")
OTHER_SECRET = "whsec_" + "YW5vdGhlci1zZWNyZXQ="  # base64("another-secret")
SETTINGS = {"resend_webhook_secret": SECRET}
PROVIDERS = {"resend": registry.get("resend")}


@dataclass(frozen=True)
class Expected:
    event_type: str
    recipient: str
    event_id: str
    email_id: str
    at: datetime
    bounce_type: str | None = None
    suppression: str | None = None
    reason: str | None = None  # how reject_reason starts
    click_url: str | None = None
    user_agent: str | None = None
    ip: str | None = None


def _at(second: int, millis: int) -> datetime:
    return datetime(2026, 1, 1, 11, 0, second, millis * 1000, tzinfo=UTC)


SAFARI = (
    "Mozilla/5.0 (Macintosh; Intel Mac OS X 10_15_7) AppleWebKit/605.1.15 (KHTML, like Gecko) "
    "Version/17.4 Safari/605.1.15"
)
EXPECTED = {
    "email_sent": Expected(
        "sent",
        "sent.to@example.com",
        "01KDVE7XPG7NSWPM5S6KR34Z54",
        "868c0ec2-8462-4fb4-b9e5-8730686031bc",
        _at(1, 107),
    ),
    "email_delivered": Expected(
        "delivered",
        "delivered@example.com",
        "01KDVE9S8R6GETSF2W06SQ7X9B",
        "1ab88614-b1c2-417f-8091-34a2f3984c0d",
        _at(2, 114),
    ),
    "email_delivery_delayed": Expected(
        "deferred",
        "greylisted@example.net",
        "01KDVEBMV0GQXQ5FJ9FQFBJZQZ",
        "0b1fa3d3-07d3-4a23-9f8d-23ad5221daef",
        _at(3, 121),
    ),
    "email_bounced_permanent": Expected(
        "bounced",
        "gone@example.com",
        "01KDVEDGD80KJQQQ8SQGJ90J1X",
        "5d7aaa28-e257-4fbd-9c5c-f4061680ede0",
        _at(4, 128),
        bounce_type="hard",
        suppression="hard_bounce",
        reason="Permanent/General: The recipient's email provider sent a hard bounce",
    ),
    "email_bounced_transient": Expected(
        "bounced",
        "full@example.com",
        "01KDVEFBZGGY3Z8NPYEYTNFPSM",
        "1e08aa92-0435-417c-ab18-1c33a3f91ca9",
        _at(5, 135),
        bounce_type="soft",
        reason="Transient/MailboxFull: The recipient's email provider sent a bounce message",
    ),
    "email_complained": Expected(
        "complained",
        "annoyed@example.com",
        "01KDVEH7HR4Q65WPKNHDKDT2HW",
        "d5a5f56c-e01a-4a5a-9cd4-e2223af64e90",
        _at(6, 142),
        suppression="complaint",
    ),
    "email_opened": Expected(
        "opened",
        "opener@example.com",
        "01KDVEK340J51V8YQQ4CWRBW4H",
        "f99d9087-59a2-47d6-9527-e184a0afb0c4",
        _at(7, 149),
    ),
    "email_clicked": Expected(
        "clicked",
        "clicker@example.com",
        "01KDVEMYP8E3X7VB9VWDX840HA",
        "5158b631-0418-4c73-b5b1-6b90a7365e61",
        _at(8, 156),
        click_url="https://app.example.com/welcome/start?utm_source=email",
        user_agent=SAFARI,
        ip="122.115.53.11",
    ),
    "email_failed": Expected(
        "failed",
        "quota@example.com",
        "01KDVEPT8GAYYMM52ENBRAMYZ9",
        "89b1ad9f-12d0-47a4-9198-aaa5b688e727",
        _at(9, 163),
        reason="reached_daily_quota",
    ),
    "email_suppressed": Expected(
        "rejected",
        "suppressed@example.com",
        "01KDVERNTRY5RTF3MK7AYCZDN7",
        "97872725-44c1-4c5e-b59b-67d1b0da7c19",
        _at(10, 170),
        reason="OnAccountSuppressionList: The recipient's email address is on the suppression",
    ),
}


def fixture(name: str) -> bytes:
    return (FIXTURES / f"{name}.json").read_bytes()


def svix_signed(
    body: bytes,
    *,
    secret: str = SECRET,
    msg_id: str | None = None,
    timestamp: int | None = None,
    prefix: str = "svix",
) -> dict[str, str]:
    """The headers Svix sends with ``body`` for Resend."""
    msg_id = msg_id or "msg_" + new_ulid().lower()
    timestamp = int(time.time()) if timestamp is None else timestamp
    return {
        "content-type": "application/json",
        f"{prefix}-id": msg_id,
        f"{prefix}-timestamp": str(timestamp),
        f"{prefix}-signature": sign(secret, msg_id, timestamp, body),
    }


def client(engine: Engine, settings: dict[str, str] = SETTINGS) -> TestClient:
    return TestClient(create_receiver_app(engine, settings=settings, providers=PROVIDERS))


def inbox_rows(engine: Engine) -> list[Any]:
    with engine.connect() as connection:
        return list(connection.execute(select(webhook_inbox).order_by(webhook_inbox.c.inbox_id)))


def event_rows(engine: Engine) -> list[Any]:
    with engine.connect() as connection:
        return list(
            connection.execute(select(email_events).order_by(email_events.c.email_event_id))
        )


def ingest(engine: Engine) -> IngestOutcome:
    ids = [row.inbox_id for row in inbox_rows(engine) if row.status == "pending"]
    return WebhookIngestor(engine, providers=PROVIDERS).run(ids, run_id="test-resend")


def seed_sent_message(
    engine: Engine, *, event_id: str, recipient: str, provider_message_id: str | None
) -> int:
    """An outbox event and its message, sent through Resend, as the send job leaves them."""
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
                "idempotency_key": f"{event_id}:welcome",
                "status": "sent",
                "created_at": now,
                "updated_at": now,
                "sent_at": now,
                "provider": "resend",
                "provider_message_id": provider_message_id,
            },
        )
    return row.message_id


# --- normalization -----------------------------------------------------------------------------


def test_every_fixture_has_an_expectation_and_back() -> None:
    assert {p.stem for p in FIXTURES.glob("*.json")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_normalizes_to_its_vocabulary_entry(name: str) -> None:
    expected = EXPECTED[name]
    (event,) = normalize(fixture(name))
    assert event.provider == "resend"
    assert event.event_type == expected.event_type
    assert event.recipient == expected.recipient
    assert event.event_id == expected.event_id
    assert event.idempotency_key is None  # its tag went through tag_value: not recoverable
    assert event.provider_message_id == expected.email_id
    assert event.occurred_at == expected.at  # the event's created_at, not the email's
    assert event.bounce_type == expected.bounce_type
    assert event.suppression_reason == expected.suppression
    if expected.reason is None:
        assert event.reject_reason is None
    else:
        assert event.reject_reason is not None
        assert event.reject_reason.startswith(expected.reason)
        assert len(event.reject_reason) <= 255
    assert event.click_url == expected.click_url
    assert (event.user_agent, event.ip) == (expected.user_agent, expected.ip)
    assert event.machine_open is (False if expected.event_type == "opened" else None)
    assert event.provider_event_id.startswith("sha256:")
    assert event.raw == json.loads(fixture(name))


def test_event_ids_are_stable_across_redeliveries_and_distinct_between_events() -> None:
    ids = {name: normalize(fixture(name))[0].provider_event_id for name in EXPECTED}
    assert len(set(ids.values())) == len(ids)
    compact = json.dumps(json.loads(fixture("email_opened")), separators=(",", ":")).encode()
    assert normalize(compact)[0].provider_event_id == ids["email_opened"]


@pytest.mark.parametrize(
    ("bounce", "hard_or_soft"),
    [
        ({"type": "Permanent", "subType": "Suppressed"}, "hard"),
        ({"type": "Permanent", "subType": "NoEmail"}, "hard"),
        ({"type": "Transient", "subType": "General"}, "soft"),
        ({"type": "Transient", "subType": "MessageTooLarge"}, "soft"),
        ({"type": "Undetermined", "subType": "Undetermined"}, "soft"),
        ({}, "hard"),  # Resend documents email.bounced as a permanent rejection
    ],
)
def test_bounce_type_decides_hard_or_soft(bounce: dict[str, str], hard_or_soft: str) -> None:
    record = json.loads(fixture("email_bounced_permanent"))
    record["data"]["bounce"] = bounce
    (event,) = normalize(json.dumps(record).encode())
    assert (event.event_type, event.bounce_type) == ("bounced", hard_or_soft)
    assert (event.suppression_reason == "hard_bounce") == (hard_or_soft == "hard")


def test_other_event_families_are_unknown_not_refused() -> None:
    body = {
        "type": "contact.updated",
        "created_at": "2026-01-01T11:00:00.000Z",
        "data": {"id": "e169aa45-1ecf-4183-9955-b1499d5701d3", "email": "x@example.com"},
    }
    (event,) = normalize(json.dumps(body).encode())
    assert (event.event_type, event.event_id, event.provider_message_id) == (
        "unknown",
        None,
        None,
    )


def test_adapter_tags_are_read_back_exactly_or_not_at_all() -> None:
    email = OutgoingEmail(
        message_id=1,
        event_id="01KDVFF0NRVB039663SGXKY95F",
        idempotency_key="01KDVFF0NRVB039663SGXKY95F:welcome",
        sender="Acme <onboarding@resend.dev>",
        to="jane@example.com",
        subject="Welcome",
        text="Hi",
        html=None,
        template="welcome",
        lane="transactional",
    )
    sent_tags = ResendProvider(api_key="re_test").build_request(email).json["tags"]
    record = json.loads(fixture("email_delivered"))
    # Webhooks carry tags as an object; the send API's list form is read too.
    for tags in ({t["name"]: t["value"] for t in sent_tags}, sent_tags):
        record["data"]["tags"] = tags
        (event,) = normalize(json.dumps(record).encode())
        assert event.event_id == email.event_id
        assert event.idempotency_key is None  # "…:welcome" travelled as "…_welcome"


@given(original=st.text(max_size=300))
def test_a_tag_value_read_back_is_always_the_original(original: str) -> None:
    record = {
        "type": "email.delivered",
        "created_at": "2026-01-01T11:00:00.000Z",
        "data": {
            "email_id": "x",
            "to": ["a@example.com"],
            "tags": {"event_id": tag_value(original), "idempotency_key": tag_value(original)},
        },
    }
    (event,) = normalize(json.dumps(record).encode())
    assert event.event_id in (None, original)
    assert event.idempotency_key in (None, original)


def test_any_ulid_event_id_is_recovered() -> None:
    for _ in range(50):
        event_id = new_ulid()
        record = {
            "type": "email.sent",
            "created_at": "2026-01-01T11:00:00.000Z",
            "data": {"email_id": "x", "to": ["a@example.com"], "tags": {"event_id": event_id}},
        }
        assert normalize(json.dumps(record).encode())[0].event_id == event_id


# --- verification ------------------------------------------------------------------------------


def test_build_verifier_needs_the_secret_in_whsec_form() -> None:
    with pytest.raises(ConfigurationError, match="RESEND_WEBHOOK_SECRET"):
        build_verifier({})
    with pytest.raises(ConfigurationError, match="whsec_"):
        build_verifier({"resend_webhook_secret": "not-a-whsec-secret"})
    body = fixture("email_delivered")
    headers = svix_signed(body, msg_id="msg_2q8nZ")
    assert build_verifier(SETTINGS).verify(headers, body, utcnow()) == "msg_2q8nZ"
    with pytest.raises(WebhookRejected):
        build_verifier({"resend_webhook_secret": OTHER_SECRET}).verify(headers, body, utcnow())


def test_forged_stale_future_tampered_and_incomplete_webhooks_are_refused(
    engine: Engine,
) -> None:
    body = fixture("email_bounced_permanent")
    now = int(time.time())
    good = svix_signed(body)
    cases: list[tuple[bytes, dict[str, str]]] = [
        (body, svix_signed(body, secret=OTHER_SECRET)),
        (body, svix_signed(body, timestamp=now - 301)),
        (body, svix_signed(body, timestamp=now + 360)),  # the receiver reads its clock later
        (body.replace(b"Permanent", b"Transient"), good),  # tampered after signing
        (body, {**good, "svix-id": "msg_other"}),  # the id is signed too
        (body, {**good, "svix-signature": "v1,"}),
        (body, {**good, "svix-signature": good["svix-signature"].replace("v1,", "v2,")}),
        (body, {**good, "svix-timestamp": "yesterday"}),
    ]
    for missing in ("svix-id", "svix-timestamp", "svix-signature"):
        cases.append((body, {k: v for k, v in good.items() if k != missing}))
    receiver = client(engine)
    for case_body, headers in cases:
        response = receiver.post("/webhooks/resend", content=case_body, headers=headers)
        assert response.status_code == 401, (headers, response.text)
    assert inbox_rows(engine) == []
    # Within the window, with a rotated-in second signature: accepted.
    fresh = svix_signed(body, timestamp=now - 240)
    other = sign(OTHER_SECRET, fresh["svix-id"], now - 240, body)
    fresh["svix-signature"] = f"{other} {fresh['svix-signature']}"
    assert receiver.post("/webhooks/resend", content=body, headers=fresh).status_code == 200


def test_missing_secret_answers_503_not_an_open_door(engine: Engine) -> None:
    body = fixture("email_delivered")
    response = client(engine, {}).post("/webhooks/resend", content=body, headers=svix_signed(body))
    assert response.status_code == 503
    assert inbox_rows(engine) == []


def test_standard_webhook_header_names_are_accepted_too(engine: Engine) -> None:
    body = fixture("email_delivered")
    headers = svix_signed(body, msg_id="msg_std", prefix="webhook")
    response = client(engine).post("/webhooks/resend", content=body, headers=headers)
    assert response.status_code == 200 and response.json()["status"] == "stored"
    (row,) = inbox_rows(engine)
    assert (row.delivery_id, row.body.encode()) == ("msg_std", body)


def test_replayed_svix_id_is_acknowledged_and_not_stored_again(engine: Engine) -> None:
    body = fixture("email_complained")
    headers = svix_signed(body, msg_id="msg_replayed")
    receiver = client(engine)
    first = receiver.post("/webhooks/resend", content=body, headers=headers)
    assert first.status_code == 200 and first.json()["status"] == "stored"
    for _ in range(2):
        again = receiver.post("/webhooks/resend", content=body, headers=headers)
        assert again.status_code == 200 and again.json()["status"] == "duplicate"
    (row,) = inbox_rows(engine)
    assert row.delivery_id == "msg_replayed"
    # The same event under a new svix-id (Resend's "replay" button) is stored but applied once.
    assert (
        receiver.post("/webhooks/resend", content=body, headers=svix_signed(body)).json()["status"]
        == "stored"
    )
    outcome = ingest(engine)
    assert (outcome.claimed, outcome.applied, outcome.duplicates) == (2, 1, 1)
    assert len(event_rows(engine)) == 1


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'["email.delivered"]',
        b'{"type": "email.delivered", "created_at": "2026-01-01T11:00:00Z"}',  # no data
        b'{"type": "email.delivered", "data": "email_id=1"}',
        b'{"data": {"email_id": "1"}}',  # no type
    ],
)
def test_authentic_but_unreadable_body_is_stored_as_malformed_and_answered_400(
    engine: Engine, body: bytes
) -> None:
    with pytest.raises(WebhookMalformed):
        normalize(body)
    response = client(engine).post("/webhooks/resend", content=body, headers=svix_signed(body))
    assert response.status_code == 400
    (row,) = inbox_rows(engine)
    assert (row.status, row.body.encode()) == ("malformed", body)
    assert ingest(engine).claimed == 0
    assert event_rows(engine) == []


# --- end to end --------------------------------------------------------------------------------


def test_every_fixture_is_received_linked_applied_and_suppresses(engine: Engine) -> None:
    message_ids = {
        name: seed_sent_message(
            engine, event_id=e.event_id, recipient=e.recipient, provider_message_id=e.email_id
        )
        for name, e in EXPECTED.items()
    }
    receiver = client(engine)
    for name in EXPECTED:
        body = fixture(name)
        response = receiver.post("/webhooks/resend", content=body, headers=svix_signed(body))
        assert response.status_code == 200 and response.json()["status"] == "stored", name

    outcome = ingest(engine)
    assert (outcome.claimed, outcome.applied, outcome.duplicates) == (10, 10, 0)
    assert (outcome.unlinked, outcome.malformed, outcome.suppressed) == (0, 0, 2)

    rows = {row.event_id: row for row in event_rows(engine)}
    assert len(rows) == len(EXPECTED)
    for name, expected in EXPECTED.items():
        row = rows[expected.event_id]
        assert row.provider == "resend"
        assert row.event_type == expected.event_type, name
        assert row.message_id == message_ids[name], name
        assert (row.provider_message_id, row.idempotency_key) == (expected.email_id, None)
        assert row.recipient == expected.recipient
        assert row.bounce_type == expected.bounce_type
        assert row.click_url == expected.click_url
    with engine.connect() as connection:
        query = select(email_messages.c.event_id, email_messages.c.delivery_status)
        states = {row[0]: row[1] for row in connection.execute(query)}
        reasons = suppressions.reasons_for(connection, [e.recipient for e in EXPECTED.values()])
    assert states == {e.event_id: e.event_type for e in EXPECTED.values()}
    assert reasons == {"gone@example.com": "hard_bounce", "annoyed@example.com": "complaint"}
    assert ingest(engine).claimed == 0


def test_event_id_tag_links_a_message_whose_provider_id_was_never_recorded(engine: Engine) -> None:
    """The accepted-then-crash window: Resend has the mail, our row has no ``email_id``."""
    expected = EXPECTED["email_bounced_permanent"]
    message_id = seed_sent_message(
        engine, event_id=expected.event_id, recipient=expected.recipient, provider_message_id=None
    )
    body = fixture("email_bounced_permanent")
    response = client(engine).post("/webhooks/resend", content=body, headers=svix_signed(body))
    assert response.status_code == 200
    outcome = ingest(engine)
    assert (outcome.applied, outcome.unlinked, outcome.suppressed) == (1, 0, 1)
    (row,) = event_rows(engine)
    assert (row.message_id, row.event_id) == (message_id, expected.event_id)
    with engine.connect() as connection:
        state = connection.execute(
            select(email_messages.c.delivery_status).where(
                email_messages.c.message_id == message_id
            )
        ).scalar_one()
    assert state == "bounced"
