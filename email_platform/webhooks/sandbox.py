"""Sandbox provider webhooks: Standard Webhooks signatures, one event per delivery.

Body: ``{"id": "evt_…", "type": "email.<event>", "created_at": ISO-8601,
"data": {"message_id", "to", "metadata": {"event_id", "idempotency_key"}, "bounce": {"type",
"reason"}, "click": {"url"}, "user_agent", "ip", "machine": bool}}``.
"""

import json
from collections.abc import Mapping
from datetime import datetime

from email_platform.common import config
from email_platform.common.errors import ConfigurationError
from email_platform.common.timeutil import utcnow
from email_platform.webhooks.errors import WebhookMalformed
from email_platform.webhooks.opens import is_machine_open
from email_platform.webhooks.standard import StandardWebhooksVerifier
from email_platform.webhooks.vocabulary import NormalizedEvent

EVENT_MAP = {
    "email.sent": "sent",
    "email.delivered": "delivered",
    "email.delivery_delayed": "deferred",
    "email.opened": "opened",
    "email.clicked": "clicked",
    "email.bounced": "bounced",
    "email.complained": "complained",
    "email.unsubscribed": "unsubscribed",
    "email.rejected": "rejected",
}


def build_verifier(settings: Mapping[str, str]) -> StandardWebhooksVerifier:
    secret = settings.get("sandbox_webhook_secret")
    if not secret:
        raise ConfigurationError(f"{config.PREFIX}SANDBOX_WEBHOOK_SECRET is not set")
    return StandardWebhooksVerifier(secret)


def normalize(body: bytes) -> list[NormalizedEvent]:
    try:
        payload = json.loads(body)
        data = payload["data"]
        kind = payload["type"]
        event_id = str(payload["id"])
    except (ValueError, KeyError, TypeError) as exc:
        raise WebhookMalformed(f"not a sandbox webhook: {exc}") from None
    metadata = data.get("metadata") or {}
    occurred_at = _parse_time(payload.get("created_at"))
    event_type = EVENT_MAP.get(kind, "unknown")
    bounce = data.get("bounce") or {}
    machine = None
    if event_type == "opened":
        machine = is_machine_open(
            user_agent=data.get("user_agent"),
            ip=data.get("ip"),
            seconds_after_delivery=data.get("seconds_after_delivery"),
            provider_flag=data.get("machine"),
        )
    return [
        NormalizedEvent(
            provider="sandbox",
            provider_event_id=event_id,
            event_type=event_type,
            occurred_at=occurred_at,
            recipient=data.get("to"),
            event_id=metadata.get("event_id"),
            idempotency_key=metadata.get("idempotency_key"),
            provider_message_id=data.get("message_id"),
            reject_reason=bounce.get("reason"),
            bounce_type=bounce.get("type"),
            click_url=(data.get("click") or {}).get("url"),
            user_agent=data.get("user_agent"),
            ip=data.get("ip"),
            machine_open=machine,
            raw=payload,
        )
    ]


def _parse_time(value: object) -> datetime:
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            pass
    return utcnow()
