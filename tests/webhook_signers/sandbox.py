"""The sandbox provider: Standard Webhooks signatures over the sandbox's own event shape."""

import json

from email_platform.webhooks import registry
from tests.webhook_support import (
    SECRET,
    SETTINGS,
    Ids,
    Request,
    Signer,
    derived_id,
    sandbox_event,
    standard_headers,
)

OTHER_SECRET = "whsec_" + "d3Jvbmcta2V5"  # base64("wrong-key")
TEMPLATES = {
    "delivered": "email.delivered",
    "opened": "email.opened",
    "clicked": "email.clicked",
    "bounced": "email.bounced",
    "complained": "email.complained",
    "deferred": "email.delivery_delayed",
    "unsubscribed": "email.unsubscribed",
}


def sign(payload: bytes, timestamp: int | None = None) -> Request:
    return payload, standard_headers(payload, SECRET, timestamp=timestamp)


def forge(payload: bytes) -> Request:
    return payload, standard_headers(payload, OTHER_SECRET)


def strip(payload: bytes) -> Request:
    _, headers = sign(payload)
    del headers["webhook-signature"]
    return payload, headers


def build(kind: str, ids: Ids) -> bytes:
    event = sandbox_event(
        kind,
        message_id=ids.provider_message_id,
        to=ids.recipient,
        event_id=ids.event_id,
        idempotency_key=ids.idempotency_key,
        bounce={"type": "hard", "reason": "550 5.1.1 unknown user"},
        click={"url": "https://app.example.com/welcome"},
    )
    event["id"] = "evt_" + derived_id(ids, kind)
    return json.dumps(event).encode()


SIGNER = Signer(
    name="sandbox",
    settings=SETTINGS,
    provider=lambda: registry.get("sandbox"),
    sign=sign,
    forge=forge,
    strip=strip,
    delivery_id=lambda request: request[1]["webhook-id"],
    dedupes_deliveries=True,
    sign_at=sign,
    window=(300, 300),
    build=build,
    templates=TEMPLATES,
    malformed=(
        b"{not json",
        b'["email.delivered"]',
        b'{"id": "evt_1", "type": "email.delivered"}',  # no data
        b'{"id": "evt_1", "data": {"to": "a@example.com"}}',  # no type
    ),
    kept_headers=("webhook-id", "webhook-timestamp", "webhook-signature"),
)
