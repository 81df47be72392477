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


class WebhookUnavailable(Exception):
    """Something the check needs is unreachable right now (e.g. a signing certificate): 503,
    so the provider keeps the event and retries."""

    status_code = 503
