"""Why the receiver turns a webhook away; each maps to one HTTP status."""


class WebhookRejected(Exception):
    """Refused before storage: bad or missing signature, stale timestamp, replay (401)."""

    status_code = 401

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class WebhookMalformed(Exception):
    """Authentic but unreadable: stored for inspection, answered 400."""

    status_code = 400
