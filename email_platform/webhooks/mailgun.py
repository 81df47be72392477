"""Mailgun webhooks: a signed JSON body, one event per delivery.

Signature (https://documentation.mailgun.com/docs/mailgun/user-manual/webhooks/securing-webhooks):
the body is ``{"signature": {"timestamp", "token", "signature"}, "event-data": {...}}`` and
``signature`` is the hex HMAC-SHA256, keyed with the webhook signing key (setting
``mailgun_webhook_signing_key``, ``EMAIL_PLATFORM_MAILGUN_WEBHOOK_SIGNING_KEY``), of
``timestamp + token`` concatenated without a separator. For a subaccount's domain Mailgun adds
``parent-signature``, the same HMAC under the primary account's key; either one is accepted.
Comparisons are constant-time.

The signature covers the timestamp and the token, **not the event data**, so the two checks
Mailgun calls optional are what make it safe here:

* freshness: a timestamp more than ``TOLERANCE_S`` (300 s, or setting
  ``mailgun_webhook_tolerance_s``) from now is refused, in the past and in the future;
* single use: the token is the delivery id, so the receiver stores a token once and answers any
  later request carrying it - a replay, or a captured signature glued to other event data -
  as a duplicate that is not stored again.

Event data (https://documentation.mailgun.com/docs/mailgun/user-manual/events/): ``event``,
``id`` (the event id), ``timestamp`` (unix seconds, fractional), ``recipient``,
``message.headers.message-id`` (the provider message id; the send adapter stores Mailgun's
``<id>`` without its angle brackets, and so does this normalizer), ``user-variables`` (the
``v:`` variables: our ``event_id`` and ``idempotency_key``), ``delivery-status`` (``code``,
``message``, ``description``), ``severity`` and ``reason`` on failures, ``reject`` on
rejections, ``url`` on clicks, ``ip`` and ``client-info`` (``user-agent``, and ``bot`` -
``apple``, ``gmail`` or ``generic`` when Mailgun detected a machine open or click,
https://documentation.mailgun.com/docs/mailgun/user-manual/tracking-messages/
open-click-bot-detect) on engagement events.

``event`` -> vocabulary:

============  ===========================  ================================================
Mailgun       event                        notes
============  ===========================  ================================================
accepted      queued
rejected      rejected                     ``reject.reason`` / ``reject.description``
delivered     delivered
failed        bounced hard                 ``severity`` permanent: the address refused the
                                           mail (``reason`` bounce, suppress-bounce, ...)
failed        bounced soft                 ``severity`` permanent but not the address's
                                           fault: ``reason`` old (retries ran out),
                                           esp-block, blacklisted, greylisted
failed        rejected                     ``reason`` suppress-complaint or
                                           suppress-unsubscribe: never sent, the address
                                           is on one of Mailgun's other lists
failed        deferred                     ``severity`` temporary: Mailgun retries
opened        opened                       machine when ``client-info.bot`` is set, or by
                                           ``opens.is_machine_open``
clicked       clicked                      ``url``
complained    complained
unsubscribed  unsubscribed
other         unknown                      stored, list_member_uploaded, ...
============  ===========================  ================================================

The reject reason is ``reason: <code> <delivery-status message or description>``.
"""

import hashlib
import hmac
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from email.utils import parseaddr
from typing import Any

from email_platform.common import config
from email_platform.common.errors import ConfigurationError
from email_platform.common.timeutil import utcnow
from email_platform.webhooks.errors import WebhookMalformed, WebhookRejected
from email_platform.webhooks.fields import as_object, fitting_id, stripped_text
from email_platform.webhooks.opens import is_machine_open
from email_platform.webhooks.vocabulary import NormalizedEvent

PROVIDER = "mailgun"
TOLERANCE_S = 300

EVENT_TYPES = {
    "accepted": "queued",
    "rejected": "rejected",
    "delivered": "delivered",
    "failed": "bounced",
    "opened": "opened",
    "clicked": "clicked",
    "complained": "complained",
    "unsubscribed": "unsubscribed",
}

#: Permanent failures that say nothing bad about the address itself: a soft bounce.
SOFT_PERMANENT_REASONS = frozenset({"old", "esp-block", "espblock", "blacklisted", "greylisted"})
#: Permanent failures where Mailgun never tried: the address is on another suppression list.
NOT_SENT_REASONS = frozenset({"suppress-complaint", "suppress-unsubscribe"})


def sign(signing_key: str, timestamp: str, token: str) -> str:
    """The hex ``signature`` Mailgun sends for ``timestamp`` and ``token`` (used by tests)."""
    message = f"{timestamp}{token}".encode()
    return hmac.new(signing_key.encode("utf-8"), message, hashlib.sha256).hexdigest()


class MailgunVerifier:
    def __init__(self, signing_key: str, tolerance_s: int = TOLERANCE_S) -> None:
        self._key = signing_key
        self.tolerance_s = tolerance_s

    def verify(self, headers: Mapping[str, str], body: bytes, now: datetime) -> str:
        """The token of an authentic, fresh delivery; raises ``WebhookRejected``."""
        try:
            block = json.loads(body)["signature"]
            timestamp = block["timestamp"]
            token = block["token"]
            signatures = [block.get("signature"), block.get("parent-signature")]
        except (ValueError, UnicodeDecodeError, KeyError, TypeError):
            raise WebhookRejected("no signature block (timestamp, token, signature)") from None
        if isinstance(timestamp, bool) or not isinstance(timestamp, int | str):
            raise WebhookRejected("signature timestamp is not an integer")
        if not isinstance(token, str) or not token:
            raise WebhookRejected("signature token is missing")
        timestamp = str(timestamp)
        try:
            sent_at = int(timestamp)
        except ValueError:
            raise WebhookRejected("signature timestamp is not an integer") from None
        if abs(now.timestamp() - sent_at) > self.tolerance_s:
            raise WebhookRejected("signature timestamp outside the tolerance window")
        expected = sign(self._key, timestamp, token)
        for candidate in signatures:
            # Constant-time: the comparison time leaks nothing about the expected value.
            if isinstance(candidate, str) and hmac.compare_digest(candidate.lower(), expected):
                return token
        raise WebhookRejected("signature does not match")


def build_verifier(settings: Mapping[str, str]) -> MailgunVerifier:
    key = settings.get("mailgun_webhook_signing_key")
    if not key:
        raise ConfigurationError(f"{config.PREFIX}MAILGUN_WEBHOOK_SIGNING_KEY is not set")
    tolerance = settings.get("mailgun_webhook_tolerance_s")
    try:
        tolerance_s = int(tolerance) if tolerance else TOLERANCE_S
    except ValueError:
        raise ConfigurationError(
            f"{config.PREFIX}MAILGUN_WEBHOOK_TOLERANCE_S={tolerance!r} is not a number of seconds"
        ) from None
    return MailgunVerifier(key, tolerance_s)


def normalize(body: bytes) -> list[NormalizedEvent]:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WebhookMalformed(f"not JSON: {exc}") from None
    data = payload.get("event-data") if isinstance(payload, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("event"), str):
        raise WebhookMalformed("not a Mailgun webhook: needs an event-data object with an event")
    if not isinstance(data.get("id"), str) or not data["id"]:
        raise WebhookMalformed("Mailgun event-data has no id")
    try:
        return [_event(data)]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise WebhookMalformed(f"unreadable Mailgun {data['event']} event: {exc!r}") from None


def _event(data: dict[str, Any]) -> NormalizedEvent:
    kind = data["event"]
    event_type = EVENT_TYPES.get(kind, "unknown")
    bounce_type = None
    reason = None
    if kind == "failed":
        event_type, bounce_type = _failure(data)
        status = as_object(data.get("delivery-status"))
        detail = " ".join(
            p
            for p in (
                stripped_text(status.get("code")),
                stripped_text(status.get("message")) or stripped_text(status.get("description")),
            )
            if p
        )
        reason = _join(stripped_text(data.get("reason")), detail)
    elif kind == "rejected":
        reject = as_object(data.get("reject"))
        reason = _join(
            stripped_text(reject.get("reason")), stripped_text(reject.get("description"))
        )

    message = as_object(data.get("message"))
    headers = as_object(message.get("headers"))
    message_id = stripped_text(headers.get("message-id"))
    if message_id:
        message_id = message_id.removeprefix("<").removesuffix(">")
    variables = as_object(data.get("user-variables"))
    client = as_object(data.get("client-info"))
    user_agent = stripped_text(client.get("user-agent"))
    ip = stripped_text(data.get("ip"))
    machine = None
    if event_type == "opened":
        machine = is_machine_open(
            user_agent=user_agent,
            ip=ip,
            seconds_after_delivery=None,
            provider_flag=bool(stripped_text(client.get("bot"))),
        )
    return NormalizedEvent(
        provider=PROVIDER,
        provider_event_id=data["id"],
        event_type=event_type,
        occurred_at=_time(data.get("timestamp")),
        # Rejections may carry no recipient; the message's To header still names it.
        recipient=stripped_text(data.get("recipient")) or _address(headers.get("to")),
        event_id=_our_id(variables.get("event_id"), 26),
        idempotency_key=_our_id(variables.get("idempotency_key"), 255),
        provider_message_id=message_id,
        reject_reason=reason[:255] if reason else None,
        bounce_type=bounce_type,
        click_url=stripped_text(data.get("url")) if event_type == "clicked" else None,
        user_agent=user_agent,
        ip=ip,
        machine_open=machine,
        raw=data,
    )


def _failure(data: dict[str, Any]) -> tuple[str, str | None]:
    severity = str(data.get("severity") or "").lower()
    reason = str(data.get("reason") or "").lower()
    if severity == "temporary":
        return "deferred", None
    if reason in NOT_SENT_REASONS:
        return "rejected", None
    if reason in SOFT_PERMANENT_REASONS:
        return "bounced", "soft"
    if severity == "permanent":
        return "bounced", "hard"
    # No severity at all: a failure, but not proof that the address is dead.
    return "bounced", "soft"


def _our_id(value: object, max_length: int) -> str | None:
    """An id we sent as a ``v:`` variable; anything else there is not ours."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    return fitting_id(value, max_length)


def _time(value: object) -> datetime:
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(float(value), tz=UTC)
        except (ValueError, OverflowError, OSError):
            pass
    return utcnow()


def _address(value: object) -> str | None:
    return stripped_text(parseaddr(value)[1]) if isinstance(value, str) else None


def _join(label: str | None, detail: str | None) -> str | None:
    return f"{label}: {detail}" if label and detail else (label or detail)
