"""What the steps of the send path hand each other: outcome counts, messages to send, answers."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Row

from email_platform.common.errors import ConfigurationError, DeliveryError
from email_platform.providers.base import Accepted, OutgoingEmail

# A run that keeps dying on the same events must not loop forever.
MAX_CLAIMS = 5


@dataclass
class BatchOutcome:
    requested: int = 0
    claimed: list[str] = field(default_factory=list)
    sent: int = 0
    suppressed: int = 0
    expired: int = 0
    duplicate: int = 0
    dead: int = 0
    ignored: int = 0
    #: Events given back to wait out a route's quiet hours.
    deferred: int = 0
    #: Messages that failed transiently this attempt and are still pending.
    transient: list[int] = field(default_factory=list)
    #: Largest Retry-After among the transient failures, if any provider gave one.
    retry_after_s: float | None = None
    #: Wall time, seconds, from the first provider call of this attempt to the last answer
    #: recorded (calls run side by side; answers are recorded while later calls are out).
    provider_s: float = 0.0

    @property
    def skipped(self) -> int:
        """Requested events this run did not get: done already, or held by another run."""
        return self.requested - len(self.claimed)

    def summary(self) -> str:
        """One line for the run's log: which events, what became of them, the provider's time."""
        if not self.claimed:
            return (
                f"none of {self.requested} event(s) claimed (sent already, or held by another run)"
            )
        parts = [f"claimed {len(self.claimed)}", f"sent {self.sent}"]
        parts += [
            f"{name} {n}"
            for name, n in (
                ("retrying", len(self.transient)),
                ("dead-lettered", self.dead),
                ("suppressed", self.suppressed),
                ("expired", self.expired),
                ("duplicate", self.duplicate),
                ("no route", self.ignored),
                ("waiting out quiet hours", self.deferred),
                ("not claimed (settled, or held by another run)", self.skipped),
            )
            if n
        ]
        return (
            f"events {min(self.claimed)}..{max(self.claimed)}: "
            + ", ".join(parts)
            + f"; provider calls {self.provider_s:.2f}s"
        )

    def as_metadata(self) -> dict[str, int]:
        return {
            "requested": self.requested,
            "claimed": len(self.claimed),
            "skipped": self.skipped,
            "sent": self.sent,
            "suppressed": self.suppressed,
            "expired": self.expired,
            "duplicate": self.duplicate,
            "dead_lettered": self.dead,
            "ignored": self.ignored,
            "transient": len(self.transient),
        }


@dataclass
class Work:
    """One message to hand to the provider in this attempt."""

    message: Row
    email: OutgoingEmail
    #: The W3C context the provider call's span continues (the event's, else the render's);
    #: None when tracing is off.
    trace_parent: dict[str, str] | None = None
    #: Made by this attempt's claim: no dead letter can name the message yet, so recording its
    #: acceptance has none to close (a retried or replayed message may have one).
    fresh: bool = False


#: What one provider call answered for one message.
Result = Accepted | DeliveryError | ConfigurationError


@dataclass
class Sent:
    """What one provider call came back with."""

    item: Work
    started: datetime
    result: Result


@dataclass
class ClaimedBatch:
    """Events claimed by one run and their messages, prepared and not yet sent."""

    outcome: BatchOutcome
    events: Sequence[Row]
    work: list[Work]
