"""Amazon SES events over Amazon SNS: SNS signatures (versions 1 and 2) made here with an RSA key
whose self-signed certificate an injected fetcher serves as if from Amazon are verified before
anything is stored; every SES event type (event publishing and legacy notifications)
normalizes to our vocabulary and links back to its ``event_id`` through the receiver and the
ingestor on SQLite and PostgreSQL; subscriptions are confirmed only when authentic; and forged,
stale, future, off-host, off-topic, incomplete and replayed deliveries change nothing
(DESIGN.md invariant 7). The string to sign is rebuilt here from the SNS documentation, not
borrowed from the module under test.
"""

import base64
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from botocore.credentials import Credentials
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID
from sqlalchemy import delete, insert, select
from starlette.testclient import TestClient

from email_platform.db.schema import (
    email_events,
    email_messages,
    email_outbox,
    suppressions,
    webhook_inbox,
)
from email_platform.errors import ConfigurationError
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.ses import SesProvider
from email_platform.store import messages
from email_platform.store import suppressions as suppression_store
from email_platform.timeutil import utcnow
from email_platform.webhooks import ses
from email_platform.webhooks.errors import WebhookMalformed, WebhookRejected
from email_platform.webhooks.ingest import WebhookIngestor
from email_platform.webhooks.receiver import create_receiver_app
from email_platform.webhooks.registry import WebhookProvider
from email_platform.webhooks.vocabulary import RANK

FIXTURES = Path(__file__).parent / "fixtures" / "webhooks" / "ses"
EVENT_ID = "01JF3W5Q8YV2N6T0R4K7M9B5ES"
KEY = f"{EVENT_ID}:welcome"
SES_MESSAGE_ID = "0100019a7c2e5b3d-5f1c9e2a-7b4d-4c8e-a1f3-6d2b8e4c9a7f-000000"
RECIPIENT = "jane@example.com"
TOPIC = "arn:aws:sns:us-east-1:123456789012:email-platform-ses-events"
OTHER_TOPIC = "arn:aws:sns:eu-west-1:123456789012:email-platform-ses-events"
SETTINGS = {"ses_webhook_topic_arns": f" {TOPIC} , {OTHER_TOPIC}"}
CERT_URL = "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-9c6465fa7f48f5cacd23014631ec1136.pem"
EXPIRED_CERT_URL = "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-expired.pem"


def _certificate(key: rsa.RSAPrivateKey, not_before: datetime, not_after: datetime) -> bytes:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sns.amazonaws.com")])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .sign(key, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM)


SIGNING_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
FORGER_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
_NOW = datetime.now(UTC)
CERT_PEM = _certificate(SIGNING_KEY, _NOW - timedelta(days=1), _NOW + timedelta(days=365))
EXPIRED_PEM = _certificate(SIGNING_KEY, _NOW - timedelta(days=400), _NOW - timedelta(days=35))

# fixture -> (event type, bounce type, suppression reason, reject reason prefix)
EXPECTED: dict[str, tuple[str, str | None, str | None, str | None]] = {
    "send": ("sent", None, None, None),
    "delivery": ("delivered", None, None, None),
    "bounce_permanent": ("bounced", "hard", "hard_bounce", "smtp; 550 5.1.1"),
    "bounce_transient": ("bounced", "soft", None, "smtp; 552 5.2.2"),
    "bounce_undetermined": ("bounced", "soft", None, "Undetermined/Undetermined"),
    "complaint": ("complained", None, "complaint", "abuse"),
    "open": ("opened", None, None, None),
    "click": ("clicked", None, None, None),
    "reject": ("rejected", None, None, "Bad content"),
    "rendering_failure": ("failed", None, None, "Attribute 'first_name'"),
    "delivery_delay": ("deferred", None, None, "smtp; 421 4.4.1"),
    "subscription": ("unsubscribed", None, "unsubscribe", None),
    "legacy_bounce": ("bounced", "hard", "hard_bounce", "smtp; 550 5.1.1"),
    "legacy_complaint": ("complained", None, "complaint", "abuse"),
    "legacy_delivery": ("delivered", None, None, None),
}
ENVELOPES = ("sns_subscription_confirmation", "sns_unsubscribe_confirmation")


class FakeAmazon:
    """Serves the signing certificates and takes subscription confirmations, counting both."""

    def __init__(self) -> None:
        self.certificates = {CERT_URL: CERT_PEM, EXPIRED_CERT_URL: EXPIRED_PEM}
        self.fetched: list[str] = []
        self.confirmed: list[str] = []
        self.fetch_error: Exception | None = None
        self.confirm_error: Exception | None = None

    def fetch(self, url: str) -> bytes:
        self.fetched.append(url)
        if self.fetch_error is not None:
            raise self.fetch_error
        if url not in self.certificates:
            raise WebhookRejected(f"{url} answered 404")
        return self.certificates[url]

    def confirm(self, url: str) -> None:
        self.confirmed.append(url)
        if self.confirm_error is not None:
            raise self.confirm_error


@pytest.fixture
def amazon() -> FakeAmazon:
    return FakeAmazon()


def _providers(amazon: FakeAmazon) -> dict[str, WebhookProvider]:
    def build(settings):  # type: ignore[no-untyped-def]
        return ses.build_verifier(settings, fetcher=amazon.fetch, confirmer=amazon.confirm)

    return {"ses": WebhookProvider("ses", build, ses.normalize)}


def _client(engine, amazon: FakeAmazon, settings=SETTINGS) -> TestClient:  # type: ignore[no-untyped-def]
    return TestClient(create_receiver_app(engine, settings=settings, providers=_providers(amazon)))


# ---- SNS, as documented ----------------------------------------------------------------------


def _iso(moment: datetime) -> str:
    return (
        moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
    )


def documented_string_to_sign(message: dict) -> bytes:
    """https://docs.aws.amazon.com/sns/latest/dg/sns-verify-signature-of-message.html"""
    if message["Type"] == "Notification":
        names = ["Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"]
    else:
        names = ["Message", "MessageId", "SubscribeURL", "Timestamp", "Token", "TopicArn", "Type"]
    return "".join(f"{n}\n{message[n]}\n" for n in names if n in message).encode()


def sign(message: dict, *, key: rsa.RSAPrivateKey = SIGNING_KEY) -> dict:
    algorithm = hashes.SHA1() if message["SignatureVersion"] == "1" else hashes.SHA256()
    signature = key.sign(documented_string_to_sign(message), padding.PKCS1v15(), algorithm)
    return {**message, "Signature": base64.b64encode(signature).decode()}


def notification(
    event: dict | str,
    *,
    at: datetime | None = None,
    version: str = "2",
    topic: str = TOPIC,
    cert_url: str = CERT_URL,
    subject: str | None = None,
    message_id: str | None = None,
    key: rsa.RSAPrivateKey = SIGNING_KEY,
) -> dict:
    message = {
        "Type": "Notification",
        "MessageId": message_id or str(uuid.uuid4()),
        "TopicArn": topic,
        "Message": event if isinstance(event, str) else json.dumps(event),
        "Timestamp": _iso(at or datetime.now(UTC)),
        "SignatureVersion": version,
        "SigningCertURL": cert_url,
        "UnsubscribeURL": (
            "https://sns.us-east-1.amazonaws.com/?Action=Unsubscribe&SubscriptionArn="
            f"{topic}:2bcfbf39-05c3-41de-beaa-fcfcc21c8f55"
        ),
    }
    if subject is not None:
        message["Subject"] = subject
    return sign(message, key=key)


def confirmation(name: str = "sns_subscription_confirmation", **changes) -> dict:  # type: ignore[no-untyped-def]
    message = json.loads((FIXTURES / f"{name}.json").read_text())
    message.update(Timestamp=_iso(datetime.now(UTC)), SigningCertURL=CERT_URL, **changes)
    return sign(message)


def sns_headers(message: dict) -> dict[str, str]:
    return {
        "Content-Type": "text/plain; charset=UTF-8",
        "User-Agent": "Amazon Simple Notification Service Agent",
        "x-amz-sns-message-type": message["Type"],
        "x-amz-sns-message-id": message["MessageId"],
        "x-amz-sns-topic-arn": message["TopicArn"],
    }


def post(client: TestClient, message: dict, headers: dict | None = None, body: bytes | None = None):  # type: ignore[no-untyped-def]
    content = json.dumps(message).encode() if body is None else body
    return client.post(
        "/webhooks/ses",
        content=content,
        headers=sns_headers(message) if headers is None else headers,
    )


def fixture_event(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


# ---- database helpers ------------------------------------------------------------------------


def _inbox(engine) -> list:  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        return list(connection.execute(select(webhook_inbox).order_by(webhook_inbox.c.inbox_id)))


def _ingest(engine, amazon: FakeAmazon, ids=None):  # type: ignore[no-untyped-def]
    if ids is None:
        ids = [row.inbox_id for row in _inbox(engine) if row.status == "pending"]
    return WebhookIngestor(engine, providers=_providers(amazon)).run(ids, run_id="ses-test")


def _sent_message(engine):  # type: ignore[no-untyped-def]
    """The outbox row and the message the fixtures are about, as the send job leaves them."""
    now = utcnow()
    with engine.begin() as connection:
        connection.execute(
            insert(email_outbox).values(
                event_id=EVENT_ID,
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
                "event_id": EVENT_ID,
                "route": "welcome",
                "template": "welcome",
                "template_version": 1,
                "lane": "transactional",
                "recipient": RECIPIENT,
                "recipient_domain": "example.com",
                "idempotency_key": KEY,
                "status": "sent",
                "created_at": now,
                "updated_at": now,
                "sent_at": now,
                "provider": "ses",
                "provider_message_id": SES_MESSAGE_ID,
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


# ---- normalization (no database) -------------------------------------------------------------


def test_every_fixture_has_an_expectation():
    assert {p.stem for p in FIXTURES.glob("*.json")} == set(EXPECTED) | set(ENVELOPES)


def _unsigned(event: dict | str) -> bytes:
    return json.dumps(
        {
            "Type": "Notification",
            "MessageId": "m-1",
            "Message": (event if isinstance(event, str) else json.dumps(event)),
            "Timestamp": "2026-11-29T14:22:30.000Z",
            "TopicArn": TOPIC,
        }
    ).encode()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_normalizes_to_the_vocabulary_with_our_ids(name):
    kind, bounce, _, reason = EXPECTED[name]
    raw = fixture_event(name)
    (event,) = ses.normalize(_unsigned(raw))
    assert event.provider == "ses" and event.event_type == kind
    assert event.event_id == EVENT_ID  # the tag, or the header where legacy has no tags
    assert event.idempotency_key == KEY  # exact, from the header: the tag is sanitized
    assert event.provider_message_id == SES_MESSAGE_ID
    assert event.recipient == RECIPIENT
    assert event.bounce_type == bounce
    if reason is None:
        assert event.reject_reason is None
    else:
        assert event.reject_reason is not None and event.reject_reason.startswith(reason)
    detail = next(
        (v for k, v in raw.items() if k not in ("mail", "eventType", "notificationType")), {}
    )
    stamp = detail.get("timestamp") or raw["mail"]["timestamp"]
    assert event.occurred_at == datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    if kind in ("bounced", "complained"):
        assert event.provider_event_id == detail["feedbackId"]
    else:
        assert event.provider_event_id.startswith("sha256:")
    assert event.click_url == (detail.get("link") if kind == "clicked" else None)
    if kind in ("opened", "clicked"):
        assert event.user_agent == detail["userAgent"] and event.ip == detail["ipAddress"]
    assert event.machine_open is (False if kind == "opened" else None)
    assert event.raw == raw


def test_the_same_ses_event_in_another_sns_message_has_the_same_id():
    first = ses.normalize(_unsigned(fixture_event("open")))[0]
    again = json.loads(_unsigned(fixture_event("open")))
    again.update(MessageId="m-2", Timestamp="2026-11-29T15:00:00.000Z", TopicArn=OTHER_TOPIC)
    second = ses.normalize(json.dumps(again).encode())[0]
    assert first.provider_event_id == second.provider_event_id


def test_machine_opens_and_per_recipient_fan_out():
    apple = fixture_event("open")
    apple["open"].update(ipAddress="17.58.101.4", userAgent="Mozilla/5.0")
    assert ses.normalize(_unsigned(apple))[0].machine_open is True
    scanner = fixture_event("open")
    scanner["open"]["timestamp"] = "2026-11-29T14:22:21.000Z"  # 3 s after sending
    scanner["open"]["userAgent"] = ""
    assert ses.normalize(_unsigned(scanner))[0].machine_open is True

    bounce = fixture_event("bounce_permanent")
    bounce["bounce"]["bouncedRecipients"].append(
        {"emailAddress": "john@example.com", "diagnosticCode": "smtp; 550 5.1.10 no such user"}
    )
    jane, john = ses.normalize(_unsigned(bounce))
    assert (jane.recipient, john.recipient) == (RECIPIENT, "john@example.com")
    assert john.reject_reason == "smtp; 550 5.1.10 no such user"
    ids = {jane.provider_event_id, john.provider_event_id}
    assert len(ids) == 2 and bounce["bounce"]["feedbackId"] not in ids
    assert ids == {e.provider_event_id for e in ses.normalize(_unsigned(bounce))}  # stable


def test_complaint_and_subscription_variants():
    not_spam = fixture_event("complaint")
    not_spam["complaint"]["complaintFeedbackType"] = "not-spam"
    (event,) = ses.normalize(_unsigned(not_spam))
    assert event.event_type == "unknown" and event.suppression_reason is None

    def subscription(new: dict, old: dict) -> str:
        raw = fixture_event("subscription")
        raw["subscription"].update(newTopicPreferences=new, oldTopicPreferences=old)
        return ses.normalize(_unsigned(raw))[0].event_type

    def topic(status: str) -> dict:
        return {"topicName": "news", "subscriptionStatus": status}

    opted_in = {"unsubscribeAll": False, "topicSubscriptionStatus": [topic("OptIn")]}
    opted_out = {"unsubscribeAll": False, "topicSubscriptionStatus": [topic("OptOut")]}
    assert subscription(opted_out, opted_in) == "unsubscribed"
    assert subscription(opted_in, opted_out) == "subscribed"
    assert subscription({"unsubscribeAll": True}, opted_in) == "unsubscribed"


def test_setup_messages_carry_no_events_and_unreadable_ones_are_malformed():
    assert (
        ses.normalize(
            _unsigned("Successfully validated SNS topic for Amazon SES event publishing.")
        )
        == []
    )
    succeeded = {"notificationType": "AmazonSnsSubscriptionSucceeded", "message": "ok"}
    assert ses.normalize(_unsigned(succeeded)) == []
    for name in ENVELOPES:
        assert ses.normalize((FIXTURES / f"{name}.json").read_bytes()) == []
    for body in (
        b"{not json",
        b"[]",
        b'{"Type": "Nonsense"}',
        _unsigned("hello, not JSON"),
        _unsigned({"eventType": "Bounce"}),  # no mail object
        _unsigned({"mail": {"messageId": "x"}}),  # no type
        _unsigned({"eventType": "Send", "mail": {"messageId": "x"}, "send": {}}).replace(
            b"2026-11-29T14:22:30.000Z", b"yesterday"
        ),  # no readable time anywhere
    ):
        with pytest.raises(WebhookMalformed):
            ses.normalize(body)


def test_what_the_send_adapter_sends_is_what_the_normalizer_reads_back():
    email = OutgoingEmail(
        message_id=1,
        event_id=EVENT_ID,
        idempotency_key=f"{EVENT_ID}:welcome/v2",
        sender="Example <no-reply@example.com>",
        to=RECIPIENT,
        subject="Welcome",
        text="Hello",
        html=None,
        template="welcome",
        lane="transactional",
    )
    adapter = SesProvider(
        "https://email.us-east-1.amazonaws.com",
        region="us-east-1",
        credentials=Credentials("AKIDEXAMPLE", "secret"),
    )
    try:
        request = adapter.body(email)
        accepted = adapter.accepted(httpx.Response(200, json={"MessageId": SES_MESSAGE_ID}))
    finally:
        adapter.close()
    raw = fixture_event("delivery")
    # SES copies message tags into mail.tags (name -> [values]) and headers into mail.headers.
    raw["mail"]["tags"] = {t["Name"]: [t["Value"]] for t in request["EmailTags"]}
    raw["mail"]["headers"] = [
        {"name": h["Name"], "value": h["Value"]} for h in request["Content"]["Simple"]["Headers"]
    ]
    raw["mail"]["messageId"] = accepted.provider_message_id
    (event,) = ses.normalize(_unsigned(raw))
    assert (event.event_id, event.idempotency_key) == (email.event_id, email.idempotency_key)
    assert event.provider_message_id == accepted.provider_message_id
    # Without the header only the sanitized tag is left: not trusted as our key.
    raw["mail"]["headers"] = []
    (bare,) = ses.normalize(_unsigned(raw))
    assert (bare.event_id, bare.idempotency_key) == (EVENT_ID, None)


# ---- the verifier (no database) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("https://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem", True),
        ("https://sns.us-gov-west-1.amazonaws.com/SimpleNotificationService-abc.pem", True),
        ("https://sns.cn-north-1.amazonaws.com.cn/SimpleNotificationService-abc.pem", True),
        ("http://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem", False),
        ("https://sns.us-east-1.amazonaws.com.evil.example/x.pem", False),
        ("https://evil.example/sns.us-east-1.amazonaws.com/x.pem", False),
        ("https://sns.us-east-1.amazonaws.com@evil.example/x.pem", False),
        ("https://user@sns.us-east-1.amazonaws.com/x.pem", False),
        ("https://sns.us-east-1.amazonaws.com:8443/x.pem", False),
        ("https://evil.sns.us-east-1.amazonaws.com/x.pem", False),
        ("https://sqs.us-east-1.amazonaws.com/x.pem", False),
        ("https://sns.amazonaws.com/x.pem", False),
        ("https://SNS.us-east-1.amazonaws.com/x.pem", False),
        ("https://sns.us-east-1.amazonaws.com:x/x.pem", False),
        (None, False),
    ],
)
def test_only_amazon_sns_hosts_are_trusted(url, ok):
    assert ses.is_sns_url(url) is ok


def test_string_to_sign_follows_the_documentation():
    plain = notification(fixture_event("send"))
    titled = notification(fixture_event("send"), subject="Amazon SES Email Event Notification")
    confirm = confirmation()
    for message in (plain, titled, confirm):
        assert ses.string_to_sign(message) == documented_string_to_sign(message)
    assert b"Subject\n" not in ses.string_to_sign(plain)
    assert b"Token\n" in ses.string_to_sign(confirm)


def test_topic_allowlist_is_required_and_checked():
    for settings in ({}, {"ses_webhook_topic_arns": " , "}):
        with pytest.raises(ConfigurationError, match="TOPIC_ARNS"):
            ses.build_verifier(settings)
    with pytest.raises(ConfigurationError, match="not an SNS topic ARN"):
        ses.build_verifier({"ses_webhook_topic_arns": "email-platform-ses-events"})
    assert ses.build_verifier(SETTINGS).topic_arns == {TOPIC, OTHER_TOPIC}


def test_the_freshness_window(amazon):
    verifier = ses.build_verifier(SETTINGS, fetcher=amazon.fetch, confirmer=amazon.confirm)
    now = datetime.now(UTC)
    cases = [
        (now - timedelta(seconds=ses.MAX_AGE_S - 5), True),
        (now + timedelta(seconds=ses.MAX_SKEW_S - 5), True),
        (now - timedelta(seconds=ses.MAX_AGE_S + 5), False),
        (now + timedelta(seconds=ses.MAX_SKEW_S + 5), False),
    ]
    assert ses.MAX_AGE_S >= 3600  # SNS may retry an HTTP/S delivery for up to an hour
    for at, ok in cases:
        message = notification(fixture_event("send"), at=at)
        headers = {k.lower(): v for k, v in sns_headers(message).items()}
        body = json.dumps(message).encode()
        if ok:
            assert verifier.verify(headers, body, now) == message["MessageId"]
        else:
            with pytest.raises(WebhookRejected, match="Timestamp"):
                verifier.verify(headers, body, now)


def test_default_fetcher_refuses_redirects_and_sorts_failures(monkeypatch):
    calls: list[dict] = []

    def answer(status: int, content: bytes = b"pem"):  # type: ignore[no-untyped-def]
        def get(url: str, **kwargs):  # type: ignore[no-untyped-def]
            calls.append({"url": url, **kwargs})
            return httpx.Response(status, content=content)

        return get

    monkeypatch.setattr(ses.httpx, "get", answer(200))
    assert ses.fetch_certificate(CERT_URL) == b"pem"
    assert calls[-1]["follow_redirects"] is False and calls[-1]["timeout"] > 0
    monkeypatch.setattr(ses.httpx, "get", answer(404))
    with pytest.raises(WebhookRejected):
        ses.fetch_certificate(CERT_URL)
    for status in (301, 503):
        monkeypatch.setattr(ses.httpx, "get", answer(status))
        with pytest.raises(ses.SnsUnavailable):
            ses.confirm_subscription(CERT_URL)
    monkeypatch.setattr(ses.httpx, "get", answer(200, b"x" * (ses.MAX_CERTIFICATE_BYTES + 1)))
    with pytest.raises(WebhookRejected):
        ses.fetch_certificate(CERT_URL)

    def unreachable(url: str, **kwargs):  # type: ignore[no-untyped-def]
        raise httpx.ConnectError("no route to host")

    monkeypatch.setattr(ses.httpx, "get", unreachable)
    with pytest.raises(ses.SnsUnavailable):
        ses.fetch_certificate(CERT_URL)


# ---- end to end through the receiver and the ingestor (SQLite and PostgreSQL) -----------------


def test_every_event_links_to_its_message_and_suppresses_as_it_should(engine, amazon):
    message = _sent_message(engine)
    client = _client(engine, amazon)
    for name, (kind, bounce, suppression, reason) in EXPECTED.items():
        signed = notification(fixture_event(name), version="1" if "legacy" in name else "2")
        response = post(client, signed)
        assert response.status_code == 200 and response.json()["status"] == "stored", name
        inbox_id = response.json()["inbox_id"]
        outcome = _ingest(engine, amazon, [inbox_id])
        assert (outcome.applied, outcome.unlinked, outcome.malformed) == (1, 0, 0), name
        (row,) = _events_of(engine, inbox_id)
        assert (row.event_type, row.event_id, row.message_id) == (
            kind,
            EVENT_ID,
            message.message_id,
        ), name
        assert row.idempotency_key == KEY and row.provider_message_id == SES_MESSAGE_ID
        assert row.bounce_type == bounce
        assert (row.reject_reason or "").startswith(reason or "")
        assert _reasons(engine) == ({RECIPIENT: suppression} if suppression else {}), name
        with engine.begin() as connection:
            connection.execute(delete(suppressions))
    with engine.connect() as connection:
        final = connection.execute(
            select(email_messages.c.delivery_status).where(email_messages.c.event_id == EVENT_ID)
        ).scalar_one()
        clicked = connection.execute(
            select(email_events.c.click_url).where(email_events.c.event_type == "clicked")
        ).scalar_one()
        stored = connection.execute(select(webhook_inbox.c.delivery_id)).scalars().all()
    assert final == max((e[0] for e in EXPECTED.values()), key=lambda t: RANK[t])
    assert clicked == "https://app.example.com/welcome?utm_source=email"
    assert len(set(stored)) == len(EXPECTED)  # delivery id = SNS MessageId
    assert amazon.fetched == [CERT_URL]  # fetched once, then cached on the verifier


def test_a_replayed_delivery_is_acknowledged_and_not_stored_again(engine, amazon):
    _sent_message(engine)
    client = _client(engine, amazon)
    signed = notification(fixture_event("complaint"))
    first = post(client, signed)
    assert first.status_code == 200 and first.json()["status"] == "stored"
    again = post(client, signed)
    assert again.status_code == 200 and again.json()["status"] == "duplicate"
    (row,) = _inbox(engine)
    assert row.delivery_id == signed["MessageId"] and json.loads(row.body) == signed
    assert row.headers["x-amz-sns-topic-arn"] == TOPIC
    # The same SES event published again (another SNS message, e.g. a second topic) is stored
    # but applies nothing twice.
    other = notification(fixture_event("complaint"), topic=OTHER_TOPIC)
    assert post(client, other).json()["status"] == "stored"
    outcome = _ingest(engine, amazon)
    assert (outcome.claimed, outcome.applied, outcome.duplicates, outcome.suppressed) == (
        2,
        1,
        1,
        1,
    )


def test_forged_stale_future_incomplete_and_off_host_deliveries_are_refused_unstored(
    engine, amazon
):
    _sent_message(engine)
    client = _client(engine, amazon)
    event = fixture_event("bounce_permanent")
    now = datetime.now(UTC)
    good = notification(event)

    def without(header: str) -> dict[str, str]:
        return {k: v for k, v in sns_headers(good).items() if k != header}

    tampered = {**good, "Message": good["Message"].replace("Permanent", "Transient")}
    v1_as_sha256 = sign({**good, "SignatureVersion": "2"})
    v1_as_sha256["SignatureVersion"] = "1"
    raw_delivery = json.dumps(event).encode()  # SNS raw message delivery: no envelope at all
    fetching_cases = {
        "forged key": notification(event, key=FORGER_KEY),
        "tampered message": tampered,
        "subject added": {**good, "Subject": "hello"},
        "version mismatch": v1_as_sha256,
        "expired certificate": notification(event, cert_url=EXPIRED_CERT_URL),
        "certificate missing at Amazon": notification(
            event, cert_url=CERT_URL.replace("9c6465fa", "00000000")
        ),
    }
    silent_cases = {
        "stale": notification(event, at=now - timedelta(seconds=ses.MAX_AGE_S + 60)),
        "future": notification(event, at=now + timedelta(seconds=ses.MAX_SKEW_S + 60)),
        "version 3": {**good, "SignatureVersion": "3"},
        "no signature": {k: v for k, v in good.items() if k != "Signature"},
        "signature not base64": {**good, "Signature": "%%%"},
        "topic not allowed": notification(
            event, topic="arn:aws:sns:us-east-1:999999999999:attacker"
        ),
        "no timestamp": {k: v for k, v in good.items() if k != "Timestamp"},
    }
    for bad_url in (
        "http://sns.us-east-1.amazonaws.com/SimpleNotificationService-a.pem",
        "https://sns.us-east-1.amazonaws.com.evil.example/SimpleNotificationService-a.pem",
        "https://evil.example/sns.us-east-1.amazonaws.com/SimpleNotificationService-a.pem",
        "https://sns.us-east-1.amazonaws.com@evil.example/SimpleNotificationService-a.pem",
        "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-a.txt",
    ):
        silent_cases[bad_url] = notification(event, cert_url=bad_url)
    for case, message in {**fetching_cases, **silent_cases}.items():
        response = post(client, message)
        assert response.status_code == 401, (case, response.text)
    header_cases = {
        "no type header": without("x-amz-sns-message-type"),
        "no id header": without("x-amz-sns-message-id"),
        "no topic header": without("x-amz-sns-topic-arn"),
        "type header differs": {**sns_headers(good), "x-amz-sns-message-type": "Notification2"},
        "id header differs": {**sns_headers(good), "x-amz-sns-message-id": str(uuid.uuid4())},
    }
    for case, headers in header_cases.items():
        response = post(client, good, headers=headers)
        assert response.status_code == 401, (case, response.text)
    response = post(client, good, headers=sns_headers(good), body=raw_delivery)
    assert response.status_code == 401
    assert _inbox(engine) == []
    # Nothing but the two Amazon URLs was ever fetched, and each only once (cached).
    assert sorted(amazon.fetched) == sorted(
        [CERT_URL, EXPIRED_CERT_URL, CERT_URL.replace("9c6465fa", "00000000")]
    )
    # The untouched original still goes through: the refusals were about the changes.
    assert post(client, good).status_code == 200


def test_subscription_is_confirmed_only_when_authentic(engine, amazon):
    client = _client(engine, amazon)
    good = confirmation()
    refused = {
        "forged": sign({**good}, key=FORGER_KEY),
        "subscribe url off Amazon": sign(
            {**good, "SubscribeURL": "https://evil.example/?Action=ConfirmSubscription"}
        ),
        "topic not allowed": sign({**good, "TopicArn": "arn:aws:sns:us-east-1:999999999999:x"}),
        "stale": sign(
            {**good, "Timestamp": _iso(datetime.now(UTC) - timedelta(seconds=ses.MAX_AGE_S + 60))}
        ),
        "token changed": {**good, "Token": "0" * 64},
    }
    for case, message in refused.items():
        assert post(client, message).status_code == 401, case
    assert amazon.confirmed == [] and _inbox(engine) == []

    amazon.confirm_error = httpx.ConnectError("no route to host")
    assert post(client, good).status_code == 503  # SNS retries; nothing stored meanwhile
    assert _inbox(engine) == []
    amazon.confirm_error = None
    response = post(client, good)
    assert response.status_code == 200 and response.json()["status"] == "stored"
    assert post(client, good).json()["status"] == "duplicate"
    assert amazon.confirmed == [good["SubscribeURL"]] * 2  # the failed try, then the one
    outcome = _ingest(engine, amazon)
    assert (outcome.claimed, outcome.applied, outcome.malformed) == (1, 0, 0)


def test_unsubscribe_confirmation_is_stored_without_confirming(engine, amazon):
    client = _client(engine, amazon)
    message = confirmation("sns_unsubscribe_confirmation")
    response = post(client, message)
    assert response.status_code == 200 and response.json()["status"] == "stored"
    assert amazon.confirmed == []
    assert _ingest(engine, amazon).applied == 0


def test_amazon_unreachable_answers_503_so_sns_retries(engine, amazon):
    client = _client(engine, amazon)
    amazon.fetch_error = httpx.ConnectError("no route to host")
    message = notification(fixture_event("delivery"))
    assert post(client, message).status_code == 503
    assert _inbox(engine) == []
    amazon.fetch_error = None
    assert post(client, message).status_code == 200  # the retry goes through


def test_authentic_but_unreadable_is_stored_malformed_and_setup_notices_are_kept(engine, amazon):
    client = _client(engine, amazon)
    response = post(client, notification("this is not an SES event"))
    assert response.status_code == 400
    setup = notification("Successfully validated SNS topic for Amazon SES event publishing.")
    assert post(client, setup).status_code == 200
    malformed, kept = _inbox(engine)
    assert malformed.status == "malformed" and "SES event" in malformed.error
    assert kept.status == "pending"
    outcome = _ingest(engine, amazon)
    assert (outcome.claimed, outcome.applied) == (1, 0)


def test_without_a_topic_allowlist_the_receiver_answers_503_and_stores_nothing(engine, amazon):
    response = post(_client(engine, amazon, settings={}), notification(fixture_event("send")))
    assert response.status_code == 503
    assert _inbox(engine) == [] and amazon.fetched == []
