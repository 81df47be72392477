"""Postmark webhooks: HTTP basic auth, one JSON object per delivery, ``RecordType`` says what.

Authentication (https://postmarkapp.com/developer/webhooks/webhooks-overview, "Protecting your
webhook"): Postmark does **not** sign webhooks. The documented protection is HTTP basic auth
put in the webhook URL configured in Postmark (``https://<user>:<password>@host/webhooks/
postmark``) - settings ``postmark_webhook_user`` and ``postmark_webhook_password``
(``EMAIL_PLATFORM_POSTMARK_WEBHOOK_USER`` / ``_PASSWORD``), both required - plus, optionally,
Postmark's published source IPs at the firewall. Both credentials are compared in constant
time. Basic auth carries no timestamp and no delivery id, so there is **no freshness check and
no replay protection at the receiver**: ``verify`` returns ``None`` and a replayed body is
stored again. Replays are neutralised at ingestion instead, where ``email_events`` is unique on
``provider_event_id``: the bounce ``ID`` for bounces and spam complaints, otherwise a stable
sha256 of the canonical event JSON (Postmark gives Delivery, Open, Click and SubscriptionChange
records no id of their own).

Payloads (https://postmarkapp.com/developer/webhooks/ - delivery, bounce, spam complaint, open
tracking, click, subscription change webhooks): ``RecordType`` is ``Delivery`` (``DeliveredAt``,
``Recipient``, ``Details``), ``Bounce`` (``ID``, ``Type``, ``TypeCode``, ``Email``,
``BouncedAt``, ``Description``, ``Details``), ``SpamComplaint`` (the bounce shape), ``Open``
(``ReceivedAt``, ``Recipient``, ``FirstOpen``, ``Platform``, ``UserAgent``, ``Client``, ``OS``,
``Geo.IP``), ``Click`` (the open shape plus ``OriginalLink`` and ``ClickLocation``) and
``SubscriptionChange`` (``ChangedAt``, ``Recipient``, ``Origin``, ``SuppressSending``,
``SuppressionReason``). Every record carries ``MessageID`` (the provider message id the send
adapter stored; null for manual suppressions and reactivations), ``Tag``, ``MessageStream``
and ``Metadata`` - where ``email_platform.providers.postmark`` puts ``event_id`` and
``idempotency_key``. Timestamps are ISO 8601 with up to seven fractional digits.

Bounce ``Type`` -> vocabulary (Postmark's bounce type table, https://postmarkapp.com/developer/
api/bounce-api#bounce-types); hard means "this address will not take mail", which is what
suppresses it:

=======================  ======  ==============  ==========================================
Type                     Code    event           why
=======================  ======  ==============  ==========================================
HardBounce               1       bounced hard    unknown user, mailbox not found
Transient                2       deferred        "message delayed", Postmark still trying
Unsubscribe              16      unsubscribed    an unsubscribe request by reply
Subscribe                32      subscribed
AutoResponder            64      autoresponded   out of office
AddressChange            128     autoresponded   "I have a new address" reply
DnsError                 256     bounced soft    a temporary DNS error
SpamNotification         512     bounced soft    a filter's verdict, not the recipient's
OpenRelayTest            1024    unknown         a test by the receiving MTA, says nothing
Unknown                  2048    bounced soft    an NDR Postmark could not classify
SoftBounce               4096    bounced soft    mailbox full, quota, account disabled
VirusNotification        8192    bounced soft    the message was flagged, not the address
ChallengeVerification    16384   autoresponded   challenge-response (Spam Arrest, ...)
BadEmailAddress          100000  bounced hard    not a valid address
SpamComplaint            100001  complained
ManuallyDeactivated      100002  rejected        deactivated by an operator in Postmark
Unconfirmed              100003  rejected        registration not confirmed
Blocked                  100006  bounced soft    ISP block (content or reputation)
SMTPApiError             100007  failed          the SMTP API refused the message
InboundError             100008  unknown         inbound processing, not our mail
DMARCPolicy              100009  bounced soft    refused under the sender's DMARC policy
TemplateRenderingFailed  100010  failed
=======================  ======  ==============  ==========================================

Other records: ``Delivery`` -> delivered, ``SpamComplaint`` -> complained, ``Open`` -> opened
(machine opens detected by ``opens.is_machine_open`` from ``UserAgent`` and ``Geo.IP``:
Postmark has no bot flag), ``Click`` -> clicked (``OriginalLink``), ``SubscriptionChange`` ->
by its ``SuppressionReason`` when ``SuppressSending`` is true - ``HardBounce`` bounced hard
(suppressed as a hard bounce), ``SpamComplaint`` complained, ``ManualSuppression`` (the
recipient's unsubscribe link, or the account's block with ``Origin`` Customer/Admin)
unsubscribed - and subscribed when false (a reactivation,
https://postmarkapp.com/developer/webhooks/subscription-change-webhook).
An unknown ``RecordType`` or bounce ``Type`` is ``unknown``, never an error.
"""

import base64
import binascii
import hmac
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from email_platform.common import config
from email_platform.common.errors import ConfigurationError
from email_platform.common.timeutil import utcnow
from email_platform.webhooks.errors import WebhookMalformed, WebhookRejected
from email_platform.webhooks.fields import fitting_id, stable_event_id, stripped_text
from email_platform.webhooks.opens import is_machine_open
from email_platform.webhooks.vocabulary import NormalizedEvent

PROVIDER = "postmark"

#: ``RecordType`` -> vocabulary; bounces are refined by their ``Type`` (``BOUNCE_TYPES``).
RECORD_TYPES = {
    "Delivery": "delivered",
    "Bounce": "bounced",
    "SpamComplaint": "complained",
    "Open": "opened",
    "Click": "clicked",
    "SubscriptionChange": "unsubscribed",
}

#: Bounce ``Type`` -> (vocabulary event, bounce type); see the table in the module docstring.
BOUNCE_TYPES: dict[str, tuple[str, str | None]] = {
    "HardBounce": ("bounced", "hard"),
    "Transient": ("deferred", None),
    "Unsubscribe": ("unsubscribed", None),
    "Subscribe": ("subscribed", None),
    "AutoResponder": ("autoresponded", None),
    "AddressChange": ("autoresponded", None),
    "DnsError": ("bounced", "soft"),
    "SpamNotification": ("bounced", "soft"),
    "OpenRelayTest": ("unknown", None),
    "Unknown": ("bounced", "soft"),
    "SoftBounce": ("bounced", "soft"),
    "VirusNotification": ("bounced", "soft"),
    "ChallengeVerification": ("autoresponded", None),
    "BadEmailAddress": ("bounced", "hard"),
    "SpamComplaint": ("complained", None),
    "ManuallyDeactivated": ("rejected", None),
    "Unconfirmed": ("rejected", None),
    "Blocked": ("bounced", "soft"),
    "SMTPApiError": ("failed", None),
    "InboundError": ("unknown", None),
    "DMARCPolicy": ("bounced", "soft"),
    "TemplateRenderingFailed": ("failed", None),
}

#: ``TypeCode`` -> ``Type``, for a record that carries only the code.
TYPE_CODES = {
    1: "HardBounce",
    2: "Transient",
    16: "Unsubscribe",
    32: "Subscribe",
    64: "AutoResponder",
    128: "AddressChange",
    256: "DnsError",
    512: "SpamNotification",
    1024: "OpenRelayTest",
    2048: "Unknown",
    4096: "SoftBounce",
    8192: "VirusNotification",
    16384: "ChallengeVerification",
    100000: "BadEmailAddress",
    100001: "SpamComplaint",
    100002: "ManuallyDeactivated",
    100003: "Unconfirmed",
    100006: "Blocked",
    100007: "SMTPApiError",
    100008: "InboundError",
    100009: "DMARCPolicy",
    100010: "TemplateRenderingFailed",
}

_TIME_FIELDS = ("DeliveredAt", "BouncedAt", "ReceivedAt", "ChangedAt")


class PostmarkBasicAuthVerifier:
    """Accepts a request whose ``Authorization: Basic`` credentials are the configured ones."""

    def __init__(self, user: str, password: str) -> None:
        self._user = user.encode("utf-8")
        self._password = password.encode("utf-8")

    def verify(self, headers: Mapping[str, str], body: bytes, now: datetime) -> None:
        """``None`` (basic auth has no delivery id) or raise ``WebhookRejected``."""
        value = headers.get("authorization") or ""
        scheme, _, encoded = value.strip().partition(" ")
        if scheme.lower() != "basic" or not encoded.strip():
            raise WebhookRejected("missing basic auth credentials")
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise WebhookRejected("basic auth credentials are not base64") from None
        user, colon, password = decoded.partition(b":")
        # Both halves are always compared, each in constant time: nothing leaks which was wrong.
        user_ok = hmac.compare_digest(user, self._user)
        password_ok = hmac.compare_digest(password, self._password)
        if not (colon and user_ok and password_ok):
            raise WebhookRejected("wrong basic auth credentials")
        return None


def build_verifier(settings: Mapping[str, str]) -> PostmarkBasicAuthVerifier:
    user = settings.get("postmark_webhook_user")
    password = settings.get("postmark_webhook_password")
    if not user or not password:
        raise ConfigurationError(
            f"{config.PREFIX}POSTMARK_WEBHOOK_USER and {config.PREFIX}POSTMARK_WEBHOOK_PASSWORD "
            "must both be set (HTTP basic auth on the webhook URL configured in Postmark)"
        )
    if ":" in user:
        raise ConfigurationError(f"{config.PREFIX}POSTMARK_WEBHOOK_USER may not contain ':'")
    return PostmarkBasicAuthVerifier(user, password)


def normalize(body: bytes) -> list[NormalizedEvent]:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WebhookMalformed(f"not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise WebhookMalformed("a Postmark webhook is one JSON object")
    record_type = payload.get("RecordType")
    if not isinstance(record_type, str) or not record_type:
        raise WebhookMalformed("no RecordType: not a Postmark tracking webhook")
    try:
        return [_event(payload, record_type)]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise WebhookMalformed(f"unreadable Postmark {record_type} record: {exc!r}") from None


#: What a SubscriptionChange's ``SuppressionReason`` suppresses: an unsubscribe stops bulk
#: mail only, these stop every route (Postmark refuses mail to them on the stream anyway).
SUPPRESSION_REASONS = {"HardBounce": "hard_bounce", "SpamComplaint": "complaint"}
#: A SubscriptionChange's ``SuppressionReason`` -> (vocabulary event, bounce type); any other
#: reason (``ManualSuppression``: the recipient's unsubscribe, or the account's block) is an
#: unsubscribe.
SUBSCRIPTION_EVENTS: dict[str, tuple[str, str | None]] = {
    "HardBounce": ("bounced", "hard"),
    "SpamComplaint": ("complained", None),
}


def _suppression(reason: str | None, origin: str | None) -> str:
    """Our suppression for a SubscriptionChange that suppresses sending: a hard bounce or a
    complaint as such; a manual suppression is the recipient's unsubscribe when they made it
    (``Origin: Recipient``, Postmark's unsubscribe link), else the account's manual block."""
    if reason in SUPPRESSION_REASONS:
        return SUPPRESSION_REASONS[reason]
    if reason == "ManualSuppression" and origin in ("Customer", "Admin"):
        return "manual"
    return "unsubscribe"


def _event(payload: dict[str, Any], record_type: str) -> NormalizedEvent:
    event_type = RECORD_TYPES.get(record_type, "unknown")
    bounce_type: str | None = None
    reason: str | None = None
    suppression: str | None = None
    if record_type in ("Bounce", "SpamComplaint"):
        kind = payload.get("Type")
        if not isinstance(kind, str) or not kind:
            kind = TYPE_CODES.get(_int(payload.get("TypeCode")), "")
        if kind in BOUNCE_TYPES:
            event_type, bounce_type = BOUNCE_TYPES[kind]
        elif record_type == "Bounce":
            # A type Postmark added after this table: a bounce, but never a suppressing one.
            event_type, bounce_type = "bounced", "soft"
        reason = _reason(kind, payload.get("Details") or payload.get("Description"))
    elif record_type == "SubscriptionChange":
        suppress = payload.get("SuppressSending")
        if not isinstance(suppress, bool):
            raise ValueError("SuppressSending is not a boolean")
        reason = stripped_text(payload.get("SuppressionReason")) if suppress else None
        if suppress:
            suppression = _suppression(reason, stripped_text(payload.get("Origin")))
            # Postmark's cause is the event: a bounce-driven suppression is a hard bounce and
            # a complaint-driven one a complaint, so the funnel does not count them as opt-outs.
            event_type, bounce_type = SUBSCRIPTION_EVENTS.get(reason or "", ("unsubscribed", None))
        else:
            event_type = "subscribed"  # a reactivation: Postmark will send to it again

    metadata = payload.get("Metadata") or {}
    if not isinstance(metadata, dict):
        raise TypeError("Metadata is not an object")
    geo = payload.get("Geo") or {}
    ip = stripped_text(geo.get("IP")) if isinstance(geo, dict) else None
    user_agent = stripped_text(payload.get("UserAgent"))
    machine = None
    if event_type == "opened":
        machine = is_machine_open(user_agent=user_agent, ip=ip, seconds_after_delivery=None)
    return NormalizedEvent(
        provider=PROVIDER,
        provider_event_id=_provider_event_id(payload, record_type),
        event_type=event_type,
        occurred_at=_occurred_at(payload),
        recipient=stripped_text(payload.get("Email") or payload.get("Recipient")),
        event_id=fitting_id(metadata.get("event_id"), 26),
        idempotency_key=fitting_id(metadata.get("idempotency_key"), 255),
        provider_message_id=stripped_text(payload.get("MessageID") or payload.get("MessageId")),
        reject_reason=reason,
        bounce_type=bounce_type,
        click_url=stripped_text(payload.get("OriginalLink")) if event_type == "clicked" else None,
        user_agent=user_agent,
        ip=ip,
        machine_open=machine,
        raw=payload,
        suppression=suppression,
    )


def _provider_event_id(payload: dict[str, Any], record_type: str) -> str:
    """The bounce ``ID`` where Postmark gives one, else a hash stable across re-deliveries."""
    bounce_id = stripped_text(payload.get("ID"))
    if record_type in ("Bounce", "SpamComplaint") and bounce_id:
        # Bounces and spam complaints share Postmark's bounce id space.
        return f"bounce:{bounce_id}"
    return stable_event_id(payload)


def _occurred_at(payload: dict[str, Any]) -> datetime:
    for name in _TIME_FIELDS:
        value = payload.get(name)
        if isinstance(value, str) and value:
            try:
                parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    return utcnow()


def _reason(kind: str, detail: object) -> str | None:
    text = stripped_text(detail)
    joined = f"{kind}: {text}" if kind and text else (kind or text)
    return joined[:255] if joined else None


def _int(value: object) -> int:
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return -1
