"""SendGrid Event Webhook: real ECDSA P-256 signatures (a key pair made here) are verified
before anything is stored, every documented event type normalizes to our vocabulary and links
back to its ``event_id`` through the receiver and the ingestor on SQLite and PostgreSQL, and
forged, stale, future, incomplete and replayed posts change nothing (DESIGN.md invariant 7).
"""

import base64
import json
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)
from sqlalchemy import delete, insert, select
from starlette.testclient import TestClient

from email_platform.db.schema import email_events, email_outbox, suppressions, webhook_inbox
from email_platform.errors import ConfigurationError
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.sendgrid import SendGridProvider
from email_platform.store import messages
from email_platform.store import suppressions as suppression_store
from email_platform.timeutil import utcnow
from email_platform.webhooks import sendgrid
from email_platform.webhooks.errors import WebhookMalformed, WebhookRejected
from email_platform.webhooks.ingest import WebhookIngestor
from email_platform.webhooks.registry import WebhookProvider
from email_platform.webhooks.vocabulary import RANK

FIXTURES = Path(__file__).parent / "fixtures" / "webhooks" / "sendgrid"
EVENT_ID = "01JF3W5Q8YV2N6T0R4K7M9B1SG"
KEY = f"{EVENT_ID}:welcome"
X_MESSAGE_ID = "W86EgYT6SQKk0lRflfLRsA"
RECIPIENT = "jane@example.com"

PRIVATE_KEY = ec.generate_private_key(ec.SECP256R1())
PUBLIC_KEY = base64.b64encode(
    PRIVATE_KEY.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
).decode()
SETTINGS = {"sendgrid_webhook_public_key": PUBLIC_KEY}
PROVIDERS = {"sendgrid": WebhookProvider("sendgrid", sendgrid.build_verifier, sendgrid.normalize)}
P256_ORDER = sendgrid.P256_ORDER

# fixture -> (event type, bounce type, suppression reason, reject reason prefix)
EXPECTED: dict[str, tuple[str, str | None, str | None, str | None]] = {
    "processed": ("queued", None, None, None),
    "dropped": ("rejected", None, None, "Bounced Address"),
    "deferred": ("deferred", None, None, "421 4.7.0"),
    "delivered": ("delivered", None, None, None),
    "bounce": ("bounced", "hard", "hard_bounce", "550 5.1.1"),
    "blocked": ("bounced", "soft", None, "421 4.7.28"),
    "open": ("opened", None, None, None),
    "open_machine": ("opened", None, None, None),
    "click": ("clicked", None, None, None),
    "spamreport": ("complained", None, "complaint", None),
    "unsubscribe": ("unsubscribed", None, "unsubscribe", None),
    "group_unsubscribe": ("unsubscribed", None, "unsubscribe", None),
    "group_resubscribe": ("subscribed", None, None, None),
}


def fixture_bytes(name: str) -> bytes:
    return (FIXTURES / f"{name}.json").read_bytes()


def fixture_events(name: str) -> list[dict]:
    return json.loads(fixture_bytes(name))


def sign(
    body: bytes,
    *,
    timestamp: int | str | None = None,
    key: ec.EllipticCurvePrivateKey = PRIVATE_KEY,
) -> dict[str, str]:
    """The headers SendGrid sends with ``body``: ECDSA P-256/SHA-256 over timestamp + body."""
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    signature = key.sign(stamp.encode() + body, ec.ECDSA(hashes.SHA256()))
    return {
        "Content-Type": "application/json",
        "X-Twilio-Email-Event-Webhook-Signature": base64.b64encode(signature).decode(),
        "X-Twilio-Email-Event-Webhook-Timestamp": stamp,
    }


def _client(engine, settings=SETTINGS) -> TestClient:  # type: ignore[no-untyped-def]
    from email_platform.webhooks.receiver import create_receiver_app

    return TestClient(create_receiver_app(engine, settings=settings, providers=PROVIDERS))


def _inbox(engine) -> list:  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        return list(connection.execute(select(webhook_inbox).order_by(webhook_inbox.c.inbox_id)))


def _ingest(engine, ids=None):  # type: ignore[no-untyped-def]
    if ids is None:
        ids = [row.inbox_id for row in _inbox(engine) if row.status == "pending"]
    return WebhookIngestor(engine, providers=PROVIDERS).run(ids, run_id="sendgrid-test")


def _sent_message(engine, *, event_id: str = EVENT_ID, provider_message_id: str = X_MESSAGE_ID):  # type: ignore[no-untyped-def]
    """The outbox row and the sent message the fixtures are about, as the send job leaves them."""
    now = utcnow()
    with engine.begin() as connection:
        connection.execute(
            insert(email_outbox).values(
                event_id=event_id,
                event_type="user.signed_up",
                event_version=2,
                aggregate_id="user_jane",
                occurred_at=now,
                published_at=now,
                payload={"user_id": "user_jane", "email": RECIPIENT},
                event_metadata={},
                lane="transactional",
                available_at=now,
                status="done",
                resolution="sent",
            )
        )
        return messages.create(
            connection,
            {
                "event_id": event_id,
                "route": "welcome",
                "template": "welcome",
                "template_version": 1,
                "lane": "transactional",
                "recipient": RECIPIENT,
                "recipient_domain": "example.com",
                "idempotency_key": f"{event_id}:welcome",
                "status": "sent",
                "created_at": now,
                "updated_at": now,
                "sent_at": now,
                "provider": "sendgrid",
                "provider_message_id": provider_message_id,
            },
        )


def _events_of(engine, inbox_id: int) -> list:  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        return list(
            connection.execute(
                select(email_events)
                .where(email_events.c.inbox_id == inbox_id)
                .order_by(email_events.c.email_event_id)
            )
        )


def _reasons(engine) -> dict[str, str]:  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        return suppression_store.reasons_for(connection, [RECIPIENT])


# ---- normalization of every documented event (no database) -----------------------------------


def test_every_fixture_has_an_expectation():
    assert {p.stem for p in FIXTURES.glob("*.json")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_normalizes_to_the_vocabulary_with_our_ids(name):
    kind, bounce, _, reason = EXPECTED[name]
    (raw,) = fixture_events(name)
    (event,) = sendgrid.normalize(fixture_bytes(name))
    assert event.provider == "sendgrid"
    assert event.event_type == kind
    assert event.provider_event_id == raw["sg_event_id"]
    assert (event.event_id, event.idempotency_key) == (EVENT_ID, KEY)
    assert event.provider_message_id == X_MESSAGE_ID
    assert event.recipient == RECIPIENT
    assert event.occurred_at == datetime.fromtimestamp(raw["timestamp"], UTC)
    assert event.bounce_type == bounce
    if reason is None:
        assert event.reject_reason is None
    else:
        assert event.reject_reason is not None and event.reject_reason.startswith(reason)
    assert event.click_url == (raw["url"] if kind == "clicked" else None)
    if kind == "opened":
        assert event.user_agent == raw["useragent"] and event.ip == raw["ip"]
        assert event.machine_open is raw["sg_machine_open"]
    else:
        assert event.machine_open is None
    assert event.raw == raw


def test_open_without_the_flag_still_detects_apple_privacy_proxy():
    (raw,) = fixture_events("open")
    raw.pop("sg_machine_open")
    raw.update(ip="17.58.101.4", useragent="Mozilla/5.0")
    (event,) = sendgrid.normalize(json.dumps([raw]).encode())
    assert event.machine_open is True


def test_bounce_classification_without_type_and_legacy_message_ids():
    def bounce(**fields) -> str:  # type: ignore[no-untyped-def]
        return sendgrid.bounce_type({"event": "bounce", **fields})

    assert bounce(status="5.1.1") == "hard"
    assert bounce(status="4.2.2") == "soft"
    assert bounce(bounce_classification="Invalid Address") == "hard"
    assert bounce(bounce_classification="Mailbox Unavailable") == "hard"
    assert bounce(bounce_classification="Technical") == "soft"
    assert bounce(type="blocked", status="5.7.1") == "soft"  # SendGrid's own word wins
    assert bounce(type="bounce", status="4.0.0") == "hard"
    # The doc's legacy dotted id keeps its dots before ".filter".
    legacy = "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0"
    assert sendgrid.message_id_of(legacy) == "14c5d75ce93.dfd.64b469"
    assert sendgrid.message_id_of("abc.recvd-1.0") == "abc"
    assert sendgrid.message_id_of(None) is None


def test_unknown_events_ids_that_do_not_fit_and_missing_event_ids():
    (raw,) = fixture_events("delivered")
    odd = dict(raw, event="account_status_change", event_id="x" * 27, idempotency_key=7)
    del odd["sg_event_id"]
    (event,) = sendgrid.normalize(json.dumps([odd]).encode())
    assert event.event_type == "unknown"
    assert event.event_id is None and event.idempotency_key is None  # not ours: not trusted
    assert event.provider_event_id.startswith("sha256:")
    # Stable: the same event hashes the same however its keys are ordered.
    reordered = dict(reversed(list(odd.items())))
    (again,) = sendgrid.normalize(json.dumps([reordered]).encode())
    assert again.provider_event_id == event.provider_event_id


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'{"event": "delivered"}',  # an object, not SendGrid's array
        b'[{"event": "delivered", "email": "a@example.com"}]',  # no timestamp
        b'[{"email": "a@example.com", "timestamp": 1795962138}]',  # no event
        b'[{"event": "delivered", "timestamp": 1795962138}, 7]',  # one bad element spoils all
    ],
)
def test_unreadable_bodies_are_malformed(body):
    with pytest.raises(WebhookMalformed):
        sendgrid.normalize(body)


def test_what_the_send_adapter_sends_is_what_the_normalizer_reads_back():
    email = OutgoingEmail(
        message_id=1,
        event_id=EVENT_ID,
        idempotency_key="01JF3W5Q8YV2N6T0R4K7M9B1SG:welcome/π",
        sender="Example <no-reply@example.com>",
        to=RECIPIENT,
        subject="Welcome",
        text="Hello",
        html=None,
        template="welcome",
        lane="transactional",
    )
    adapter = SendGridProvider("https://api.sendgrid.com", api_key="SG.test")
    request = adapter.build_request(email)
    accepted = adapter.accepted(httpx.Response(202, headers={"X-Message-Id": "Xm-1_abc"}))
    (raw,) = fixture_events("delivered")
    for metadata_key in ("event_id", "idempotency_key"):
        del raw[metadata_key]
    # SendGrid echoes every custom arg as a top-level field of each event.
    raw.update(request.json["personalizations"][0]["custom_args"])
    raw["sg_message_id"] = f"{accepted.provider_message_id}.filterdrecv-7d8c-1-6750A1B2-3.0"
    (event,) = sendgrid.normalize(json.dumps([raw]).encode())
    assert (event.event_id, event.idempotency_key) == (email.event_id, email.idempotency_key)
    assert event.provider_message_id == accepted.provider_message_id


# ---- the verifier ----------------------------------------------------------------------------


def test_key_configuration():
    with pytest.raises(ConfigurationError):
        sendgrid.build_verifier({})
    with pytest.raises(ConfigurationError):
        sendgrid.build_verifier({"sendgrid_webhook_public_key": "bm90IGEga2V5"})
    p384 = ec.generate_private_key(ec.SECP384R1()).public_key()
    der = p384.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    with pytest.raises(ConfigurationError, match="P-256"):
        sendgrid.build_verifier({"sendgrid_webhook_public_key": base64.b64encode(der).decode()})
    pem = PRIVATE_KEY.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    verifier = sendgrid.build_verifier({"sendgrid_webhook_public_key": pem.decode()})
    body = fixture_bytes("delivered")
    headers = {k.lower(): v for k, v in sign(body).items()}
    assert verifier.verify(headers, body, utcnow()).startswith("sha256:")


def test_the_freshness_window_is_five_minutes_both_ways():
    verifier = sendgrid.build_verifier(SETTINGS)
    body = fixture_bytes("open")
    now = datetime.fromtimestamp(1_795_962_138, UTC)
    for offset, ok in ((-300, True), (300, True), (-301, False), (301, False)):
        headers = {k.lower(): v for k, v in sign(body, timestamp=1_795_962_138 + offset).items()}
        if ok:
            assert verifier.verify(headers, body, now)
        else:
            with pytest.raises(WebhookRejected, match="tolerance"):
                verifier.verify(headers, body, now)


# ---- end to end through the receiver and the ingestor (SQLite and PostgreSQL) -----------------


def test_every_event_links_to_its_message_and_suppresses_as_it_should(engine):
    message = _sent_message(engine)
    client = _client(engine)
    for name, (kind, bounce, suppression, reason) in EXPECTED.items():
        body = fixture_bytes(name)
        response = client.post("/webhooks/sendgrid", content=body, headers=sign(body))
        assert response.status_code == 200 and response.json()["status"] == "stored", name
        inbox_id = response.json()["inbox_id"]
        outcome = _ingest(engine, [inbox_id])
        assert (outcome.applied, outcome.unlinked, outcome.malformed) == (1, 0, 0), name
        (row,) = _events_of(engine, inbox_id)
        assert (row.event_type, row.event_id, row.message_id) == (
            kind,
            EVENT_ID,
            message.message_id,
        ), name
        assert row.idempotency_key == KEY and row.provider_message_id == X_MESSAGE_ID
        assert row.bounce_type == bounce
        assert (row.reject_reason or "").startswith(reason or "")
        assert _reasons(engine) == ({RECIPIENT: suppression} if suppression else {}), name
        with engine.begin() as connection:
            connection.execute(delete(suppressions))
    (final,) = messages_of_event(engine)
    worst = max((e[0] for e in EXPECTED.values()), key=lambda t: RANK[t])
    assert final.delivery_status == worst == "complained"
    with engine.connect() as connection:
        clicked = connection.execute(
            select(email_events).where(email_events.c.event_type == "clicked")
        ).one()
        opens = {
            r.provider_event_id: r.machine_open
            for r in connection.execute(
                select(email_events).where(email_events.c.event_type == "opened")
            )
        }
    assert clicked.click_url == "https://app.example.com/welcome?utm_source=email"
    assert opens == {
        fixture_events("open")[0]["sg_event_id"]: False,
        fixture_events("open_machine")[0]["sg_event_id"]: True,
    }


def messages_of_event(engine) -> list:  # type: ignore[no-untyped-def]
    from email_platform.db.schema import email_messages

    with engine.connect() as connection:
        return list(
            connection.execute(select(email_messages).where(email_messages.c.event_id == EVENT_ID))
        )


def test_a_batch_is_one_delivery_and_a_signed_again_retry_applies_nothing_twice(engine):
    _sent_message(engine)
    batch = [event for name in EXPECTED for event in fixture_events(name)]
    body = json.dumps(batch).encode()
    client = _client(engine)
    assert client.post("/webhooks/sendgrid", content=body, headers=sign(body)).status_code == 200
    outcome = _ingest(engine)
    assert (outcome.claimed, outcome.applied, outcome.unlinked) == (1, len(batch), 0)
    assert _reasons(engine) == {RECIPIENT: "complaint"}  # the strongest reason present
    # SendGrid retries a post it thinks failed with a fresh signature: a new delivery, whose
    # events all dedupe on sg_event_id.
    time.sleep(0.001)
    again = client.post("/webhooks/sendgrid", content=body, headers=sign(body))
    assert again.status_code == 200 and again.json()["status"] == "stored"
    second = _ingest(engine)
    assert (second.applied, second.duplicates) == (0, len(batch))
    with engine.connect() as connection:
        assert len(list(connection.execute(select(email_events)))) == len(batch)


def test_an_event_without_custom_args_links_by_the_message_id(engine):
    message = _sent_message(engine)
    (raw,) = fixture_events("delivered")
    del raw["event_id"], raw["idempotency_key"]
    raw["sg_event_id"] = "bm8tY3VzdG9tLWFyZ3M"
    body = json.dumps([raw]).encode()
    response = _client(engine).post("/webhooks/sendgrid", content=body, headers=sign(body))
    assert response.status_code == 200
    _ingest(engine)
    (row,) = _events_of(engine, response.json()["inbox_id"])
    assert row.message_id == message.message_id
    assert row.event_id == EVENT_ID  # filled in from the message it links to


def _malleated(headers: dict[str, str]) -> dict[str, str]:
    """The same signature as ``(r, n - s)``: just as valid, different bytes."""
    name = "X-Twilio-Email-Event-Webhook-Signature"
    r, s = decode_dss_signature(base64.b64decode(headers[name]))
    twin = encode_dss_signature(r, P256_ORDER - s)
    return {**headers, name: base64.b64encode(twin).decode()}


def test_forged_stale_future_incomplete_and_garbled_posts_are_refused_unstored(engine):
    _sent_message(engine)
    client = _client(engine)
    body = fixture_bytes("bounce")
    good = sign(body)
    sig, stamp = (
        "X-Twilio-Email-Event-Webhook-Signature",
        "X-Twilio-Email-Event-Webhook-Timestamp",
    )
    other_key = ec.generate_private_key(ec.SECP256R1())
    now = int(time.time())
    cases = {
        "wrong key": (body, sign(body, key=other_key)),
        "tampered body": (body.replace(b'"bounce"', b'"delivered"', 1), good),
        "other timestamp": (body, {**good, stamp: str(int(good[stamp]) - 1)}),
        "stale": (body, sign(body, timestamp=now - 301)),
        "future": (body, sign(body, timestamp=now + 360)),  # the receiver reads its clock later
        "no signature": (body, {k: v for k, v in good.items() if k != sig}),
        "no timestamp": (body, {k: v for k, v in good.items() if k != stamp}),
        "empty signature": (body, {**good, sig: ""}),
        "not base64": (body, {**good, sig: "%%%not-base64%%%"}),
        "not DER": (body, {**good, sig: base64.b64encode(b"\x01" * 64).decode()}),
        "timestamp not digits": (body, {**good, stamp: f"{now}.0"}),
    }
    for case, (case_body, headers) in cases.items():
        response = client.post("/webhooks/sendgrid", content=case_body, headers=headers)
        assert response.status_code == 401, (case, response.text)
    assert _inbox(engine) == []
    # The untouched original still goes through: the refusals were about the changes.
    assert client.post("/webhooks/sendgrid", content=body, headers=good).status_code == 200


def test_a_replayed_delivery_is_acknowledged_and_not_stored_again(engine):
    _sent_message(engine)
    client = _client(engine)
    body = fixture_bytes("spamreport")
    headers = sign(body)
    first = client.post("/webhooks/sendgrid", content=body, headers=headers)
    assert first.status_code == 200 and first.json()["status"] == "stored"
    for replay in (headers, _malleated(headers)):
        again = client.post("/webhooks/sendgrid", content=body, headers=replay)
        assert again.status_code == 200 and again.json()["status"] == "duplicate"
    (row,) = _inbox(engine)
    assert row.body.encode() == body and row.delivery_id.startswith("sha256:")
    assert (
        row.headers["x-twilio-email-event-webhook-signature"]
        == headers["X-Twilio-Email-Event-Webhook-Signature"]
    )
    assert _ingest(engine).applied == 1


def test_authentic_but_unreadable_is_stored_malformed_and_answered_400(engine):
    client = _client(engine)
    body = b'{"event": "delivered", "email": "jane@example.com"}'
    response = client.post("/webhooks/sendgrid", content=body, headers=sign(body))
    assert response.status_code == 400
    (row,) = _inbox(engine)
    assert row.status == "malformed" and row.body.encode() == body
    assert _ingest(engine).claimed == 0


def test_without_a_public_key_the_receiver_answers_503_and_stores_nothing(engine):
    body = fixture_bytes("delivered")
    response = _client(engine, settings={}).post(
        "/webhooks/sendgrid", content=body, headers=sign(body)
    )
    assert response.status_code == 503
    assert _inbox(engine) == []
