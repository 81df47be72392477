"""Postmark webhooks are authenticated by HTTP basic auth, read in Postmark's documented shapes,
mapped onto the vocabulary, linked back to our messages through ``Metadata`` and applied once
(DESIGN.md invariant 7), on SQLite and PostgreSQL.

* Every fixture (one per documented record and bounce kind) normalizes to its expected event,
  with hard vs soft bounces, reasons, timestamps, recipient, click URL, machine opens and our
  ``event_id`` / ``idempotency_key`` read back from ``Metadata``.
* End to end: each fixture posted through the receiver with the configured credentials, then
  ingested, lands as one ``email_events`` row linked to its message, moves that message's
  delivery state, and suppresses exactly the hard bounce, the complaint and the unsubscribe.
* Basic auth has no timestamp and no delivery id: a replayed body is stored again and applied
  once, because the event's id (bounce ``ID`` or a stable hash) is unique at ingestion.
* Missing or wrong credentials are refused (401) with nothing stored; missing settings answer
  503; a body that authenticates but cannot be read is stored as malformed and answered 400.
"""

import base64
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select
from starlette.testclient import TestClient

from email_platform.db.schema import email_events, email_messages, webhook_inbox
from email_platform.errors import ConfigurationError
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.postmark import PostmarkProvider
from email_platform.store import messages, outbox, suppressions
from email_platform.timeutil import utcnow
from email_platform.webhooks import registry
from email_platform.webhooks.errors import WebhookMalformed, WebhookRejected
from email_platform.webhooks.ingest import IngestOutcome, WebhookIngestor
from email_platform.webhooks.postmark import build_verifier, normalize
from email_platform.webhooks.receiver import create_receiver_app

FIXTURES = Path(__file__).parent / "fixtures" / "webhooks" / "postmark"
USER = "postmark-hooks"
PASSWORD = "c0rrect:horse-battery"  # a colon is legal in a basic auth password
SETTINGS = {"postmark_webhook_user": USER, "postmark_webhook_password": PASSWORD}
PROVIDERS = {"postmark": registry.get("postmark")}


@dataclass(frozen=True)
class Expected:
    event_type: str
    recipient: str
    event_id: str | None  # our id in Metadata (None: a record Postmark sends without it)
    message_id: str | None  # Postmark's MessageID
    at: datetime
    bounce_type: str | None = None
    suppression: str | None = None
    reason: str | None = None  # how reject_reason starts
    machine_open: bool | None = None
    click_url: str | None = None
    provider_event_id: str | None = None  # when Postmark gives one (bounce ID)


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


EXPECTED = {
    "delivery": Expected(
        "delivered",
        "delivered.jane@example.com",
        "01KDVDNA0097KG8C0MA99JE5Z0",
        "d602d3a6-046c-48cc-aef6-befafda49993",
        _at("2026-01-01T10:01:02.521345+00:00"),
    ),
    "bounce_hard": Expected(
        "bounced",
        "no.such.user@example.com",
        "01KDVDQ5J8JQ4FZKV7FTV69F33",
        "865def84-d658-4841-ae08-c5f856ff4678",
        _at("2026-01-01T15:02:11.273539+00:00"),  # sent as 10:02:11.2735393-05:00
        bounce_type="hard",
        suppression="hard_bounce",
        reason="HardBounce: smtp;550 5.1.1",
        provider_event_id="bounce:4323372036",
    ),
    "bounce_soft": Expected(
        "bounced",
        "full.mailbox@example.com",
        "01KDVDS14G10S4GG51ZB94166F",
        "d9d23414-fd8d-4d29-a235-ffc98588077d",
        _at("2026-01-01T15:03:40.118+00:00"),
        bounce_type="soft",
        reason="SoftBounce: smtp;452 4.2.2",
        provider_event_id="bounce:4323372037",
    ),
    "bounce_transient": Expected(
        "deferred",
        "slow.server@example.net",
        "01KDVDTWPRM755Z04N4HZ9E1XZ",
        "b19ed4d9-3c6c-46ef-886e-3fa6ffbcd88a",
        _at("2026-01-01T15:04:05+00:00"),
        reason="Transient: smtp;421 4.7.0",
        provider_event_id="bounce:4323372038",
    ),
    "bounce_spam_notification": Expected(
        "bounced",
        "filtered@example.org",
        "01KDVDWR907CFC9AW7WB02XJX9",
        "afd5697d-26dc-4f38-8b8f-95d97fe5a3b1",
        _at("2026-01-01T15:05:44.4+00:00"),
        bounce_type="soft",  # a filter's verdict, not the recipient's complaint
        reason="SpamNotification: Your message was quarantined",
        provider_event_id="bounce:4323372039",
    ),
    "spam_complaint": Expected(
        "complained",
        "complainer@example.com",
        "01KDVDYKV8XAAHRE6FS4B4HMXP",
        "a94096d3-e1ff-475f-a5c1-5afee3eac178",
        _at("2026-01-01T16:20:00+00:00"),
        suppression="complaint",
        reason="SpamComplaint: The subscriber explicitly marked this message as spam.",
        provider_event_id="bounce:4323372040",
    ),
    "open": Expected(
        "opened",
        "reader@example.com",
        "01KDVE0FDGJQZ18FY028FJ795G",
        "ea7498dc-ab52-45d0-9ba4-521c386ec777",
        _at("2026-01-01T10:15:31.712+00:00"),
        machine_open=False,
    ),
    "open_apple_privacy": Expected(
        "opened",
        "iphone.user@icloud.example",
        "01KDVE2AZREVCDD5SNMT4R9MN2",
        "81ffd14d-82f2-434e-9fee-fe1baae32dff",
        _at("2026-01-01T10:01:09.041+00:00"),
        machine_open=True,  # bare Mozilla/5.0 from Apple's 17.0.0.0/8
    ),
    "click": Expected(
        "clicked",
        "clicker@example.com",
        "01KDVE46J0202W271NFJ19QQD3",
        "35073960-e957-4b72-a8f0-c2afcc980128",
        _at("2026-01-01T10:17:12.33+00:00"),
        click_url="https://app.example.com/welcome/start?utm_source=email&utm_campaign=welcome",
    ),
    "subscription_change_unsubscribe": Expected(
        "unsubscribed",
        "leaving@example.com",
        "01KDVE6248ND7Q7EAKGHP72V2R",
        "e6d051ba-4ddf-4286-9f40-8e345465ea5e",
        _at("2026-01-01T18:40:27.416071+00:00"),
        suppression="unsubscribe",
        reason="ManualSuppression",
    ),
    # A reactivation: Postmark sends no MessageID and an empty Metadata, so it links to nothing.
    "subscription_change_reactivated": Expected(
        "subscribed",
        "welcome.back@example.com",
        None,
        None,
        _at("2026-01-02T09:12:03+00:00"),
    ),
}


def fixture(name: str) -> bytes:
    return (FIXTURES / f"{name}.json").read_bytes()


def basic_auth(user: str = USER, password: str = PASSWORD) -> dict[str, str]:
    """The headers Postmark sends for a webhook URL ``https://<user>:<password>@host/...``."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"authorization": f"Basic {token}", "content-type": "application/json"}


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
    return WebhookIngestor(engine, providers=PROVIDERS).run(ids, run_id="test-postmark")


def seed_sent_message(
    engine: Engine, *, event_id: str, recipient: str, provider_message_id: str | None
) -> int:
    """An outbox event and its message, sent through Postmark, as the send job leaves them."""
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
                "provider": "postmark",
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
    assert event.provider == "postmark"
    assert event.event_type == expected.event_type
    assert event.recipient == expected.recipient
    assert event.event_id == expected.event_id
    key = f"{expected.event_id}:welcome" if expected.event_id else None
    assert event.idempotency_key == key
    assert event.provider_message_id == expected.message_id
    assert event.occurred_at == expected.at
    assert event.bounce_type == expected.bounce_type
    assert event.suppression_reason == expected.suppression
    if expected.reason is None:
        assert event.reject_reason is None
    else:
        assert event.reject_reason is not None
        assert event.reject_reason.startswith(expected.reason)
    assert event.machine_open == expected.machine_open
    assert event.click_url == expected.click_url
    if expected.provider_event_id:
        assert event.provider_event_id == expected.provider_event_id
    else:
        assert event.provider_event_id.startswith("sha256:")
    assert event.raw == json.loads(fixture(name))


def test_event_ids_are_stable_across_redeliveries_and_distinct_between_events() -> None:
    """What dedupes a replay at ingestion: same record -> same id; another record -> another."""
    ids = {name: normalize(fixture(name))[0].provider_event_id for name in EXPECTED}
    assert len(set(ids.values())) == len(ids)
    reformatted = json.dumps(json.loads(fixture("open")), indent=None).encode()  # other bytes
    assert normalize(reformatted)[0].provider_event_id == ids["open"]
    second_open = json.loads(fixture("open"))
    second_open["FirstOpen"] = False
    second_open["ReceivedAt"] = "2026-01-01T12:00:00.0000000Z"
    assert normalize(json.dumps(second_open).encode())[0].provider_event_id != ids["open"]


@pytest.mark.parametrize(
    ("bounce_type", "type_code", "event_type", "hard_or_soft"),
    [
        ("HardBounce", 1, "bounced", "hard"),
        ("BadEmailAddress", 100000, "bounced", "hard"),
        ("SoftBounce", 4096, "bounced", "soft"),
        ("DnsError", 256, "bounced", "soft"),
        ("Unknown", 2048, "bounced", "soft"),
        ("Blocked", 100006, "bounced", "soft"),
        ("DMARCPolicy", 100009, "bounced", "soft"),
        ("VirusNotification", 8192, "bounced", "soft"),
        ("Transient", 2, "deferred", None),
        ("AutoResponder", 64, "autoresponded", None),
        ("ChallengeVerification", 16384, "autoresponded", None),
        ("Unsubscribe", 16, "unsubscribed", None),
        ("ManuallyDeactivated", 100002, "rejected", None),
        ("SMTPApiError", 100007, "failed", None),
        ("TemplateRenderingFailed", 100010, "failed", None),
        ("OpenRelayTest", 1024, "unknown", None),
        ("SomeTypePostmarkAddsLater", 999999, "bounced", "soft"),  # never suppresses
    ],
)
def test_bounce_types_map_by_postmarks_table(
    bounce_type: str, type_code: int, event_type: str, hard_or_soft: str | None
) -> None:
    record = json.loads(fixture("bounce_hard"))
    record.update(Type=bounce_type, TypeCode=type_code)
    (event,) = normalize(json.dumps(record).encode())
    assert (event.event_type, event.bounce_type) == (event_type, hard_or_soft)
    assert (event.suppression_reason == "hard_bounce") == (hard_or_soft == "hard")
    # Only the code, no Type: the code table decides the same way.
    del record["Type"]
    if bounce_type != "SomeTypePostmarkAddsLater":
        (by_code,) = normalize(json.dumps(record).encode())
        assert (by_code.event_type, by_code.bounce_type) == (event_type, hard_or_soft)


def test_unknown_record_type_is_kept_as_unknown_not_refused() -> None:
    (event,) = normalize(b'{"RecordType": "SMTPEvent", "MessageID": "abc", "Metadata": {}}')
    assert (event.event_type, event.provider_message_id, event.event_id) == ("unknown", "abc", None)


def test_foreign_metadata_values_are_not_taken_for_our_ids() -> None:
    record = json.loads(fixture("delivery"))
    record["Metadata"] = {"event_id": "x" * 40, "idempotency_key": 42}
    (event,) = normalize(json.dumps(record).encode())
    assert (event.event_id, event.idempotency_key) == (None, None)  # would not fit our columns


def test_metadata_written_by_the_send_adapter_is_read_back() -> None:
    """The adapter's ``Metadata`` comes back in every webhook: the same two ids, unchanged."""
    email = OutgoingEmail(
        message_id=1,
        event_id="01KDVFF0NRVB039663SGXKY95F",
        idempotency_key="order-7781:receipt",
        sender="Example <no-reply@example.com>",
        to="jane@example.com",
        subject="Your receipt",
        text="Thanks",
        html=None,
        template="receipt",
        lane="transactional",
    )
    request = PostmarkProvider(server_token="server-token").build_request(email)
    record = json.loads(fixture("delivery"))
    record["Metadata"] = request.json["Metadata"]
    (event,) = normalize(json.dumps(record).encode())
    assert (event.event_id, event.idempotency_key) == (email.event_id, email.idempotency_key)


# --- authentication ----------------------------------------------------------------------------


def test_build_verifier_needs_both_credentials() -> None:
    for settings in ({}, {"postmark_webhook_user": USER}, {"postmark_webhook_password": PASSWORD}):
        with pytest.raises(ConfigurationError, match="POSTMARK_WEBHOOK_USER"):
            build_verifier(settings)
    assert build_verifier(SETTINGS).verify(basic_auth(), b"{}", utcnow()) is None  # no delivery id
    with pytest.raises(WebhookRejected):
        build_verifier(SETTINGS).verify({}, b"{}", utcnow())


def test_missing_or_wrong_credentials_are_refused_and_nothing_is_stored(engine: Engine) -> None:
    body = fixture("bounce_hard")
    good = basic_auth()["authorization"]
    raw = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    cases: list[dict[str, str]] = [
        {},
        basic_auth(password="wrong"),
        basic_auth(password=PASSWORD[:-1]),  # a prefix of the right one
        basic_auth(password=PASSWORD + "x"),
        basic_auth(user="someone-else"),
        basic_auth(user=USER.upper()),
        basic_auth(user=PASSWORD, password=USER),
        basic_auth(password=""),
        {"authorization": "Basic " + base64.b64encode(USER.encode()).decode()},  # no colon
        {"authorization": f"Bearer {raw}"},
        {"authorization": "Basic"},
        {"authorization": "Basic not/base64!!"},
        {"authorization": good + "AAAA"},
    ]
    receiver = client(engine)
    for headers in cases:
        response = receiver.post("/webhooks/postmark", content=body, headers=headers)
        assert response.status_code == 401, (headers, response.text)
    assert inbox_rows(engine) == []
    # The scheme name is case-insensitive (RFC 7617); the right credentials get in.
    headers = {"authorization": "basic " + raw}
    assert receiver.post("/webhooks/postmark", content=body, headers=headers).status_code == 200


@pytest.mark.parametrize("settings", [{}, {"postmark_webhook_user": USER}])
def test_missing_settings_answer_503_not_an_open_door(
    engine: Engine, settings: dict[str, str]
) -> None:
    response = client(engine, settings).post(
        "/webhooks/postmark", content=fixture("delivery"), headers=basic_auth()
    )
    assert response.status_code == 503
    assert inbox_rows(engine) == []


def test_authentic_webhook_is_stored_raw_without_the_credentials(engine: Engine) -> None:
    body = fixture("spam_complaint")
    response = client(engine).post("/webhooks/postmark", content=body, headers=basic_auth())
    assert response.status_code == 200 and response.json()["status"] == "stored"
    (row,) = inbox_rows(engine)
    assert row.body.encode() == body
    assert (row.provider, row.status, row.delivery_id) == ("postmark", "pending", None)
    assert "authorization" not in row.headers  # the password is not written to the database


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'["RecordType", "Bounce"]',
        b'{"MessageID": "d602d3a6-046c-48cc-aef6-befafda49993"}',  # no RecordType
        b'{"RecordType": "SubscriptionChange", "Recipient": "a@example.com",'
        b' "SuppressSending": "yes"}',
        b'{"RecordType": "Delivery", "Recipient": "a@example.com", "Metadata": "event_id=1"}',
    ],
)
def test_authentic_but_unreadable_body_is_stored_as_malformed_and_answered_400(
    engine: Engine, body: bytes
) -> None:
    with pytest.raises(WebhookMalformed):
        normalize(body)
    response = client(engine).post("/webhooks/postmark", content=body, headers=basic_auth())
    assert response.status_code == 400
    (row,) = inbox_rows(engine)
    assert (row.status, row.body.encode()) == ("malformed", body)
    assert ingest(engine).claimed == 0  # nothing pending for the ingestor
    assert event_rows(engine) == []


# --- end to end --------------------------------------------------------------------------------


def test_every_fixture_is_received_linked_applied_and_suppresses(engine: Engine) -> None:
    message_ids = {
        name: seed_sent_message(
            engine,
            event_id=e.event_id,
            recipient=e.recipient,
            provider_message_id=e.message_id,
        )
        for name, e in EXPECTED.items()
        if e.event_id
    }
    receiver = client(engine)
    for name in EXPECTED:
        response = receiver.post("/webhooks/postmark", content=fixture(name), headers=basic_auth())
        assert response.status_code == 200 and response.json()["status"] == "stored", name

    outcome = ingest(engine)
    assert (outcome.claimed, outcome.applied, outcome.duplicates) == (11, 11, 0)
    assert (outcome.unlinked, outcome.malformed, outcome.suppressed) == (1, 0, 3)

    rows = {row.recipient: row for row in event_rows(engine)}
    assert len(rows) == len(EXPECTED)
    for name, expected in EXPECTED.items():
        row = rows[expected.recipient]
        assert row.provider == "postmark"
        assert row.event_type == expected.event_type, name
        assert row.event_id == expected.event_id, name
        assert row.message_id == message_ids.get(name), name
        assert row.provider_message_id == expected.message_id
        assert row.bounce_type == expected.bounce_type
        assert row.machine_open == expected.machine_open
        assert row.click_url == expected.click_url
        assert row.recipient_domain == expected.recipient.rsplit("@", 1)[1]
    with engine.connect() as connection:
        query = select(email_messages.c.event_id, email_messages.c.delivery_status)
        states = {row[0]: row[1] for row in connection.execute(query)}
        reasons = suppressions.reasons_for(connection, [e.recipient for e in EXPECTED.values()])
    for expected in EXPECTED.values():
        if expected.event_id:
            assert states[expected.event_id] == expected.event_type
    assert reasons == {
        "no.such.user@example.com": "hard_bounce",
        "complainer@example.com": "complaint",
        "leaving@example.com": "unsubscribe",
    }
    assert ingest(engine).claimed == 0  # all done; a second pass has nothing to do


@pytest.mark.parametrize("name", ["bounce_hard", "open"])  # with a bounce ID / with a hash only
def test_replayed_body_is_stored_again_but_applied_once(engine: Engine, name: str) -> None:
    expected = EXPECTED[name]
    message_id = seed_sent_message(
        engine,
        event_id=expected.event_id,
        recipient=expected.recipient,
        provider_message_id=expected.message_id,
    )
    receiver = client(engine)
    for _ in range(3):  # a retry after a lost 2xx, or an attacker who captured one request
        response = receiver.post("/webhooks/postmark", content=fixture(name), headers=basic_auth())
        assert response.status_code == 200 and response.json()["status"] == "stored"
    assert len(inbox_rows(engine)) == 3  # basic auth has no delivery id to dedupe on
    outcome = ingest(engine)
    assert (outcome.claimed, outcome.applied, outcome.duplicates) == (3, 1, 2)
    (row,) = event_rows(engine)
    assert (row.message_id, row.event_type) == (message_id, expected.event_type)
