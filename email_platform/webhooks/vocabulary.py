"""The normalized tracking vocabulary (django-anymail's) and how events combine.

A message's delivery state is the highest-ranked event seen for it. Taking a maximum is
commutative and idempotent, so any arrival order and any number of duplicates end in the same
state, and a late ``delivered`` never overwrites ``bounced`` or ``complained``.
"""

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

EVENT_TYPES = (
    "queued",
    "sent",
    "rejected",
    "failed",
    "bounced",
    "deferred",
    "delivered",
    "autoresponded",
    "opened",
    "clicked",
    "complained",
    "unsubscribed",
    "subscribed",
    "unknown",
)

# Engagement climbs (delivered < opened < clicked); the bad outcomes sit above all of it.
RANK: dict[str, int] = {
    "unknown": 0,
    "queued": 1,
    "sent": 2,
    "deferred": 3,
    "autoresponded": 4,
    "delivered": 5,
    "subscribed": 5,
    "opened": 6,
    "clicked": 7,
    "unsubscribed": 8,
    "failed": 9,
    "rejected": 9,
    "bounced": 10,
    "complained": 11,
}

#: What puts an address on the suppression list, and under which reason.
SUPPRESSING = {"complained": "complaint", "unsubscribed": "unsubscribe"}


@dataclass(frozen=True)
class NormalizedEvent:
    """One provider event in our vocabulary, linked back to our ids where the provider kept them."""

    provider: str
    provider_event_id: str
    event_type: str
    occurred_at: datetime
    recipient: str | None = None
    event_id: str | None = None
    idempotency_key: str | None = None
    provider_message_id: str | None = None
    reject_reason: str | None = None
    bounce_type: str | None = None  # "hard" | "soft"
    click_url: str | None = None
    user_agent: str | None = None
    ip: str | None = None
    machine_open: bool | None = None
    raw: dict[str, Any] = field(default_factory=dict)
    #: The suppression the provider named, when it says more than the event type does (a
    #: Postmark subscription change caused by a hard bounce is a hard bounce, not an
    #: unsubscribe): one of the keys of ``store.suppressions.STRENGTH``.
    suppression: str | None = None

    def __post_init__(self) -> None:
        if self.event_type not in EVENT_TYPES:
            raise ValueError(f"{self.event_type!r} is not in the vocabulary")

    @property
    def suppression_reason(self) -> str | None:
        if self.suppression is not None:
            return self.suppression
        return suppression_for(self.event_type, self.bounce_type)


def suppression_for(event_type: str, bounce_type: str | None) -> str | None:
    """The suppression an event of this type asks for, when its provider named none."""
    if event_type == "bounced":
        return "hard_bounce" if bounce_type == "hard" else None
    return SUPPRESSING.get(event_type)


def combine(current: str | None, new: str) -> str:
    """The delivery state after ``new`` arrives on top of ``current``."""
    if current is None or RANK[new] > RANK.get(current, 0):
        return new
    return current
