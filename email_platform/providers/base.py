"""What every provider adapter takes and returns."""

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class OutgoingEmail:
    """A rendered message, ready for one provider call."""

    message_id: int
    event_id: str
    idempotency_key: str
    sender: str
    to: str
    subject: str
    text: str
    html: str | None
    template: str
    lane: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Accepted:
    provider_message_id: str
    status_code: int | None = None


class EmailProvider(Protocol):
    """Sends one message; raises ``TransientError`` or ``PermanentError`` when it cannot.

    Implementations are thread-safe: one instance (one keep-alive client) serves the bounded
    pool of concurrent sends in a run.
    """

    name: str

    def send(self, email: OutgoingEmail) -> Accepted: ...

    def close(self) -> None: ...


class RateLimiter:
    """Token bucket shared by the concurrent sends of one run (0 = unlimited)."""

    def __init__(self, per_second: float) -> None:
        self.per_second = per_second
        self._lock = threading.Lock()
        self._next_slot = time.monotonic()

    def acquire(self) -> None:
        if self.per_second <= 0:
            return
        with self._lock:
            now = time.monotonic()
            slot = max(self._next_slot, now)
            self._next_slot = slot + 1.0 / self.per_second
        delay = slot - now
        if delay > 0:
            time.sleep(delay)
