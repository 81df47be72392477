"""Postmark: HTTP basic auth (no signature, no clock, no delivery id) and its documented records,
one fixture per record and bounce kind, with the event each must normalize to."""

import base64
import json
from datetime import UTC, datetime
from typing import Any

from email_platform.webhooks import registry
from tests.webhook_support import FIXTURE_ROOT, Expected, Ids, Request, Signer, derived_id, rewrite

FIXTURES = FIXTURE_ROOT / "postmark"
USER = "postmark-hooks"
PASSWORD = "c0rrect:horse-battery"  # a colon is legal in a basic auth password
SETTINGS = {"postmark_webhook_user": USER, "postmark_webhook_password": PASSWORD}
CHROME = (
    "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) "
    "Chrome/124.0.0.0 Safari/537.36"
)


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


def _ours(
    event_type: str, recipient: str, event_id: str, message_id: str, at: str, **more: Any
) -> Expected:
    """A record about one of our messages: ``Metadata`` carries both of our ids."""
    return Expected(
        event_type, recipient, event_id, f"{event_id}:welcome", message_id, _at(at), **more
    )


EXPECTED = {
    "delivery": _ours(
        "delivered",
        "delivered.jane@example.com",
        "01KDVDNA0097KG8C0MA99JE5Z0",
        "d602d3a6-046c-48cc-aef6-befafda49993",
        "2026-01-01T10:01:02.521345+00:00",
    ),
    "bounce_hard": _ours(
        "bounced",
        "no.such.user@example.com",
        "01KDVDQ5J8JQ4FZKV7FTV69F33",
        "865def84-d658-4841-ae08-c5f856ff4678",
        "2026-01-01T15:02:11.273539+00:00",  # sent as 10:02:11.2735393-05:00
        bounce_type="hard",
        suppression="hard_bounce",
        reason="HardBounce: smtp;550 5.1.1",
        provider_event_id="bounce:4323372036",
    ),
    "bounce_soft": _ours(
        "bounced",
        "full.mailbox@example.com",
        "01KDVDS14G10S4GG51ZB94166F",
        "d9d23414-fd8d-4d29-a235-ffc98588077d",
        "2026-01-01T15:03:40.118+00:00",
        bounce_type="soft",
        reason="SoftBounce: smtp;452 4.2.2",
        provider_event_id="bounce:4323372037",
    ),
    "bounce_transient": _ours(
        "deferred",
        "slow.server@example.net",
        "01KDVDTWPRM755Z04N4HZ9E1XZ",
        "b19ed4d9-3c6c-46ef-886e-3fa6ffbcd88a",
        "2026-01-01T15:04:05+00:00",
        reason="Transient: smtp;421 4.7.0",
        provider_event_id="bounce:4323372038",
    ),
    "bounce_spam_notification": _ours(
        "bounced",
        "filtered@example.org",
        "01KDVDWR907CFC9AW7WB02XJX9",
        "afd5697d-26dc-4f38-8b8f-95d97fe5a3b1",
        "2026-01-01T15:05:44.4+00:00",
        bounce_type="soft",  # a filter's verdict, not the recipient's complaint
        reason="SpamNotification: Your message was quarantined",
        provider_event_id="bounce:4323372039",
    ),
    "spam_complaint": _ours(
        "complained",
        "complainer@example.com",
        "01KDVDYKV8XAAHRE6FS4B4HMXP",
        "a94096d3-e1ff-475f-a5c1-5afee3eac178",
        "2026-01-01T16:20:00+00:00",
        suppression="complaint",
        reason="SpamComplaint: The subscriber explicitly marked this message as spam.",
        provider_event_id="bounce:4323372040",
    ),
    "open": _ours(
        "opened",
        "reader@example.com",
        "01KDVE0FDGJQZ18FY028FJ795G",
        "ea7498dc-ab52-45d0-9ba4-521c386ec777",
        "2026-01-01T10:15:31.712+00:00",
        machine_open=False,
        user_agent=CHROME,
        ip="188.2.95.4",
    ),
    "open_apple_privacy": _ours(
        "opened",
        "iphone.user@icloud.example",
        "01KDVE2AZREVCDD5SNMT4R9MN2",
        "81ffd14d-82f2-434e-9fee-fe1baae32dff",
        "2026-01-01T10:01:09.041+00:00",
        machine_open=True,  # bare Mozilla/5.0 from Apple's 17.0.0.0/8
        user_agent="Mozilla/5.0",
        ip="17.58.61.22",
    ),
    "click": _ours(
        "clicked",
        "clicker@example.com",
        "01KDVE46J0202W271NFJ19QQD3",
        "35073960-e957-4b72-a8f0-c2afcc980128",
        "2026-01-01T10:17:12.33+00:00",
        click_url="https://app.example.com/welcome/start?utm_source=email&utm_campaign=welcome",
        user_agent=CHROME,
        ip="188.2.95.4",
    ),
    "subscription_change_unsubscribe": _ours(
        "unsubscribed",
        "leaving@example.com",
        "01KDVE6248ND7Q7EAKGHP72V2R",
        "e6d051ba-4ddf-4286-9f40-8e345465ea5e",
        "2026-01-01T18:40:27.416071+00:00",
        suppression="unsubscribe",
        reason="ManualSuppression",
    ),
    # A reactivation: Postmark sends no MessageID and an empty Metadata, so it links to nothing.
    "subscription_change_reactivated": Expected(
        "subscribed",
        "welcome.back@example.com",
        None,
        None,
        None,
        _at("2026-01-02T09:12:03+00:00"),
    ),
}
TEMPLATES = {
    "delivered": "delivery",
    "opened": "open",
    "clicked": "click",
    "bounced": "bounce_hard",
    "complained": "spam_complaint",
    "deferred": "bounce_transient",
    "unsubscribed": "subscription_change_unsubscribe",
}


def fixture(name: str) -> bytes:
    return (FIXTURES / f"{name}.json").read_bytes()


def basic_auth(user: str = USER, password: str = PASSWORD) -> dict[str, str]:
    """The headers Postmark sends for a webhook URL ``https://<user>:<password>@host/...``."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"authorization": f"Basic {token}", "content-type": "application/json"}


def build(name: str, ids: Ids) -> bytes:
    record = json.loads(rewrite(fixture(name).decode(), EXPECTED[name], ids))
    if "ID" in record:  # bounces and complaints carry Postmark's bounce id
        record["ID"] = int(derived_id(ids, name)[:12], 16)
    return json.dumps(record).encode()


def _sign(payload: bytes) -> Request:
    return payload, basic_auth()


SIGNER = Signer(
    name="postmark",
    settings=SETTINGS,
    provider=lambda: registry.get("postmark"),
    sign=_sign,
    forge=lambda payload: (payload, basic_auth(password="wrong")),
    strip=lambda payload: (payload, {"content-type": "application/json"}),
    delivery_id=lambda request: None,  # basic auth has none
    dedupes_deliveries=False,
    sign_at=None,  # basic auth carries no timestamp
    window=(0, 0),
    build=build,
    templates=TEMPLATES,
    malformed=(
        b"{not json",
        b'["RecordType", "Bounce"]',
        b'{"MessageID": "d602d3a6-046c-48cc-aef6-befafda49993"}',  # no RecordType
        b'{"RecordType": "SubscriptionChange", "Recipient": "a@example.com",'
        b' "SuppressSending": "yes"}',
        b'{"RecordType": "Delivery", "Recipient": "a@example.com", "Metadata": "event_id=1"}',
    ),
    kept_headers=("content-type",),
    secret_headers=("authorization",),  # the password is not written to the database
    fixtures=FIXTURES,
    expected=EXPECTED,
)
