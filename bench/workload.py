"""What the send benchmark publishes: a bulk backlog of digests and a trickle of password
resets on the critical lane."""

import threading
import time

from sqlalchemy import Engine

from email_platform import publish, publish_many


def publish_backlog(engine: Engine, n: int, chunk: int = 1000) -> float:
    """``n`` bulk digests through ``publish_many()`` (a campaign's fan-out), ``chunk`` per product
    transaction."""
    started = time.monotonic()
    for start in range(0, n, chunk):
        with engine.begin() as connection:
            publish_many(
                connection,
                [
                    {
                        "event_type": "digest.ready",
                        "aggregate_id": f"u{i}",
                        "payload": {
                            "email": f"reader{i}@example.com",
                            "first_name": "Jane",
                            "highlights": ["3 new followers", "1 comment"],
                        },
                    }
                    for i in range(start, min(n, start + chunk))
                ],
            )
    return time.monotonic() - started


class CriticalTrickle:
    """Password resets (critical lane) published at a steady rate until stopped."""

    def __init__(self, engine: Engine, per_s: float, users_n: int) -> None:
        self.engine, self.per_s, self.users_n = engine, per_s, users_n
        self.published = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "CriticalTrickle":
        if self.per_s > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        started = time.monotonic()
        while not self._stop.is_set():
            with self.engine.begin() as connection:
                user = f"u{self.published % self.users_n}"
                publish(
                    connection,
                    event_type="user.password_reset_requested",
                    aggregate_id=user,
                    payload={"user_id": user, "reset_token": f"t{self.published}"},
                )
            self.published += 1
            next_at = started + self.published / self.per_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))
