"""Mailgun: an HMAC signature block inside the JSON body (covering timestamp and token, not the
event data) and its documented ``event-data``, one fixture per event and failure kind."""

import json
import secrets
import time
from datetime import UTC, datetime
from typing import Any

from email_platform.webhooks import registry
from email_platform.webhooks.mailgun import sign
from tests.webhook_support import FIXTURE_ROOT, Expected, Ids, Request, Signer, derived_id, rewrite

FIXTURES = FIXTURE_ROOT / "mailgun"
SIGNING_KEY = "mailgun-webhook-signing-key-for-tests"
SETTINGS = {"mailgun_webhook_signing_key": SIGNING_KEY}
JSON = {"content-type": "application/json"}
CHROME = (
    "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) "
    "Chrome/124.0.0.0 Safari/537.36"
)


def _ours(
    event_type: str, recipient: str, event_id: str, message_id: str, index: int, **more: Any
) -> Expected:
    """``message_id`` is message.headers.message-id, as the send adapter stores it; ``index`` the
    fixture's position in time: timestamp 1767268862.908181 + 37.25 * index."""
    at = datetime.fromtimestamp(1767268862.908181 + 37.25 * index, tz=UTC)
    return Expected(event_type, recipient, event_id, f"{event_id}:welcome", message_id, at, **more)


EXPECTED = {
    "delivered": _ours(
        "delivered",
        "alice@example.com",
        "01KDVETHD0YA739MEDZXGM30CQ",
        "20260101120102.1.5A7C3E9D2B4F6A81@mg.example.com",
        0,
        provider_event_id="u8jzPde0IgxLd6GncfBAep",
    ),
    "failed_permanent": _ours(
        "bounced",
        "nobody@example.com",
        "01KDVEWCZ8B0XJJHRVDAW3PTCH",
        "20260101120103.1.0B6F1C2D3E4A5B67@mg.example.com",
        1,
        bounce_type="hard",
        suppression="hard_bounce",
        reason="bounce: 550 5.1.1 The email account that you tried to reach does not exist.",
        provider_event_id="WJKY40uvSwMFLZDe1f8rES",
    ),
    "failed_temporary": _ours(
        "deferred",
        "overquota@example.com",
        "01KDVEY8HGPCXHB6SEE6AXGE10",
        "20260101120104.1.C1D2E3F405162738@mg.example.com",
        2,
        reason="generic: 452 4.2.2 The email account that you tried to reach is over quota.",
        provider_event_id="S2G8NPRVdD53X83RZJzzzz",
    ),
    "failed_suppress_bounce": _ours(
        "bounced",
        "bounced.before@example.com",
        "01KDVF043R4ZQ293F2N98ZPAKX",
        "20260101120105.1.9A8B7C6D5E4F3021@mg.example.com",
        3,
        bounce_type="hard",
        suppression="hard_bounce",
        reason="suppress-bounce: 605 Not delivering to previously bounced address",
        provider_event_id="wXoIIXGvOoNZYW2mZp0zVZ",
    ),
    "opened": _ours(
        "opened",
        "bob@example.com",
        "01KDVF1ZP0FQPRH4H2VBBFJTAW",
        "20260101120106.1.1122334455667788@mg.example.com",
        4,
        machine_open=False,
        user_agent=CHROME,
        ip="50.56.129.169",
        provider_event_id="baZUPgHV7iB3m03nbqnsGp",
    ),
    "opened_apple_mpp": _ours(
        "opened",
        "carol@icloud.example",
        "01KDVF3V880VRS52309EXRPHWS",
        "20260101120107.1.99AABBCCDDEEFF00@mg.example.com",
        5,
        machine_open=True,  # client-info.bot == "apple"
        user_agent="Mozilla/5.0",
        ip="17.58.63.130",
        provider_event_id="BenQtYh5Xj8TPQxjq4i9Do",
    ),
    "clicked": _ours(
        "clicked",
        "dave@example.com",
        "01KDVF5PTGTWDSN9T553GP35RP",
        "20260101120108.1.0F1E2D3C4B5A6978@mg.example.com",
        6,
        click_url="https://app.example.com/welcome/start?utm_source=email",
        user_agent=CHROME,
        ip="50.56.129.169",
        provider_event_id="fM2oeq3hDavJA76rNicHTp",
    ),
    "complained": _ours(
        "complained",
        "erin@example.com",
        "01KDVF7JCR76JYYG2PRN6GTVHP",
        "20260101120109.1.A0B1C2D3E4F50617@mg.example.com",
        7,
        suppression="complaint",
        provider_event_id="lkrCaqx9vJupc94tnwlavy",
    ),
    "unsubscribed": _ours(
        "unsubscribed",
        "frank@example.com",
        "01KDVF9DZ0EGEP04MYDBV0CCS1",
        "20260101120110.1.7766554433221100@mg.example.com",
        8,
        suppression="unsubscribe",
        user_agent=CHROME,
        ip="50.56.129.169",
        provider_event_id="Ze2qpUWnoVPDF2yeE6RsXc",
    ),
    "accepted": _ours(
        "queued",
        "grace@example.com",
        "01KDVFB9H8SAS8XJN504NM1EKS",
        "20260101120111.1.ABCDEF0123456789@mg.example.com",
        9,
        provider_event_id="8FRCztUjAwyuh1vauWv1zh",
    ),
    "rejected": _ours(
        "rejected",
        "heidi@example.com",  # from the To header: a rejection carries no recipient
        "01KDVFD53GGRV09DP12Q95QZJN",
        "20260101120112.1.0123456789ABCDEF@mg.example.com",
        10,
        reason="Sandbox subdomains are for test purposes only.",
        provider_event_id="hkPkenG5ZFJoC6vWCBiJmp",
    ),
}
TEMPLATES = {
    "delivered": "delivered",
    "opened": "opened",
    "clicked": "clicked",
    "bounced": "failed_permanent",
    "complained": "complained",
    "deferred": "failed_temporary",
    "unsubscribed": "unsubscribed",
}


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def signed(
    payload: dict[str, Any],
    *,
    key: str = SIGNING_KEY,
    timestamp: int | None = None,
    token: str | None = None,
) -> bytes:
    """``payload`` with a fresh signature block, exactly as Mailgun computes it."""
    timestamp_text = str(int(time.time()) if timestamp is None else timestamp)
    token = token or secrets.token_hex(25)  # Mailgun's tokens are 50 characters
    block = {
        "timestamp": timestamp_text,
        "token": token,
        "signature": sign(key, timestamp_text, token),
    }
    return json.dumps({**payload, "signature": block}).encode()


def build(name: str, ids: Ids) -> bytes:
    payload = json.loads(rewrite(json.dumps(fixture(name)), EXPECTED[name], ids))
    payload["event-data"]["id"] = derived_id(ids, name)
    return json.dumps(payload).encode()


def _unsigned(payload: bytes) -> Request:
    document = json.loads(payload)
    document.pop("signature", None)
    return json.dumps(document).encode(), JSON


SIGNER = Signer(
    name="mailgun",
    settings=SETTINGS,
    provider=lambda: registry.get("mailgun"),
    sign=lambda payload: (signed(json.loads(payload)), JSON),
    forge=lambda payload: (signed(json.loads(payload), key="not-the-signing-key"), JSON),
    strip=_unsigned,
    delivery_id=lambda request: json.loads(request[0])["signature"]["token"],
    dedupes_deliveries=True,
    sign_at=lambda payload, at: (signed(json.loads(payload), timestamp=at), JSON),
    window=(300, 300),
    build=build,
    templates=TEMPLATES,
    malformed=tuple(
        json.dumps(payload).encode()
        for payload in (
            {},  # no event-data
            {"event-data": "delivered"},
            {"event-data": {"id": "CPgfbmQMTCKtHW6uIWtuVe"}},  # no event
            {"event-data": {"event": "delivered"}},  # no id
            {"event-data": {"event": ["delivered"], "id": "CPgfbmQMTCKtHW6uIWtuVe"}},
        )
    ),
    kept_headers=("content-type",),
    fixtures=FIXTURES,
    expected=EXPECTED,
    raw=lambda payload: payload["event-data"],
)
