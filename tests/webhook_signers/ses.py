"""Amazon SES over Amazon SNS: SNS signatures made here with an RSA key whose self-signed
certificate a fake Amazon serves, and every SES event type (event publishing and legacy
notifications), one fixture each, all about one message. The string to sign is rebuilt here
from the SNS documentation, not borrowed from the module under test."""

import base64
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

from email_platform.webhooks import ses
from email_platform.webhooks.errors import WebhookRejected
from email_platform.webhooks.registry import WebhookProvider
from tests.webhook_support import FIXTURE_ROOT, Expected, Ids, Request, Signer, derived_id, rewrite

FIXTURES = FIXTURE_ROOT / "ses"
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
TABLE: dict[str, tuple[str, str | None, str | None, str | None]] = {
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
TEMPLATES = {
    "delivered": "delivery",
    "opened": "open",
    "clicked": "click",
    "bounced": "bounce_permanent",
    "complained": "complaint",
    "deferred": "delivery_delay",
    "unsubscribed": "subscription",
}


def fixture_event(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _detail(event: dict[str, Any]) -> dict[str, Any]:
    """The event type's own object (``bounce``, ``open``, ...), beside ``mail``."""
    return next(
        (v for k, v in event.items() if k not in ("mail", "eventType", "notificationType")), {}
    )


def _expected(name: str) -> Expected:
    """The table's entry, with what the SES event states: the detail's time (else the mail's),
    SES's ``feedbackId`` as the event id of bounces and complaints, the agent of engagement."""
    kind, bounce, suppression, reason = TABLE[name]
    raw = fixture_event(name)
    detail = _detail(raw)
    stamp = detail.get("timestamp") or raw["mail"]["timestamp"]
    engagement = kind in ("opened", "clicked")
    return Expected(
        kind,
        RECIPIENT,
        EVENT_ID,  # the tag, or the header where legacy has no tags
        KEY,  # exact, from the header: the tag is sanitized
        SES_MESSAGE_ID,
        datetime.fromisoformat(stamp.replace("Z", "+00:00")),
        bounce_type=bounce,
        suppression=suppression,
        reason=reason,
        machine_open=False if kind == "opened" else None,
        click_url=detail.get("link") if kind == "clicked" else None,
        user_agent=detail["userAgent"] if engagement else None,
        ip=detail["ipAddress"] if engagement else None,
        provider_event_id=detail["feedbackId"] if kind in ("bounced", "complained") else None,
    )


EXPECTED = {name: _expected(name) for name in TABLE}


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


def provider(amazon: FakeAmazon | None = None) -> WebhookProvider:
    amazon = amazon or FakeAmazon()

    def build(settings):  # type: ignore[no-untyped-def]
        return ses.build_verifier(settings, fetcher=amazon.fetch, confirmer=amazon.confirm)

    return WebhookProvider("ses", build, ses.normalize)


# ---- SNS, as documented ----------------------------------------------------------------------


def iso(moment: datetime) -> str:
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
        "Timestamp": iso(at or datetime.now(UTC)),
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
    message.update(Timestamp=iso(datetime.now(UTC)), SigningCertURL=CERT_URL, **changes)
    return sign(message)


def sns_headers(message: dict) -> dict[str, str]:
    return {
        "Content-Type": "text/plain; charset=UTF-8",
        "User-Agent": "Amazon Simple Notification Service Agent",
        "x-amz-sns-message-type": message["Type"],
        "x-amz-sns-message-id": message["MessageId"],
        "x-amz-sns-topic-arn": message["TopicArn"],
    }


def request(message: dict) -> Request:
    """An SNS message as SNS posts it."""
    return json.dumps(message).encode(), sns_headers(message)


def build(name: str, ids: Ids) -> bytes:
    event = json.loads(rewrite(json.dumps(fixture_event(name)), EXPECTED[name], ids))
    detail = _detail(event)
    if "feedbackId" in detail:
        detail["feedbackId"] = derived_id(ids, name)
    return json.dumps(event).encode()


def _unsigned(payload: bytes) -> Request:
    message = notification(payload.decode())
    del message["Signature"]
    return request(message)


SIGNER = Signer(
    name="ses",
    settings=SETTINGS,
    provider=provider,
    sign=lambda payload: request(notification(payload.decode())),
    forge=lambda payload: request(notification(payload.decode(), key=FORGER_KEY)),
    strip=_unsigned,
    delivery_id=lambda posted: json.loads(posted[0])["MessageId"],
    dedupes_deliveries=True,
    sign_at=lambda payload, at: request(
        notification(payload.decode(), at=datetime.fromtimestamp(at, UTC))
    ),
    window=(ses.MAX_AGE_S, ses.MAX_SKEW_S),
    build=build,
    templates=TEMPLATES,
    malformed=(
        b"this is not an SES event",
        b"hello, not JSON",
        b'{"eventType": "Bounce"}',  # no mail object
        b'{"mail": {"messageId": "x"}}',  # no type
    ),
    kept_headers=("x-amz-sns-message-type", "x-amz-sns-message-id", "x-amz-sns-topic-arn"),
    fixtures=FIXTURES,
    expected=EXPECTED,
    not_events=ENVELOPES,
)
