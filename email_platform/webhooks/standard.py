"""Standard Webhooks signatures (sandbox and Resend): HMAC-SHA256 over ``id.timestamp.body``.

Spec: https://www.standardwebhooks.com/ - headers ``webhook-id``, ``webhook-timestamp`` (unix
seconds) and ``webhook-signature`` (space-separated ``v1,<base64>`` entries); the secret is
``whsec_<base64 key>``. Timestamps more than five minutes off are refused both ways.
"""

import base64
import hashlib
import hmac
from collections.abc import Mapping
from datetime import datetime

from email_platform.common.errors import ConfigurationError
from email_platform.webhooks.errors import WebhookRejected

TOLERANCE_S = 300


def decode_secret(secret: str) -> bytes:
    if not secret.startswith("whsec_"):
        raise ConfigurationError("a Standard Webhooks secret looks like whsec_<base64>")
    try:
        return base64.b64decode(secret[len("whsec_") :], validate=True)
    except ValueError as exc:
        raise ConfigurationError(f"webhook secret is not valid base64: {exc}") from None


def sign(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value for ``body`` (used by the sandbox and by tests)."""
    content = f"{webhook_id}.{timestamp}.".encode() + body
    digest = hmac.new(decode_secret(secret), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


class StandardWebhooksVerifier:
    def __init__(self, secret: str, tolerance_s: int = TOLERANCE_S) -> None:
        self._key = decode_secret(secret)
        self._secret = secret
        self.tolerance_s = tolerance_s

    def verify(self, headers: Mapping[str, str], body: bytes, now: datetime) -> str:
        """Return the webhook id of an authentic, fresh delivery; raise ``WebhookRejected``."""
        webhook_id = headers.get("webhook-id")
        timestamp = headers.get("webhook-timestamp")
        signatures = headers.get("webhook-signature")
        if not webhook_id or not timestamp or not signatures:
            raise WebhookRejected("missing webhook-id, webhook-timestamp or webhook-signature")
        try:
            sent_at = int(timestamp)
        except ValueError:
            raise WebhookRejected("webhook-timestamp is not an integer") from None
        if abs(now.timestamp() - sent_at) > self.tolerance_s:
            raise WebhookRejected("webhook-timestamp outside the tolerance window")
        expected = sign(self._secret, webhook_id, sent_at, body).split(",", 1)[1]
        for candidate in signatures.split():
            version, _, value = candidate.partition(",")
            # Constant-time: the comparison time leaks nothing about the expected value.
            if version == "v1" and hmac.compare_digest(value, expected):
                return webhook_id
        raise WebhookRejected("no valid v1 signature")
