"""Amazon SES events delivered by Amazon SNS over HTTPS.

Signature (https://docs.aws.amazon.com/sns/latest/dg/sns-verify-signature-of-message.html):
SNS signs a canonical string - ``Key\\nValue\\n`` for ``Message, MessageId, Subject`` (only if
present)``, Timestamp, TopicArn, Type`` of a ``Notification``, and ``Message, MessageId,
SubscribeURL, Timestamp, Token, TopicArn, Type`` of a ``SubscriptionConfirmation`` or
``UnsubscribeConfirmation`` - with RSA PKCS#1 v1.5: SHA-1 for ``SignatureVersion`` 1, SHA-256
for 2. The certificate comes from ``SigningCertURL``, which must be ``https`` on exactly
``sns.<region>.amazonaws.com`` (or ``….amazonaws.com.cn``); any other URL is refused before
anything is fetched, so a forger cannot bring his own key. TLS to that host is what vouches for
the certificate (no chain is built here); it must be valid at the time of the check.
Certificates are fetched through an injectable fetcher and cached per URL on the verifier.

Checks, all before storage: the ``x-amz-sns-message-type`` / ``-message-id`` / ``-topic-arn``
headers are present and agree with the body; ``TopicArn`` is in the allowlist
``EMAIL_PLATFORM_SES_WEBHOOK_TOPIC_ARNS`` (comma-separated, required); ``Timestamp`` is at most
``MAX_AGE_S`` = 65 minutes old (SNS retries an HTTP/S delivery for at most 3,600 s, a documented
hard limit, and a retry carries the original timestamp and signature; 5 minutes of slack on top)
and at most 5 minutes in the future. The delivery id is the SNS ``MessageId``, so a replay inside
the window is acknowledged and not stored again, and one outside it is refused. SNS "raw message
delivery" must be off: a raw body has no signature and is refused.

A ``SubscriptionConfirmation`` is confirmed after verification by GETting its ``SubscribeURL``
(also required to be on an SNS host) through an injectable confirmer; it normalizes to no
events. A certificate or confirmation that cannot be fetched for a transient reason raises
``SnsUnavailable`` (a ``WebhookUnavailable``, answered 503) so SNS, which retries only 5xx and
network failures, tries again; a 4xx from Amazon means the URL is not genuine and is a 401.

Notification ``Message`` is an SES event (configuration-set event publishing,
https://docs.aws.amazon.com/ses/latest/dg/event-publishing-retrieving-sns-contents.html):
``eventType`` Send, Reject, Bounce, Complaint, Delivery, Open, Click, Rendering Failure,
DeliveryDelay, Subscription; the legacy identity notifications
(https://docs.aws.amazon.com/ses/latest/dg/notification-contents.html) carry ``notificationType``
Bounce, Complaint, Delivery instead, and no tags. ``mail.messageId`` is the ``MessageId`` the
send adapter stored; ``mail.tags.event_id`` is our event id (a ULID, which SES tag sanitizing
leaves unchanged); the exact idempotency key is the ``X-Email-Idempotency-Key`` header in
``mail.headers`` (the tag is sanitized, so it is not used). Per-recipient events (bounce,
complaint, delivery, delay) become one normalized event per recipient.
"""

import base64
import binascii
import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import httpx
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from email_platform.common import config
from email_platform.common.errors import ConfigurationError
from email_platform.common.timeutil import as_utc
from email_platform.webhooks.errors import WebhookMalformed, WebhookRejected, WebhookUnavailable
from email_platform.webhooks.fields import fitting_id, stable_event_id
from email_platform.webhooks.opens import is_machine_open
from email_platform.webhooks.vocabulary import NormalizedEvent

log = logging.getLogger(__name__)

PROVIDER = "ses"
MAX_AGE_S = 3600 + 300
MAX_SKEW_S = 300
HTTP_TIMEOUT_S = 5.0
MAX_CERTIFICATE_BYTES = 64 * 1024
CACHE_SIZE = 32

MESSAGE_TYPES = ("Notification", "SubscriptionConfirmation", "UnsubscribeConfirmation")
NOTIFICATION_FIELDS = ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type")
CONFIRMATION_FIELDS = (
    "Message",
    "MessageId",
    "SubscribeURL",
    "Timestamp",
    "Token",
    "TopicArn",
    "Type",
)
SIGNATURE_HASHES: dict[str, Callable[[], hashes.HashAlgorithm]] = {
    "1": hashes.SHA1,
    "2": hashes.SHA256,
}
_SNS_HOST = re.compile(r"sns\.[a-z]{2}(?:-[a-z]+)+-\d{1,2}\.amazonaws\.com(?:\.cn)?")
_TOPIC_ARN = re.compile(r"arn:aws[a-z-]*:sns:[a-z0-9-]+:\d{12}:[A-Za-z0-9_.-]{1,256}")

#: SES ``eventType`` / ``notificationType`` -> our vocabulary (django-anymail's mapping).
EVENT_MAP = {
    "Send": "sent",  # SES accepted the request and will try to deliver
    "Reject": "rejected",  # SES found a virus and refused to send
    "Bounce": "bounced",  # bounceType Permanent -> hard, Transient / Undetermined -> soft
    "Complaint": "complained",
    "Delivery": "delivered",
    "Open": "opened",
    "Click": "clicked",
    "Rendering Failure": "failed",  # a template could not be rendered; nothing was sent
    "DeliveryDelay": "deferred",
    "Subscription": "unsubscribed",  # or "subscribed": see _subscription_type
}
#: The key of each event type's detail object in the event JSON.
DETAIL_KEYS = {
    "Bounce": "bounce",
    "Complaint": "complaint",
    "Delivery": "delivery",
    "Send": "send",
    "Reject": "reject",
    "Open": "open",
    "Click": "click",
    "Rendering Failure": "failure",
    "DeliveryDelay": "deliveryDelay",
    "Subscription": "subscription",
}
HARD_BOUNCE_TYPES = frozenset({"Permanent"})
#: Notifications that carry no email event.
SETUP_NOTIFICATION_TYPES = frozenset({"AmazonSnsSubscriptionSucceeded"})
SETUP_MESSAGES = frozenset({"Successfully validated SNS topic for Amazon SES event publishing."})
IDEMPOTENCY_HEADER = "x-email-idempotency-key"
EVENT_ID_HEADER = "x-email-event-id"

_EVENT_ID_MAX = 26
_KEY_MAX = 255
_RECIPIENT_MAX = 320
_REASON_MAX = 255

Fetcher = Callable[[str], bytes]
Confirmer = Callable[[str], None]


class SnsUnavailable(WebhookUnavailable):
    """Amazon could not be reached for a certificate or a confirmation: answer 503, SNS retries."""


# ---- fetching from Amazon --------------------------------------------------------------------


def is_sns_url(url: object) -> bool:
    """``https://sns.<region>.amazonaws.com[.cn]/…`` exactly: no userinfo, no other port."""
    if not isinstance(url, str):
        return False
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    return (
        parts.scheme == "https"
        and parts.netloc == parts.hostname
        and port is None
        and parts.hostname is not None
        and _SNS_HOST.fullmatch(parts.hostname) is not None
    )


def _http_get(url: str) -> httpx.Response:
    try:
        response = httpx.get(url, timeout=HTTP_TIMEOUT_S, follow_redirects=False)
    except httpx.HTTPError as exc:
        raise SnsUnavailable(f"cannot reach {url}: {exc}") from None
    if 400 <= response.status_code < 500:
        raise WebhookRejected(f"{url} answered {response.status_code}")
    if response.status_code != 200:
        raise SnsUnavailable(f"{url} answered {response.status_code}")
    return response


def fetch_certificate(url: str) -> bytes:
    """The default fetcher: the PEM at ``url`` (already checked to be an SNS URL)."""
    content = _http_get(url).content
    if len(content) > MAX_CERTIFICATE_BYTES:
        raise WebhookRejected("signing certificate is implausibly large")
    return content


def confirm_subscription(url: str) -> None:
    """The default confirmer: GET the ``SubscribeURL`` (already checked to be an SNS URL)."""
    _http_get(url)


# ---- verification ----------------------------------------------------------------------------


def build_verifier(
    settings: Mapping[str, str],
    *,
    fetcher: Fetcher | None = None,
    confirmer: Confirmer | None = None,
) -> "SnsVerifier":
    raw = settings.get("ses_webhook_topic_arns") or ""
    topics = [arn.strip() for arn in raw.split(",") if arn.strip()]
    if not topics:
        raise ConfigurationError(
            f"{config.PREFIX}SES_WEBHOOK_TOPIC_ARNS is not set: list the SNS topics SES "
            "publishes to (comma-separated ARNs)"
        )
    return SnsVerifier(topics, fetcher=fetcher, confirmer=confirmer)


def string_to_sign(message: Mapping[str, Any]) -> bytes:
    """SNS's canonical signed text of ``message``; raises ``WebhookRejected`` if incomplete."""
    kind = message.get("Type")
    names = NOTIFICATION_FIELDS if kind == "Notification" else CONFIRMATION_FIELDS
    lines: list[str] = []
    for name in names:
        value = message.get(name)
        if name == "Subject" and value is None:
            continue
        if not isinstance(value, str):
            raise WebhookRejected(f"SNS message has no {name}")
        lines.append(f"{name}\n{value}\n")
    return "".join(lines).encode("utf-8")


class SnsVerifier:
    """Verifies SNS deliveries; holds the certificate cache and the confirmations made."""

    def __init__(
        self,
        topic_arns: Iterable[str],
        *,
        fetcher: Fetcher | None = None,
        confirmer: Confirmer | None = None,
        max_age_s: int = MAX_AGE_S,
        max_skew_s: int = MAX_SKEW_S,
    ) -> None:
        self.topic_arns = frozenset(topic_arns)
        for arn in self.topic_arns:
            if not _TOPIC_ARN.fullmatch(arn):
                raise ConfigurationError(f"{arn!r} is not an SNS topic ARN")
        self._fetch = fetcher or fetch_certificate
        self._confirm = confirmer or confirm_subscription
        self.max_age_s = max_age_s
        self.max_skew_s = max_skew_s
        self._certificates: dict[str, x509.Certificate] = {}
        self._confirmed: set[str] = set()

    def verify(self, headers: Mapping[str, str], body: bytes, now: datetime) -> str:
        """The ``MessageId`` of an authentic, fresh, allowed delivery; raises otherwise."""
        try:
            message = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise WebhookRejected("not an SNS message (raw message delivery must be off)") from None
        if not isinstance(message, dict):
            raise WebhookRejected("not an SNS message")
        kind = message.get("Type")
        if kind not in MESSAGE_TYPES:
            raise WebhookRejected(f"unknown SNS message type {kind!r}")
        message_id = message.get("MessageId")
        topic = message.get("TopicArn")
        for header, expected in (
            ("x-amz-sns-message-type", kind),
            ("x-amz-sns-message-id", message_id),
            ("x-amz-sns-topic-arn", topic),
        ):
            if headers.get(header) is None:
                raise WebhookRejected(f"missing {header} header")
            if headers[header] != expected:
                raise WebhookRejected(f"{header} header does not match the body")
        if topic not in self.topic_arns:
            raise WebhookRejected(f"topic {topic!r} is not in the allowlist")
        algorithm = SIGNATURE_HASHES.get(str(message.get("SignatureVersion")))
        if algorithm is None:
            raise WebhookRejected("unsupported SignatureVersion")
        cert_url = message.get("SigningCertURL")
        if not is_sns_url(cert_url) or not str(cert_url).endswith(".pem"):
            raise WebhookRejected("SigningCertURL is not an https .pem URL on an SNS host")
        subscribe_url = message.get("SubscribeURL")
        if kind == "SubscriptionConfirmation" and not is_sns_url(subscribe_url):
            raise WebhookRejected("SubscribeURL is not an https URL on an SNS host")
        self._check_time(message.get("Timestamp"), now)
        signed = string_to_sign(message)
        try:
            signature = base64.b64decode(str(message.get("Signature") or ""), validate=True)
        except (ValueError, binascii.Error):
            raise WebhookRejected("Signature is not base64") from None
        if not signature:
            raise WebhookRejected("missing Signature")
        key = self._public_key(str(cert_url), now)
        try:
            key.verify(signature, signed, padding.PKCS1v15(), algorithm())
        except InvalidSignature:
            raise WebhookRejected("SNS signature does not verify") from None
        message_id = str(message_id)  # string_to_sign checked it is one
        if kind == "SubscriptionConfirmation" and message_id not in self._confirmed:
            self._call(self._confirm, str(subscribe_url))
            self._confirmed.add(message_id)
            log.info("confirmed the SNS subscription to %s", topic)
        elif kind == "UnsubscribeConfirmation":
            log.warning("SNS unsubscribed this endpoint from %s", topic)
        return message_id

    def _check_time(self, value: Any, now: datetime) -> None:
        sent_at = _parse_time(value)
        if sent_at is None:
            raise WebhookRejected("SNS Timestamp is missing or unreadable")
        age = (_utc(now) - sent_at).total_seconds()
        if age > self.max_age_s:
            raise WebhookRejected("SNS Timestamp is too old")
        if -age > self.max_skew_s:
            raise WebhookRejected("SNS Timestamp is in the future")

    def _public_key(self, url: str, now: datetime) -> rsa.RSAPublicKey:
        certificate = self._certificates.get(url)
        if certificate is None:
            pem = self._call(self._fetch, url)
            try:
                certificate = x509.load_pem_x509_certificate(pem)
            except (ValueError, TypeError):
                raise WebhookRejected("signing certificate is not a PEM certificate") from None
            if len(self._certificates) >= CACHE_SIZE:
                self._certificates.pop(next(iter(self._certificates)))
            self._certificates[url] = certificate
        moment = _utc(now)
        if not (certificate.not_valid_before_utc <= moment <= certificate.not_valid_after_utc):
            raise WebhookRejected("signing certificate is not valid now")
        key = certificate.public_key()
        if not isinstance(key, rsa.RSAPublicKey):
            raise WebhookRejected("signing certificate does not hold an RSA key")
        return key

    @staticmethod
    def _call(function: Callable[[str], Any], url: str) -> Any:
        try:
            return function(url)
        except (WebhookRejected, WebhookUnavailable, ConfigurationError):
            raise
        except Exception as exc:  # an injected fetcher's own failure: transient, retry later
            raise SnsUnavailable(f"{url}: {exc}") from exc


# ---- normalization ---------------------------------------------------------------------------


def normalize(body: bytes) -> list[NormalizedEvent]:
    try:
        envelope = json.loads(body)
    except ValueError as exc:
        raise WebhookMalformed(f"not JSON: {exc}") from None
    if not isinstance(envelope, dict):
        raise WebhookMalformed("not an SNS message")
    if envelope.get("Type") in ("SubscriptionConfirmation", "UnsubscribeConfirmation"):
        return []
    if envelope.get("Type") != "Notification":
        raise WebhookMalformed(f"unknown SNS message type {envelope.get('Type')!r}")
    text = envelope.get("Message")
    if isinstance(text, str) and text.strip() in SETUP_MESSAGES:
        return []
    try:
        event = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        event = None
    if not isinstance(event, dict):
        raise WebhookMalformed("SNS Message is not an SES event object")
    kind = event.get("eventType") or event.get("notificationType")
    if kind in SETUP_NOTIFICATION_TYPES:
        return []
    mail = event.get("mail")
    if not isinstance(kind, str) or not isinstance(mail, dict):
        raise WebhookMalformed("SES event has no eventType/notificationType or no mail object")
    return _events(kind, event, mail, envelope)


def _events(
    kind: str, event: dict[str, Any], mail: dict[str, Any], envelope: dict[str, Any]
) -> list[NormalizedEvent]:
    detail = event.get(DETAIL_KEYS.get(kind, ""))
    detail = detail if isinstance(detail, dict) else {}
    event_type = EVENT_MAP.get(kind, "unknown")
    if kind == "Subscription":
        event_type = _subscription_type(detail)
    if kind == "Complaint" and str(detail.get("complaintFeedbackType")).lower() == "not-spam":
        event_type = "unknown"  # the recipient said "not spam": no complaint, no suppression
    occurred_at = (
        _parse_time(detail.get("timestamp"))
        or _parse_time(mail.get("timestamp"))
        or _parse_time(envelope.get("Timestamp"))
    )
    if occurred_at is None:
        raise WebhookMalformed("SES event has no readable timestamp")
    headers = _headers(mail)
    tags = mail.get("tags") if isinstance(mail.get("tags"), dict) else {}
    event_id = fitting_id(_first(tags.get("event_id")), _EVENT_ID_MAX) or fitting_id(
        headers.get(EVENT_ID_HEADER), _EVENT_ID_MAX
    )
    user_agent = _text(detail.get("userAgent")) if kind in ("Open", "Click") else None
    ip = _text(detail.get("ipAddress"))
    machine = None
    if event_type == "opened":
        sent_at = _parse_time(mail.get("timestamp"))
        machine = is_machine_open(
            user_agent=user_agent,
            ip=ip,
            seconds_after_delivery=(occurred_at - sent_at).total_seconds() if sent_at else None,
        )
    recipients = _recipients(kind, detail, mail)
    base_id = _base_event_id(kind, detail, event)
    common: dict[str, Any] = {
        "provider": PROVIDER,
        "event_type": event_type,
        "occurred_at": occurred_at,
        "event_id": event_id,
        "idempotency_key": fitting_id(headers.get(IDEMPOTENCY_HEADER), _KEY_MAX),
        "provider_message_id": fitting_id(mail.get("messageId"), _KEY_MAX),
        "bounce_type": _bounce_type(detail) if event_type == "bounced" else None,
        "click_url": _text(detail.get("link")) if event_type == "clicked" else None,
        "user_agent": user_agent,
        "ip": ip,
        "machine_open": machine,
        "raw": event,
    }
    fan_out = len(recipients) > 1
    normalized = []
    for address, per_recipient in recipients or [(None, {})]:
        provider_event_id = base_id
        if fan_out:
            provider_event_id = "sha256:" + _sha256(f"{base_id}\n{address}")
        reason = _reject_reason(kind, detail, per_recipient)
        normalized.append(
            NormalizedEvent(
                provider_event_id=provider_event_id,
                recipient=fitting_id(address, _RECIPIENT_MAX),
                reject_reason=reason[:_REASON_MAX] if reason else None,
                **common,
            )
        )
    return normalized


def _recipients(
    kind: str, detail: Mapping[str, Any], mail: Mapping[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """``(address, per-recipient detail)`` for each recipient the event is about."""
    listed = {
        "Bounce": "bouncedRecipients",
        "Complaint": "complainedRecipients",
        "DeliveryDelay": "delayedRecipients",
    }.get(kind)
    if listed is not None and isinstance(detail.get(listed), list):
        return [
            (entry["emailAddress"], entry)
            for entry in detail[listed]
            if isinstance(entry, dict) and isinstance(entry.get("emailAddress"), str)
        ]
    if kind == "Delivery" and isinstance(detail.get("recipients"), list):
        return [(address, {}) for address in detail["recipients"] if isinstance(address, str)]
    destination = mail.get("destination")
    if isinstance(destination, list):
        return [(address, {}) for address in destination if isinstance(address, str)]
    return []


def _base_event_id(kind: str, detail: Mapping[str, Any], event: Mapping[str, Any]) -> str:
    """SES's ``feedbackId`` where it has one, else a stable hash of the canonical event JSON."""
    feedback = detail.get("feedbackId")
    if kind in ("Bounce", "Complaint") and fitting_id(feedback, _KEY_MAX):
        return str(feedback)
    return stable_event_id(event)


def _bounce_type(detail: Mapping[str, Any]) -> str:
    """``Permanent`` is hard; ``Transient`` and ``Undetermined`` are soft."""
    return "hard" if detail.get("bounceType") in HARD_BOUNCE_TYPES else "soft"


def _reject_reason(
    kind: str, detail: Mapping[str, Any], recipient: Mapping[str, Any]
) -> str | None:
    if kind == "Bounce":
        return _text(recipient.get("diagnosticCode")) or "/".join(
            str(detail[k]) for k in ("bounceType", "bounceSubType") if detail.get(k)
        )
    if kind == "DeliveryDelay":
        return _text(recipient.get("diagnosticCode")) or _text(detail.get("delayType"))
    if kind == "Complaint":
        return _text(detail.get("complaintFeedbackType")) or _text(detail.get("complaintSubType"))
    if kind == "Reject":
        return _text(detail.get("reason"))
    if kind == "Rendering Failure":
        return _text(detail.get("errorMessage"))
    return None


def _subscription_type(detail: Mapping[str, Any]) -> str:
    """A Subscription event that opts out of anything (or of all) is an unsubscribe."""
    new = detail.get("newTopicPreferences")
    old = detail.get("oldTopicPreferences")
    new = new if isinstance(new, dict) else {}
    old = old if isinstance(old, dict) else {}
    if new.get("unsubscribeAll") is True:
        return "unsubscribed"

    def opted_out(preferences: Mapping[str, Any]) -> set[str]:
        statuses = preferences.get("topicSubscriptionStatus")
        return {
            str(entry.get("topicName"))
            for entry in (statuses if isinstance(statuses, list) else [])
            if isinstance(entry, dict) and entry.get("subscriptionStatus") == "OptOut"
        }

    return "unsubscribed" if opted_out(new) - opted_out(old) else "subscribed"


def _headers(mail: Mapping[str, Any]) -> dict[str, str]:
    found: dict[str, str] = {}
    headers = mail.get("headers")
    for header in headers if isinstance(headers, list) else []:
        if isinstance(header, dict) and isinstance(header.get("name"), str):
            value = header.get("value")
            if isinstance(value, str):
                found.setdefault(header["name"].lower(), value.strip())
    return found


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        return None
    return as_utc(parsed)


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _first(value: Any) -> Any:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
