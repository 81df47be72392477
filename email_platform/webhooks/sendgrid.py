"""Twilio SendGrid Event Webhook: ECDSA-signed JSON arrays of events.

Signature (https://www.twilio.com/docs/sendgrid/for-developers/tracking-events/
getting-started-event-webhook-security-features): SendGrid signs ``timestamp + raw body`` with
ECDSA over P-256 and SHA-256, where ``timestamp`` is the exact text of the
``X-Twilio-Email-Event-Webhook-Timestamp`` header (unix seconds), and sends the base64 of the
DER-encoded signature in ``X-Twilio-Email-Event-Webhook-Signature``. The verification key
(``EMAIL_PLATFORM_SENDGRID_WEBHOOK_PUBLIC_KEY``) is the base64 DER SubjectPublicKeyInfo that
SendGrid shows under Mail Settings (a PEM block is accepted too). Timestamps more than five
minutes off are refused both ways (SendGrid documents no window; this is the Standard Webhooks
one). The delivery id is a sha256 of the signature's canonical ``(r, low-s)`` form, so an
identical replay - or one with the equivalent ``(r, n - s)`` signature - is acknowledged and not
stored again; a genuine SendGrid retry is signed afresh and its events dedupe on
``sg_event_id`` at ingestion.

Body (https://www.twilio.com/docs/sendgrid/for-developers/tracking-events/event): a JSON array
of event objects with ``event``, ``email``, ``timestamp`` (unix seconds), ``sg_event_id``,
``sg_message_id`` (``<X-Message-Id>.filter…``), per-event fields (``reason``, ``status``,
``response``, ``type``, ``bounce_classification``, ``url``, ``useragent``, ``ip``,
``sg_machine_open``) and every ``custom_args`` entry as a top-level field - which is how the
send adapter's ``event_id`` and ``idempotency_key`` come back. An array is normalized whole:
one unreadable element makes the body malformed (stored for inspection, answered 400).
"""

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from email_platform.common import config
from email_platform.common.errors import ConfigurationError
from email_platform.webhooks.errors import WebhookMalformed, WebhookRejected
from email_platform.webhooks.fields import fitting_id, stable_event_id
from email_platform.webhooks.opens import is_machine_open
from email_platform.webhooks.vocabulary import NormalizedEvent

PROVIDER = "sendgrid"
SIGNATURE_HEADER = "x-twilio-email-event-webhook-signature"
TIMESTAMP_HEADER = "x-twilio-email-event-webhook-timestamp"
TOLERANCE_S = 300
# Order of the P-256 group: (r, s) and (r, n - s) are both valid signatures of one message.
P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551

#: SendGrid ``event`` -> our vocabulary (django-anymail's mapping).
EVENT_MAP = {
    "processed": "queued",  # accepted by SendGrid, ready to be delivered
    "dropped": "rejected",  # never sent: suppressed address, invalid, spam content ...
    "deferred": "deferred",  # the receiving server asked to try later
    "delivered": "delivered",
    "bounce": "bounced",  # ``type`` "bounce" (permanent) or "blocked" (temporary)
    "open": "opened",
    "click": "clicked",
    "spamreport": "complained",
    "unsubscribe": "unsubscribed",
    "group_unsubscribe": "unsubscribed",
    "group_resubscribe": "subscribed",
}

#: ``bounce_classification`` values that mean the address itself is bad.
HARD_CLASSIFICATIONS = frozenset({"invalid address", "mailbox unavailable"})

# Column widths of email_events: a value that does not fit is not ours (ids) or is clipped.
_EVENT_ID_MAX = 26
_KEY_MAX = 255
_RECIPIENT_MAX = 320
_REASON_MAX = 255


def build_verifier(settings: Mapping[str, str]) -> "SendGridVerifier":
    key = settings.get("sendgrid_webhook_public_key")
    if not key:
        raise ConfigurationError(f"{config.PREFIX}SENDGRID_WEBHOOK_PUBLIC_KEY is not set")
    return SendGridVerifier(key)


def load_public_key(value: str) -> ec.EllipticCurvePublicKey:
    """SendGrid's verification key: base64 DER SubjectPublicKeyInfo, or PEM."""
    text = value.strip()
    try:
        if "BEGIN PUBLIC KEY" in text:
            key = serialization.load_pem_public_key(text.encode())
        else:
            der = base64.b64decode("".join(text.split()), validate=True)
            key = serialization.load_der_public_key(der)
    except (ValueError, binascii.Error) as exc:
        raise ConfigurationError(f"SendGrid webhook public key is unreadable: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ConfigurationError("SendGrid webhook public key must be an EC P-256 key")
    return key


class SendGridVerifier:
    def __init__(self, public_key: str, tolerance_s: int = TOLERANCE_S) -> None:
        self._key = load_public_key(public_key)
        self.tolerance_s = tolerance_s

    def verify(self, headers: Mapping[str, str], body: bytes, now: datetime) -> str:
        """The delivery id of an authentic, fresh post; raises ``WebhookRejected``."""
        signature_b64 = headers.get(SIGNATURE_HEADER)
        timestamp = headers.get(TIMESTAMP_HEADER)
        if not signature_b64 or not timestamp:
            raise WebhookRejected(
                "missing X-Twilio-Email-Event-Webhook-Signature or -Timestamp header"
            )
        if not timestamp.isascii() or not timestamp.isdigit():
            raise WebhookRejected("X-Twilio-Email-Event-Webhook-Timestamp is not unix seconds")
        if abs(now.timestamp() - int(timestamp)) > self.tolerance_s:
            raise WebhookRejected("webhook timestamp outside the tolerance window")
        try:
            signature = base64.b64decode(signature_b64.strip(), validate=True)
            r, s = decode_dss_signature(signature)
        except (ValueError, binascii.Error):
            raise WebhookRejected("signature is not base64 DER ECDSA") from None
        try:
            self._key.verify(signature, timestamp.encode() + body, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            raise WebhookRejected("signature does not verify") from None
        canonical = f"{r:x}:{min(s, P256_ORDER - s):x}"
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def normalize(body: bytes) -> list[NormalizedEvent]:
    try:
        payload = json.loads(body)
    except ValueError as exc:
        raise WebhookMalformed(f"not JSON: {exc}") from None
    if not isinstance(payload, list):
        raise WebhookMalformed("a SendGrid Event Webhook body is a JSON array of events")
    return [_event(item, index) for index, item in enumerate(payload)]


def _event(item: Any, index: int) -> NormalizedEvent:
    if not isinstance(item, dict) or not isinstance(item.get("event"), str):
        raise WebhookMalformed(f"element {index} is not a SendGrid event object")
    kind = item["event"]
    event_type = EVENT_MAP.get(kind, "unknown")
    occurred_at = _timestamp(item.get("timestamp"), index)
    user_agent = _text(item.get("useragent"))
    ip = _text(item.get("ip"))
    machine = None
    if event_type == "opened":
        machine = is_machine_open(
            user_agent=user_agent,
            ip=ip,
            seconds_after_delivery=None,
            provider_flag=_flag(item.get("sg_machine_open")),
        )
    reason = None
    if kind in ("dropped", "bounce"):
        reason = _text(item.get("reason")) or _text(item.get("type"))
    elif kind == "deferred":
        reason = _text(item.get("response")) or _text(item.get("reason"))
    return NormalizedEvent(
        provider=PROVIDER,
        provider_event_id=_provider_event_id(item),
        event_type=event_type,
        occurred_at=occurred_at,
        recipient=fitting_id(item.get("email"), _RECIPIENT_MAX),
        event_id=fitting_id(item.get("event_id"), _EVENT_ID_MAX),
        idempotency_key=fitting_id(item.get("idempotency_key"), _KEY_MAX),
        provider_message_id=fitting_id(message_id_of(item.get("sg_message_id")), _KEY_MAX),
        reject_reason=reason[:_REASON_MAX] if reason else None,
        bounce_type=bounce_type(item) if event_type == "bounced" else None,
        click_url=_text(item.get("url")) if event_type == "clicked" else None,
        user_agent=user_agent,
        ip=ip,
        machine_open=machine,
        raw=item,
    )


def bounce_type(item: Mapping[str, Any]) -> str:
    """``hard`` or ``soft`` for a ``bounce`` event.

    SendGrid reports a permanent refusal as ``type: "bounce"`` (and adds the address to its own
    bounce list) and a temporary one as ``type: "blocked"``. Without ``type``, the SMTP status
    class decides (5.x.x hard, 4.x.x soft), then ``bounce_classification``.
    """
    kind = str(item.get("type") or "").lower()
    if kind == "blocked":
        return "soft"
    if kind == "bounce":
        return "hard"
    status = str(item.get("status") or "").strip()
    if status.startswith("5"):
        return "hard"
    if status.startswith("4"):
        return "soft"
    classification = str(item.get("bounce_classification") or "").lower()
    return "hard" if classification in HARD_CLASSIFICATIONS else "soft"


def message_id_of(sg_message_id: Any) -> str | None:
    """The ``X-Message-Id`` the send adapter stored, from an event's ``sg_message_id``.

    Today's ids look like ``<X-Message-Id>.filterdrecv-…`` (the X-Message-Id has no dot), older
    ones like ``14c5d75ce93.dfd.64b469.filter0001.…``: cut at ``.filter`` when present, else at
    the first dot. An event SendGrid raised before it gave the message an id (a ``dropped``
    event, as received: ``filter0093p1las1.9128.5717FB8127.0``) carries only its filter's id,
    which names no message: None.
    """
    if not isinstance(sg_message_id, str) or not sg_message_id:
        return None
    if sg_message_id.startswith("filter"):
        return None
    if ".filter" in sg_message_id:
        return sg_message_id.split(".filter", 1)[0] or None
    return sg_message_id.split(".", 1)[0] or None


def _provider_event_id(item: Mapping[str, Any]) -> str:
    event_id = item.get("sg_event_id")
    if isinstance(event_id, str) and event_id and len(event_id) <= _KEY_MAX:
        return event_id
    return stable_event_id(item)


def _timestamp(value: Any, index: int) -> datetime:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WebhookMalformed(f"element {index} has no unix timestamp")
    try:
        return datetime.fromtimestamp(value, UTC)
    except (OverflowError, OSError, ValueError):
        raise WebhookMalformed(f"element {index} has an impossible timestamp") from None


def _flag(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return value.strip().lower() == "true"
    return None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
