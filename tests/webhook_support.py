"""Helpers for webhook tests: sign sandbox events like the sandbox does."""

import json
import os
import time
from datetime import UTC, datetime

from email_platform.webhooks.standard import sign

SECRET = "whsec_" + "c2VjcmV0LWtleS1mb3ItdGVzdHMtb25seQ=="  # base64("secret-key-for-tests-only")
SETTINGS = {"sandbox_webhook_secret": SECRET}


def sandbox_event(
    kind: str,
    *,
    message_id: str = "sbx_1",
    to: str = "u1@example.com",
    event_id: str | None = None,
    idempotency_key: str | None = None,
    **data,
) -> dict:  # type: ignore[no-untyped-def]
    return {
        "id": "evt_" + os.urandom(8).hex(),
        "type": kind,
        "created_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "data": {
            "message_id": message_id,
            "to": to,
            "metadata": {"event_id": event_id, "idempotency_key": idempotency_key},
            **data,
        },
    }


def signed(
    event: dict,
    *,
    secret: str = SECRET,
    timestamp: int | None = None,
    webhook_id: str | None = None,
) -> tuple[bytes, dict[str, str]]:
    body = json.dumps(event).encode()
    webhook_id = webhook_id or event["id"]
    timestamp = int(time.time()) if timestamp is None else timestamp
    return body, {
        "content-type": "application/json",
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, webhook_id, timestamp, body),
    }
