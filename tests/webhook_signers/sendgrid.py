"""SendGrid Event Webhook: ECDSA P-256 signatures with a key pair made here, and its documented
events (arrays of objects), one fixture per event type, all about one message."""

import base64
import hashlib
import json
import time
from datetime import UTC, datetime
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from email_platform.webhooks import sendgrid
from email_platform.webhooks.registry import WebhookProvider
from tests.webhook_support import FIXTURE_ROOT, Expected, Ids, Request, Signer, derived_id, rewrite

FIXTURES = FIXTURE_ROOT / "sendgrid"
EVENT_ID = "01JF3W5Q8YV2N6T0R4K7M9B1SG"
KEY = f"{EVENT_ID}:welcome"
X_MESSAGE_ID = "W86EgYT6SQKk0lRflfLRsA"
RECIPIENT = "jane@example.com"
SIGNATURE = "X-Twilio-Email-Event-Webhook-Signature"
TIMESTAMP = "X-Twilio-Email-Event-Webhook-Timestamp"

PRIVATE_KEY = ec.generate_private_key(ec.SECP256R1())
OTHER_KEY = ec.generate_private_key(ec.SECP256R1())
PUBLIC_KEY = base64.b64encode(
    PRIVATE_KEY.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
).decode()
SETTINGS = {"sendgrid_webhook_public_key": PUBLIC_KEY}
PROVIDERS = {"sendgrid": WebhookProvider("sendgrid", sendgrid.build_verifier, sendgrid.normalize)}

# fixture -> (event type, bounce type, suppression reason, reject reason prefix)
TABLE: dict[str, tuple[str, str | None, str | None, str | None]] = {
    "processed": ("queued", None, None, None),
    "dropped": ("rejected", None, None, "Bounced Address"),
    "deferred": ("deferred", None, None, "421 4.7.0"),
    "delivered": ("delivered", None, None, None),
    "bounce": ("bounced", "hard", "hard_bounce", "550 5.1.1"),
    "blocked": ("bounced", "soft", None, "421 4.7.28"),
    "open": ("opened", None, None, None),
    "open_machine": ("opened", None, None, None),
    "click": ("clicked", None, None, None),
    "spamreport": ("complained", None, "complaint", None),
    "unsubscribe": ("unsubscribed", None, "unsubscribe", None),
    "group_unsubscribe": ("unsubscribed", None, "unsubscribe", None),
    "group_resubscribe": ("subscribed", None, None, None),
}
TEMPLATES = {
    "delivered": "delivered",
    "opened": "open",
    "clicked": "click",
    "bounced": "bounce",
    "complained": "spamreport",
    "deferred": "deferred",
    "unsubscribed": "unsubscribe",
}


def fixture_bytes(name: str) -> bytes:
    return (FIXTURES / f"{name}.json").read_bytes()


def fixture_events(name: str) -> list[dict[str, Any]]:
    return json.loads(fixture_bytes(name))


def _expected(name: str) -> Expected:
    """The table's entry, with what every SendGrid event states in its own fields."""
    kind, bounce, suppression, reason = TABLE[name]
    (raw,) = fixture_events(name)
    return Expected(
        kind,
        RECIPIENT,
        EVENT_ID,
        KEY,
        X_MESSAGE_ID,
        datetime.fromtimestamp(raw["timestamp"], UTC),
        bounce_type=bounce,
        suppression=suppression,
        reason=reason,
        machine_open=raw["sg_machine_open"] if kind == "opened" else None,
        click_url=raw["url"] if kind == "clicked" else None,
        user_agent=raw.get("useragent"),
        ip=raw.get("ip"),
        provider_event_id=raw["sg_event_id"],
    )


EXPECTED = {name: _expected(name) for name in TABLE}


def sign(
    body: bytes,
    *,
    timestamp: int | str | None = None,
    key: ec.EllipticCurvePrivateKey = PRIVATE_KEY,
) -> dict[str, str]:
    """The headers SendGrid sends with ``body``: ECDSA P-256/SHA-256 over timestamp + body."""
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    signature = key.sign(stamp.encode() + body, ec.ECDSA(hashes.SHA256()))
    return {
        "Content-Type": "application/json",
        SIGNATURE: base64.b64encode(signature).decode(),
        TIMESTAMP: stamp,
    }


def delivery_id(request: Request) -> str:
    """The signature's canonical ``(r, low-s)`` form, hashed: a twin ``(r, n - s)`` is the same."""
    r, s = decode_dss_signature(base64.b64decode(request[1][SIGNATURE]))
    canonical = f"{r:x}:{min(s, sendgrid.P256_ORDER - s):x}"
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def build(name: str, ids: Ids) -> bytes:
    events = json.loads(rewrite(fixture_bytes(name).decode(), EXPECTED[name], ids))
    for index, event in enumerate(events):
        event["sg_event_id"] = derived_id(ids, f"{name}/{index}")
    return json.dumps(events).encode()


def _unsigned(payload: bytes) -> Request:
    headers = sign(payload)
    del headers[SIGNATURE]
    return payload, headers


SIGNER = Signer(
    name="sendgrid",
    settings=SETTINGS,
    provider=lambda: PROVIDERS["sendgrid"],
    sign=lambda payload: (payload, sign(payload)),
    forge=lambda payload: (payload, sign(payload, key=OTHER_KEY)),
    strip=_unsigned,
    delivery_id=delivery_id,
    dedupes_deliveries=True,
    sign_at=lambda payload, at: (payload, sign(payload, timestamp=at)),
    window=(300, 300),
    build=build,
    templates=TEMPLATES,
    malformed=(
        b"{not json",
        b'{"event": "delivered"}',  # an object, not SendGrid's array
        b'[{"event": "delivered", "email": "a@example.com"}]',  # no timestamp
        b'[{"email": "a@example.com", "timestamp": 1795962138}]',  # no event
        b'[{"event": "delivered", "timestamp": 1795962138}, 7]',  # one bad element spoils all
        b'{"event": "delivered", "email": "jane@example.com"}',
    ),
    kept_headers=(SIGNATURE.lower(), TIMESTAMP.lower()),
    fixtures=FIXTURES,
    expected=EXPECTED,
    raw=lambda events: events[0],
)
