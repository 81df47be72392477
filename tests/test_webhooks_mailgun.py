"""Mailgun webhooks are verified by their HMAC signature block, kept fresh and single-use, read
in Mailgun's documented event-data shape, mapped onto the vocabulary, linked back to our
messages through the ``v:`` user variables and applied once (DESIGN.md invariant 7), on SQLite
and PostgreSQL.

* Every fixture (each documented event, failures permanent / temporary / suppressed) normalizes
  to its expected event: hard vs soft, reasons, timestamps, recipient, click URL, user agent,
  Mailgun's bot flag as the machine-open signal, and our ``event_id`` / ``idempotency_key``.
* End to end: each fixture, signed like Mailgun signs it and posted through the receiver, then
  ingested, lands as one ``email_events`` row linked to its message, and exactly the hard
  bounces, the complaint and the unsubscribe suppress.
* Security: Mailgun signs only ``timestamp + token``, so freshness and single use carry the
  weight. Wrong key, tampered signature, stale and future timestamps, missing fields are refused
  (401) with nothing stored; a replayed token is acknowledged and not stored again, even glued
  to other event data; a body that verifies but cannot be read is stored as malformed (400).
"""

import json
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select
from starlette.testclient import TestClient

from email_platform.db.schema import email_events, email_messages, webhook_inbox
from email_platform.errors import ConfigurationError
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.mailgun import MailgunProvider
from email_platform.store import messages, outbox, suppressions
from email_platform.timeutil import utcnow
from email_platform.webhooks import registry
from email_platform.webhooks.errors import WebhookMalformed, WebhookRejected
from email_platform.webhooks.ingest import IngestOutcome, WebhookIngestor
from email_platform.webhooks.mailgun import build_verifier, normalize, sign
from email_platform.webhooks.receiver import create_receiver_app

FIXTURES = Path(__file__).parent / "fixtures" / "webhooks" / "mailgun"
SIGNING_KEY = "mailgun-webhook-signing-key-for-tests"
SETTINGS = {"mailgun_webhook_signing_key": SIGNING_KEY}
PROVIDERS = {"mailgun": registry.get("mailgun")}
CHROME = (
    "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) "
    "Chrome/124.0.0.0 Safari/537.36"
)


@dataclass(frozen=True)
class Expected:
    event_type: str
    recipient: str
    event_id: str
    message_id: str  # message.headers.message-id, as the send adapter stores it
    event_index: int  # the fixture's position in time: timestamp 1767268862.908181 + 37.25 * i
    bounce_type: str | None = None
    suppression: str | None = None
    reason: str | None = None  # how reject_reason starts
    machine_open: bool | None = None
    click_url: str | None = None
    user_agent: str | None = None


EXPECTED = {
    "delivered": Expected(
        "delivered",
        "alice@example.com",
        "01KDVETHD0YA739MEDZXGM30CQ",
        "20260101120102.1.5A7C3E9D2B4F6A81@mg.example.com",
        0,
    ),
    "failed_permanent": Expected(
        "bounced",
        "nobody@example.com",
        "01KDVEWCZ8B0XJJHRVDAW3PTCH",
        "20260101120103.1.0B6F1C2D3E4A5B67@mg.example.com",
        1,
        bounce_type="hard",
        suppression="hard_bounce",
        reason="bounce: 550 5.1.1 The email account that you tried to reach does not exist.",
    ),
    "failed_temporary": Expected(
        "deferred",
        "overquota@example.com",
        "01KDVEY8HGPCXHB6SEE6AXGE10",
        "20260101120104.1.C1D2E3F405162738@mg.example.com",
        2,
        reason="generic: 452 4.2.2 The email account that you tried to reach is over quota.",
    ),
    "failed_suppress_bounce": Expected(
        "bounced",
        "bounced.before@example.com",
        "01KDVF043R4ZQ293F2N98ZPAKX",
        "20260101120105.1.9A8B7C6D5E4F3021@mg.example.com",
        3,
        bounce_type="hard",
        suppression="hard_bounce",
        reason="suppress-bounce: 605 Not delivering to previously bounced address",
    ),
    "opened": Expected(
        "opened",
        "bob@example.com",
        "01KDVF1ZP0FQPRH4H2VBBFJTAW",
        "20260101120106.1.1122334455667788@mg.example.com",
        4,
        machine_open=False,
        user_agent=CHROME,
    ),
    "opened_apple_mpp": Expected(
        "opened",
        "carol@icloud.example",
        "01KDVF3V880VRS52309EXRPHWS",
        "20260101120107.1.99AABBCCDDEEFF00@mg.example.com",
        5,
        machine_open=True,  # client-info.bot == "apple"
        user_agent="Mozilla/5.0",
    ),
    "clicked": Expected(
        "clicked",
        "dave@example.com",
        "01KDVF5PTGTWDSN9T553GP35RP",
        "20260101120108.1.0F1E2D3C4B5A6978@mg.example.com",
        6,
        click_url="https://app.example.com/welcome/start?utm_source=email",
        user_agent=CHROME,
    ),
    "complained": Expected(
        "complained",
        "erin@example.com",
        "01KDVF7JCR76JYYG2PRN6GTVHP",
        "20260101120109.1.A0B1C2D3E4F50617@mg.example.com",
        7,
        suppression="complaint",
    ),
    "unsubscribed": Expected(
        "unsubscribed",
        "frank@example.com",
        "01KDVF9DZ0EGEP04MYDBV0CCS1",
        "20260101120110.1.7766554433221100@mg.example.com",
        8,
        suppression="unsubscribe",
        user_agent=CHROME,
    ),
    "accepted": Expected(
        "queued",
        "grace@example.com",
        "01KDVFB9H8SAS8XJN504NM1EKS",
        "20260101120111.1.ABCDEF0123456789@mg.example.com",
        9,
    ),
    "rejected": Expected(
        "rejected",
        "heidi@example.com",  # from the To header: a rejection carries no recipient
        "01KDVFD53GGRV09DP12Q95QZJN",
        "20260101120112.1.0123456789ABCDEF@mg.example.com",
        10,
        reason="Sandbox subdomains are for test purposes only.",
    ),
}


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def signed(
    payload: dict[str, Any],
    *,
    key: str = SIGNING_KEY,
    timestamp: int | None = None,
    token: str | None = None,
) -> bytes:
    """``payload`` with a fresh signature block, exactly as Mailgun computes it."""
    timestamp_text = str(int(time.time()) if timestamp is None else timestamp)
    token = token or secrets.token_hex(25)  # Mailgun's tokens are 50 characters
    block = {
        "timestamp": timestamp_text,
        "token": token,
        "signature": sign(key, timestamp_text, token),
    }
    return json.dumps({**payload, "signature": block}).encode()


def client(engine: Engine, settings: dict[str, str] = SETTINGS) -> TestClient:
    return TestClient(create_receiver_app(engine, settings=settings, providers=PROVIDERS))


def post(receiver: TestClient, body: bytes) -> httpx.Response:
    return receiver.post(
        "/webhooks/mailgun", content=body, headers={"content-type": "application/json"}
    )


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
    return WebhookIngestor(engine, providers=PROVIDERS).run(ids, run_id="test-mailgun")


def seed_sent_message(
    engine: Engine, *, event_id: str, recipient: str, provider_message_id: str | None
) -> int:
    """An outbox event and its message, sent through Mailgun, as the send job leaves them."""
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
                "provider": "mailgun",
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
    payload = fixture(name)
    (event,) = normalize(signed(payload))
    assert event.provider == "mailgun"
    assert event.provider_event_id == payload["event-data"]["id"]
    assert event.event_type == expected.event_type
    assert event.recipient == expected.recipient
    assert event.event_id == expected.event_id
    assert event.idempotency_key == f"{expected.event_id}:welcome"
    assert event.provider_message_id == expected.message_id
    seconds = 1767268862.908181 + 37.25 * expected.event_index
    assert event.occurred_at == datetime.fromtimestamp(seconds, tz=UTC)
    assert event.bounce_type == expected.bounce_type
    assert event.suppression_reason == expected.suppression
    if expected.reason is None:
        assert event.reject_reason is None
    else:
        assert event.reject_reason is not None
        assert event.reject_reason.startswith(expected.reason)
        assert len(event.reject_reason) <= 255
    assert event.machine_open == expected.machine_open
    assert event.click_url == expected.click_url
    assert event.user_agent == expected.user_agent
    assert event.raw == payload["event-data"]


@pytest.mark.parametrize(
    ("severity", "reason", "event_type", "hard_or_soft"),
    [
        ("permanent", "bounce", "bounced", "hard"),
        ("permanent", "suppress-bounce", "bounced", "hard"),
        ("permanent", "generic", "bounced", "hard"),
        ("permanent", "old", "bounced", "soft"),  # retries ran out: the address may be fine
        ("permanent", "esp-block", "bounced", "soft"),
        ("permanent", "suppress-complaint", "rejected", None),
        ("permanent", "suppress-unsubscribe", "rejected", None),
        ("temporary", "generic", "deferred", None),
        ("temporary", "greylisted", "deferred", None),
        (None, None, "bounced", "soft"),  # no severity: not proof the address is dead
    ],
)
def test_failure_severity_and_reason_decide_the_event(
    severity: str | None, reason: str | None, event_type: str, hard_or_soft: str | None
) -> None:
    payload = fixture("failed_permanent")
    data = payload["event-data"]
    data.pop("severity")
    data.pop("reason")
    if severity:
        data["severity"] = severity
    if reason:
        data["reason"] = reason
    (event,) = normalize(signed(payload))
    assert (event.event_type, event.bounce_type) == (event_type, hard_or_soft)
    assert (event.suppression_reason == "hard_bounce") == (hard_or_soft == "hard")


@pytest.mark.parametrize(("bot", "machine"), [("gmail", True), ("generic", True), ("", False)])
def test_mailguns_bot_flag_marks_machine_opens(bot: str, machine: bool) -> None:
    """A browser agent from an ordinary address: only Mailgun's own detection tells."""
    payload = fixture("opened")
    payload["event-data"]["client-info"]["bot"] = bot
    assert normalize(signed(payload))[0].machine_open is machine


def test_message_id_with_angle_brackets_matches_what_the_adapter_stored() -> None:
    adapter = MailgunProvider(api_key="key-test", domain="mg.example.com")
    stored = adapter.accepted(
        httpx.Response(200, json={"id": "<20260101.1.ABC@mg.example.com>", "message": "Queued."})
    ).provider_message_id
    payload = fixture("delivered")
    for reported in ("20260101.1.ABC@mg.example.com", "<20260101.1.ABC@mg.example.com>"):
        payload["event-data"]["message"]["headers"]["message-id"] = reported
        assert normalize(signed(payload))[0].provider_message_id == stored


def test_user_variables_written_by_the_send_adapter_are_read_back() -> None:
    email = OutgoingEmail(
        message_id=1,
        event_id="01KDVFF0NRVB039663SGXKY95F",
        idempotency_key="order-7781:receipt",
        sender="Example <no-reply@mg.example.com>",
        to="jane@example.com",
        subject="Your receipt",
        text="Thanks",
        html=None,
        template="receipt",
        lane="transactional",
    )
    form = MailgunProvider(api_key="key-test", domain="mg.example.com").build_request(email).data
    assert isinstance(form, dict)
    payload = fixture("delivered")
    payload["event-data"]["user-variables"] = {
        name.removeprefix("v:"): value for name, value in form.items() if name.startswith("v:")
    }
    (event,) = normalize(signed(payload))
    assert (event.event_id, event.idempotency_key) == (email.event_id, email.idempotency_key)


def test_unknown_event_is_kept_as_unknown_not_refused() -> None:
    payload = fixture("delivered")
    payload["event-data"]["event"] = "list_member_uploaded"
    assert normalize(signed(payload))[0].event_type == "unknown"


# --- verification ------------------------------------------------------------------------------


def test_build_verifier_needs_the_signing_key() -> None:
    with pytest.raises(ConfigurationError, match="MAILGUN_WEBHOOK_SIGNING_KEY"):
        build_verifier({})
    with pytest.raises(ConfigurationError, match="TOLERANCE_S"):
        build_verifier({**SETTINGS, "mailgun_webhook_tolerance_s": "five minutes"})
    body = signed(fixture("delivered"), token="t" * 50)
    assert build_verifier(SETTINGS).verify({}, body, utcnow()) == "t" * 50  # the delivery id
    with pytest.raises(WebhookRejected):
        build_verifier({"mailgun_webhook_signing_key": "other"}).verify({}, body, utcnow())


def test_forged_stale_future_and_incomplete_webhooks_are_refused_and_not_stored(
    engine: Engine,
) -> None:
    payload = fixture("failed_permanent")
    now = int(time.time())
    good = json.loads(signed(payload))
    block = good["signature"]

    def variant(**changes: Any) -> bytes:
        new_block = {k: v for k, v in {**block, **changes}.items() if v is not None}
        return json.dumps({**good, "signature": new_block}).encode()

    flipped = ("0" if block["signature"][0] != "0" else "1") + block["signature"][1:]
    cases = [
        signed(payload, key="not-the-signing-key"),
        signed(payload, timestamp=now - 301),
        signed(payload, timestamp=now + 360),  # the receiver reads its clock later
        variant(signature=flipped),
        variant(token=block["token"] + "x"),  # the token is signed
        variant(timestamp=str(int(block["timestamp"]) - 1)),  # and so is the timestamp
        variant(signature=None),
        variant(token=None),
        variant(timestamp=None),
        variant(timestamp="soon"),
        variant(signature=""),
        json.dumps(payload["event-data"]).encode(),  # no signature block at all
        json.dumps({**good, "signature": "sig"}).encode(),
        b"timestamp=1767268863&token=abc&signature=def",  # the legacy form body is not accepted
    ]
    receiver = client(engine)
    for body in cases:
        response = post(receiver, body)
        assert response.status_code == 401, (body[:120], response.text)
    assert inbox_rows(engine) == []


def test_a_wider_tolerance_can_be_configured(engine: Engine) -> None:
    body = signed(fixture("delivered"), timestamp=int(time.time()) - 1200)
    assert post(client(engine), body).status_code == 401
    wide = {**SETTINGS, "mailgun_webhook_tolerance_s": "1800"}
    assert post(client(engine, wide), body).status_code == 200


def test_parent_account_signature_is_accepted(engine: Engine) -> None:
    payload = json.loads(signed(fixture("delivered"), key="subaccount-key"))
    block = payload["signature"]
    block["parent-signature"] = sign(SIGNING_KEY, block["timestamp"], block["token"])
    response = post(client(engine), json.dumps(payload).encode())
    assert response.status_code == 200 and response.json()["status"] == "stored"


def test_missing_key_answers_503_not_an_open_door(engine: Engine) -> None:
    assert post(client(engine, {}), signed(fixture("delivered"))).status_code == 503
    assert inbox_rows(engine) == []


def test_replayed_token_is_acknowledged_and_never_stored_again(engine: Engine) -> None:
    token = secrets.token_hex(25)
    original = signed(fixture("complained"), token=token)
    receiver = client(engine)
    first = post(receiver, original)
    assert first.status_code == 200 and first.json()["status"] == "stored"
    again = post(receiver, original)
    assert again.status_code == 200 and again.json()["status"] == "duplicate"
    # The signature does not cover event-data: a captured block glued to other data is a replay.
    forged = json.loads(original)
    forged["event-data"] = fixture("unsubscribed")["event-data"]
    response = post(receiver, json.dumps(forged).encode())
    assert response.status_code == 200 and response.json()["status"] == "duplicate"
    (row,) = inbox_rows(engine)
    assert (row.delivery_id, row.body.encode()) == (token, original)
    # Mailgun retrying the same event under a new token: stored, but applied once.
    assert post(receiver, signed(fixture("complained"))).json()["status"] == "stored"
    outcome = ingest(engine)
    assert (outcome.claimed, outcome.applied, outcome.duplicates) == (2, 1, 1)
    (event,) = event_rows(engine)
    assert event.event_type == "complained"


@pytest.mark.parametrize(
    "event_data",
    [
        None,  # no event-data
        "delivered",
        {"id": "CPgfbmQMTCKtHW6uIWtuVe"},  # no event
        {"event": "delivered"},  # no id
        {"event": ["delivered"], "id": "CPgfbmQMTCKtHW6uIWtuVe"},
    ],
)
def test_authentic_but_unreadable_body_is_stored_as_malformed_and_answered_400(
    engine: Engine, event_data: object
) -> None:
    body = signed({} if event_data is None else {"event-data": event_data})
    with pytest.raises(WebhookMalformed):
        normalize(body)
    response = post(client(engine), body)
    assert response.status_code == 400
    (row,) = inbox_rows(engine)
    assert (row.status, row.body.encode()) == ("malformed", body)
    assert ingest(engine).claimed == 0
    assert event_rows(engine) == []


# --- end to end --------------------------------------------------------------------------------


def test_every_fixture_is_received_linked_applied_and_suppresses(engine: Engine) -> None:
    message_ids = {
        name: seed_sent_message(
            engine, event_id=e.event_id, recipient=e.recipient, provider_message_id=e.message_id
        )
        for name, e in EXPECTED.items()
    }
    receiver = client(engine)
    tokens = {}
    for name in EXPECTED:
        tokens[name] = secrets.token_hex(25)
        response = post(receiver, signed(fixture(name), token=tokens[name]))
        assert response.status_code == 200 and response.json()["status"] == "stored", name
    assert {row.delivery_id for row in inbox_rows(engine)} == set(tokens.values())

    outcome = ingest(engine)
    assert (outcome.claimed, outcome.applied, outcome.duplicates) == (11, 11, 0)
    assert (outcome.unlinked, outcome.malformed, outcome.suppressed) == (0, 0, 4)

    rows = {row.event_id: row for row in event_rows(engine)}
    assert len(rows) == len(EXPECTED)
    for name, expected in EXPECTED.items():
        row = rows[expected.event_id]
        assert row.provider == "mailgun"
        assert row.event_type == expected.event_type, name
        assert row.message_id == message_ids[name], name
        assert row.idempotency_key == f"{expected.event_id}:welcome"
        assert row.provider_message_id == expected.message_id
        assert row.recipient == expected.recipient
        assert row.bounce_type == expected.bounce_type
        assert row.machine_open == expected.machine_open
        assert row.click_url == expected.click_url
    with engine.connect() as connection:
        query = select(email_messages.c.event_id, email_messages.c.delivery_status)
        states = {row[0]: row[1] for row in connection.execute(query)}
        reasons = suppressions.reasons_for(connection, [e.recipient for e in EXPECTED.values()])
    assert states == {e.event_id: e.event_type for e in EXPECTED.values()}
    assert reasons == {
        "nobody@example.com": "hard_bounce",
        "bounced.before@example.com": "hard_bounce",
        "erin@example.com": "complaint",
        "frank@example.com": "unsubscribe",
    }
    assert ingest(engine).claimed == 0
