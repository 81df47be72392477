"""Resend webhooks: Svix (Standard Webhooks) signatures, one JSON event per delivery.

Signature (https://resend.com/docs/dashboard/webhooks/verify-webhooks-requests, Svix's
https://docs.svix.com/receiving/verifying-payloads/how-manual and the Standard Webhooks spec):
headers ``svix-id``, ``svix-timestamp`` (unix seconds) and ``svix-signature`` (space-separated
``v1,<base64 HMAC-SHA256>`` over ``{svix-id}.{svix-timestamp}.{raw body}``, keyed with the
base64-decoded part of the ``whsec_…`` signing secret). The same headers named ``webhook-id``,
``webhook-timestamp`` and ``webhook-signature`` are accepted too. Verification is
``standard.StandardWebhooksVerifier`` (constant-time comparison, timestamps more than five
minutes off refused both ways); the secret is setting ``resend_webhook_secret``
(``EMAIL_PLATFORM_RESEND_WEBHOOK_SECRET``). The delivery id is the ``svix-id``: Svix keeps it
across retries of one message, so a replay or a retry of a stored delivery is acknowledged and
not stored again.

Payload (https://resend.com/docs/dashboard/webhooks/event-types):
``{"type": "email.<event>", "created_at": ISO-8601 (when the event happened), "data":
{"email_id", "created_at" (when the email was created), "from", "to": [...], "subject",
"tags": {name: value}, "bounce": {"type", "subType", "message"}, "click": {"link",
"userAgent", "ipAddress", "timestamp"}, "failed": {"reason"}, "suppressed": {"type",
"message"}}}``. The body has no event id, so ``provider_event_id`` is a sha256 of the canonical
event JSON (stable across retries, which repeat the body byte for byte).

``type`` -> vocabulary:

=======================  ============  ===============================================
Resend type              event         notes
=======================  ============  ===============================================
email.scheduled          queued
email.sent               sent
email.delivered          delivered
email.delivery_delayed   deferred
email.bounced            bounced       ``bounce.type`` Permanent -> hard; Transient and
                                       Undetermined -> soft (SES's bounce types, which
                                       Resend passes on); absent -> hard, since Resend
                                       documents email.bounced as a permanent rejection
email.complained         complained
email.opened             opened        machine opens via ``opens.is_machine_open``
email.clicked            clicked       ``click.link``, ``click.userAgent``,
                                       ``click.ipAddress``
email.failed             failed        ``failed.reason``
email.suppressed         rejected      Resend did not send: the address is on its list
                                       (so is an email.bounced whose message says
                                       "Resend has suppressed sending ...")
anything else            unknown       contact.*, domain.*, email.received, ...
=======================  ============  ===============================================

Linking back: ``data.email_id`` is the provider message id the send adapter stored (not on
``email.received``: that id names an inbound email). The adapter
(``email_platform.providers.resend``) sends ``event_id`` and ``idempotency_key`` as tags whose
values pass through ``tag_value``, which replaces every character outside ``[A-Za-z0-9_-]`` by
``_`` and cuts at 256. A tag value is therefore read back only when it is exactly recoverable -
it holds no ``_`` and is shorter than 256 - because only then is it certainly the original:
an event id (a ULID) always is; an idempotency key (``<event id>:<route>``) never is, so it is
left unset and the ingestor links by ``email_id``, then by ``event_id``.
"""

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from email.utils import parseaddr
from typing import Any

from email_platform.common import config
from email_platform.common.errors import ConfigurationError
from email_platform.common.tags import recoverable
from email_platform.common.timeutil import utcnow
from email_platform.webhooks.errors import WebhookMalformed
from email_platform.webhooks.fields import as_object, stable_event_id, stripped_text
from email_platform.webhooks.opens import is_machine_open
from email_platform.webhooks.standard import StandardWebhooksVerifier
from email_platform.webhooks.vocabulary import NormalizedEvent

PROVIDER = "resend"

EVENT_TYPES = {
    "email.scheduled": "queued",
    "email.sent": "sent",
    "email.delivered": "delivered",
    "email.delivery_delayed": "deferred",
    "email.bounced": "bounced",
    "email.complained": "complained",
    "email.opened": "opened",
    "email.clicked": "clicked",
    "email.failed": "failed",
    "email.suppressed": "rejected",
}

#: Events about mail Resend received for us (inbound), not about mail we sent.
INBOUND_TYPES = frozenset({"email.received"})

#: ``data.bounce.type`` -> hard or soft.
BOUNCE_TYPES = {"permanent": "hard", "transient": "soft", "undetermined": "soft"}

#: How Resend's ``email.bounced`` for an address on its suppression list begins its message.
SUPPRESSED_MESSAGE = "Resend has suppressed sending to this address"

_HEADER_NAMES = ("id", "timestamp", "signature")


class ResendVerifier:
    """Standard Webhooks verification under Svix's header names (or the standard ones)."""

    def __init__(self, secret: str) -> None:
        self._standard = StandardWebhooksVerifier(secret)

    def verify(self, headers: Mapping[str, str], body: bytes, now: datetime) -> str:
        """The ``svix-id`` of an authentic, fresh delivery; raises ``WebhookRejected``."""
        # One family of names, never a mix: svix-* when any of them is present.
        family = "svix" if any(f"svix-{name}" in headers for name in _HEADER_NAMES) else "webhook"
        standard = {
            f"webhook-{name}": headers[f"{family}-{name}"]
            for name in _HEADER_NAMES
            if f"{family}-{name}" in headers
        }
        return self._standard.verify(standard, body, now)


def build_verifier(settings: Mapping[str, str]) -> ResendVerifier:
    secret = settings.get("resend_webhook_secret")
    if not secret:
        raise ConfigurationError(
            f"{config.PREFIX}RESEND_WEBHOOK_SECRET (the whsec_… signing secret) is not set"
        )
    return ResendVerifier(secret)


def normalize(body: bytes) -> list[NormalizedEvent]:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WebhookMalformed(f"not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise WebhookMalformed("a Resend webhook is one JSON object")
    kind = payload.get("type")
    data = payload.get("data")
    if not isinstance(kind, str) or not kind or not isinstance(data, dict):
        raise WebhookMalformed("not a Resend webhook: needs a type and a data object")
    try:
        return [_event(payload, kind, data)]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise WebhookMalformed(f"unreadable Resend {kind} event: {exc!r}") from None


def _event(payload: dict[str, Any], kind: str, data: dict[str, Any]) -> NormalizedEvent:
    event_type = EVENT_TYPES.get(kind, "unknown")
    bounce_type = None
    reason = None
    if event_type == "bounced":
        bounce = as_object(data.get("bounce"))
        bounce_type = BOUNCE_TYPES.get(str(bounce.get("type") or "permanent").lower(), "soft")
        reason = _reason(bounce.get("type"), bounce.get("subType"), bounce.get("message"))
        if _suppressed_not_sent(bounce):
            # Resend never tried: the address was already on its suppression list. As
            # email.suppressed: rejected, not a bounce of this message.
            event_type, bounce_type = "rejected", None
    elif event_type == "failed":
        reason = _reason(None, None, as_object(data.get("failed")).get("reason"))
    elif event_type == "rejected":
        suppressed = as_object(data.get("suppressed"))
        reason = _reason(suppressed.get("type"), None, suppressed.get("message"))

    click = as_object(data.get("click"))
    opened = as_object(data.get("open"))  # not documented today; read if Resend adds it
    engagement = click or opened
    user_agent = stripped_text(engagement.get("userAgent"))
    ip = stripped_text(engagement.get("ipAddress"))
    machine = None
    if event_type == "opened":
        machine = is_machine_open(user_agent=user_agent, ip=ip, seconds_after_delivery=None)
    tags = _tags(data.get("tags"))
    return NormalizedEvent(
        provider=PROVIDER,
        provider_event_id=stable_event_id(payload),
        event_type=event_type,
        occurred_at=_time(payload.get("created_at")),
        recipient=_recipient(data.get("to")),
        event_id=recoverable(tags.get("event_id"), 26),
        idempotency_key=recoverable(tags.get("idempotency_key"), 255),
        # An inbound email's id names a message Resend received, never one we sent.
        provider_message_id=None if kind in INBOUND_TYPES else stripped_text(data.get("email_id")),
        reject_reason=reason,
        bounce_type=bounce_type,
        click_url=stripped_text(click.get("link")) if event_type == "clicked" else None,
        user_agent=user_agent,
        ip=ip,
        machine_open=machine,
        raw=payload,
    )


def _suppressed_not_sent(bounce: dict[str, Any]) -> bool:
    """An ``email.bounced`` Resend sent for an address on its own account's suppression list
    (before it had ``email.suppressed``; as received: no type, only the message "Resend has
    suppressed sending to this address ..."). SES's ``subType`` ``Suppressed`` is not this: it
    is a recent hard bounce of the address, a hard bounce here too."""
    return str(bounce.get("message") or "").startswith(SUPPRESSED_MESSAGE)


def _tags(value: object) -> dict[str, str]:
    """Webhooks carry tags as ``{name: value}``; the send API's ``[{name, value}]`` also reads."""
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return {
            str(tag["name"]): str(tag["value"])
            for tag in value
            if isinstance(tag, dict) and "name" in tag and tag.get("value") is not None
        }
    return {}


def _recipient(value: object) -> str | None:
    first = value[0] if isinstance(value, list) and value else value
    if not isinstance(first, str):
        return None
    address = parseaddr(first)[1].strip()
    return address or None


def _time(value: object) -> datetime:
    if isinstance(value, str) and value:
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return utcnow()
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    return utcnow()


def _reason(kind: object, sub_type: object, message: object) -> str | None:
    label = "/".join(p for p in (stripped_text(kind), stripped_text(sub_type)) if p)
    text = stripped_text(message)
    joined = f"{label}: {text}" if label and text else (label or text)
    return joined[:255] if joined else None
