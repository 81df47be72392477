"""Resend: Svix (Standard Webhooks) signatures and its documented ``email.*`` events, one fixture
per event and bounce kind; our ids come back only through tags sanitized by ``tag_value``, so
the idempotency key never does."""

from datetime import UTC, datetime
from typing import Any

from email_platform.webhooks import registry
from tests.webhook_support import (
    FIXTURE_ROOT,
    Expected,
    Ids,
    Request,
    Signer,
    rewrite,
    standard_headers,
)

FIXTURES = FIXTURE_ROOT / "resend"
SECRET = "whsec_" + "cmVzZW5kLXdlYmhvb2stdGVzdC1zZWNyZXQ="  # base64("resend-webhook-test-secret")
OTHER_SECRET = "whsec_" + "YW5vdGhlci1zZWNyZXQ="  # base64("another-secret")
SETTINGS = {"resend_webhook_secret": SECRET}
SAFARI = (
    "Mozilla/5.0 (Macintosh; Intel Mac OS X 10_15_7) AppleWebKit/605.1.15 (KHTML, like Gecko) "
    "Version/17.4 Safari/605.1.15"
)


def _ours(
    event_type: str, recipient: str, event_id: str, email_id: str, second: int, **more: Any
) -> Expected:
    """At 11:00:<second>.<107 + 7 * (second - 1)> on 2026-01-01: the event's ``created_at``, not
    the email's; no idempotency key: its tag went through ``tag_value``, not recoverable."""
    at = datetime(2026, 1, 1, 11, 0, second, (100 + 7 * second) * 1000, tzinfo=UTC)
    return Expected(event_type, recipient, event_id, None, email_id, at, **more)


EXPECTED = {
    "email_sent": _ours(
        "sent",
        "sent.to@example.com",
        "01KDVE7XPG7NSWPM5S6KR34Z54",
        "868c0ec2-8462-4fb4-b9e5-8730686031bc",
        1,
    ),
    "email_delivered": _ours(
        "delivered",
        "delivered@example.com",
        "01KDVE9S8R6GETSF2W06SQ7X9B",
        "1ab88614-b1c2-417f-8091-34a2f3984c0d",
        2,
    ),
    "email_delivery_delayed": _ours(
        "deferred",
        "greylisted@example.net",
        "01KDVEBMV0GQXQ5FJ9FQFBJZQZ",
        "0b1fa3d3-07d3-4a23-9f8d-23ad5221daef",
        3,
    ),
    "email_bounced_permanent": _ours(
        "bounced",
        "gone@example.com",
        "01KDVEDGD80KJQQQ8SQGJ90J1X",
        "5d7aaa28-e257-4fbd-9c5c-f4061680ede0",
        4,
        bounce_type="hard",
        suppression="hard_bounce",
        reason="Permanent/General: The recipient's email provider sent a hard bounce",
    ),
    "email_bounced_transient": _ours(
        "bounced",
        "full@example.com",
        "01KDVEFBZGGY3Z8NPYEYTNFPSM",
        "1e08aa92-0435-417c-ab18-1c33a3f91ca9",
        5,
        bounce_type="soft",
        reason="Transient/MailboxFull: The recipient's email provider sent a bounce message",
    ),
    "email_complained": _ours(
        "complained",
        "annoyed@example.com",
        "01KDVEH7HR4Q65WPKNHDKDT2HW",
        "d5a5f56c-e01a-4a5a-9cd4-e2223af64e90",
        6,
        suppression="complaint",
    ),
    "email_opened": _ours(
        "opened",
        "opener@example.com",
        "01KDVEK340J51V8YQQ4CWRBW4H",
        "f99d9087-59a2-47d6-9527-e184a0afb0c4",
        7,
        machine_open=False,
    ),
    "email_clicked": _ours(
        "clicked",
        "clicker@example.com",
        "01KDVEMYP8E3X7VB9VWDX840HA",
        "5158b631-0418-4c73-b5b1-6b90a7365e61",
        8,
        click_url="https://app.example.com/welcome/start?utm_source=email",
        user_agent=SAFARI,
        ip="122.115.53.11",
    ),
    "email_failed": _ours(
        "failed",
        "quota@example.com",
        "01KDVEPT8GAYYMM52ENBRAMYZ9",
        "89b1ad9f-12d0-47a4-9198-aaa5b688e727",
        9,
        reason="reached_daily_quota",
    ),
    "email_suppressed": _ours(
        "rejected",
        "suppressed@example.com",
        "01KDVERNTRY5RTF3MK7AYCZDN7",
        "97872725-44c1-4c5e-b59b-67d1b0da7c19",
        10,
        reason="OnAccountSuppressionList: The recipient's email address is on the suppression",
    ),
}
TEMPLATES = {
    "delivered": "email_delivered",
    "opened": "email_opened",
    "clicked": "email_clicked",
    "bounced": "email_bounced_permanent",
    "complained": "email_complained",
    "deferred": "email_delivery_delayed",
    # Resend has no unsubscribe event.
}


def fixture(name: str) -> bytes:
    return (FIXTURES / f"{name}.json").read_bytes()


def svix_signed(
    body: bytes,
    *,
    secret: str = SECRET,
    msg_id: str | None = None,
    timestamp: int | None = None,
    prefix: str = "svix",
) -> dict[str, str]:
    """The headers Svix sends with ``body`` for Resend."""
    return standard_headers(body, secret, msg_id, timestamp, prefix=prefix)


def build(name: str, ids: Ids) -> bytes:
    # No event id of Resend's own: the event's hash changes with the ids.
    return rewrite(fixture(name).decode(), EXPECTED[name], ids).encode()


def _unsigned(payload: bytes) -> Request:
    headers = svix_signed(payload)
    del headers["svix-signature"]
    return payload, headers


SIGNER = Signer(
    name="resend",
    settings=SETTINGS,
    provider=lambda: registry.get("resend"),
    sign=lambda payload: (payload, svix_signed(payload)),
    forge=lambda payload: (payload, svix_signed(payload, secret=OTHER_SECRET)),
    strip=_unsigned,
    delivery_id=lambda request: request[1]["svix-id"],
    dedupes_deliveries=True,
    sign_at=lambda payload, at: (payload, svix_signed(payload, timestamp=at)),
    window=(300, 300),
    build=build,
    templates=TEMPLATES,
    malformed=(
        b"{not json",
        b'["email.delivered"]',
        b'{"type": "email.delivered", "created_at": "2026-01-01T11:00:00Z"}',  # no data
        b'{"type": "email.delivered", "data": "email_id=1"}',
        b'{"data": {"email_id": "1"}}',  # no type
    ),
    kept_headers=("svix-id", "svix-timestamp", "svix-signature"),
    fixtures=FIXTURES,
    expected=EXPECTED,
)
