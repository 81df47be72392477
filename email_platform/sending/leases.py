"""Short leases, renewed while their holder lives.

Nothing notices a process killed with SIGKILL: its claims are freed only when their leases run
out. So a claim's lease is short (``lease_s``, 60 s shipped) and a thread of the run holding it
renews it every ``renew_every_s(lease_s)`` (10 s), until the run ends. Five renewals can fail
before another run may take the events over, and one that does is fenced: ``BatchSender``
sends only for events this run still holds.
"""

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

from sqlalchemy import Connection, Engine

from email_platform.common.timeutil import utcnow
from email_platform.store import outbox

#: How often a live run renews its leases (at most; a shorter lease is renewed more often).
RENEW_EVERY_S = 10.0


def renew_every_s(lease_s: float) -> float:
    """Every 10 s, or a sixth of a lease shorter than a minute: five renewals may fail."""
    return min(RENEW_EVERY_S, lease_s / 6)


class LeaseRenewer:
    """A thread that renews ``run_id``'s leases to ``lease_s`` from now while it runs.

    ``beat`` is written in the same transaction (a lane worker's heartbeat), so a beat and a
    renewal cost one round of commits. Use as a context manager around the work that holds
    claims; the thread stops on leaving it, also on an exception.
    """

    def __init__(
        self,
        engine: Engine,
        run_id: str,
        lease_s: float,
        *,
        every_s: float | None = None,
        beat: Callable[[Connection, datetime], None] | None = None,
        log: logging.Logger | Any | None = None,
        name: str = "lease-renewal",
    ) -> None:
        self.engine = engine
        self.run_id = run_id
        self.lease_s = lease_s
        self.every_s = renew_every_s(lease_s) if every_s is None else every_s
        self.beat = beat
        self.log = log or logging.getLogger(__name__)
        self.name = name
        #: Renewals that went through (tests and progress lines read it).
        self.renewals = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def renew(self) -> int:
        """One renewal (and beat) now; how many leases it extended."""
        now = utcnow()
        with self.engine.begin() as connection:
            if self.beat is not None:
                self.beat(connection, now)
            extended = outbox.renew_leases(
                connection, self.run_id, now + timedelta(seconds=self.lease_s)
            )
        self.renewals += 1
        return extended

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing; waits for a renewal under way, so none lands after this returns."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "LeaseRenewer":
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.renew()
            except Exception as exc:  # the next one may get through; the lease has slack
                self.log.warning(f"{self.name} failed: {exc}")
