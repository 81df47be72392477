"""Provider tag values: the alphabet SES message tags and Resend tags allow.

Both accept ``[A-Za-z0-9_-]{1,256}``. The adapters that write ``event_id`` and
``idempotency_key`` as tags and the webhook normalizers that read them back share this module, so
neither side imports the other.
"""

import re

TAG_MAX_LENGTH = 256
_TAG_DISALLOWED = re.compile(r"[^A-Za-z0-9_-]")


def tag_value(value: str) -> str:
    """``value`` as a tag value: every other character becomes ``_``, cut at 256, never empty."""
    return _TAG_DISALLOWED.sub("_", value)[:TAG_MAX_LENGTH] or "_"


def recoverable(value: str | None, max_length: int) -> str | None:
    """A tag value that is certainly the original: ``tag_value`` changed nothing in it."""
    if not value or "_" in value or len(value) >= TAG_MAX_LENGTH or len(value) > max_length:
        return None
    return value
