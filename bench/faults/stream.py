"""What the fault harness publishes: a stream over every lane and shipped route, each event
written with the fate it must end in.

The mix: welcome mails (some from a v1 producer, some a repeated signup that the route's dedupe
key must turn into a ``duplicate``), password resets (critical, the recipient looked up in the
product's ``users`` table), receipts (some to an address suppressed beforehand), digests (bulk;
some that expire before they may be sent), an unrouted type, addresses that fail transiently
first (429, 5xx, a timeout, a timeout after the provider accepted), and poison at about 1%:
events that pass ``publish()`` but cannot be sent, each with the dead letter it must become.
Poison is written as a producer bypassing ``publish()`` would leave it: the payload is rewritten
in the same transaction, so no worker ever sees the clean version.
"""

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import Engine, insert, update
from sqlalchemy.exc import DBAPIError

from bench.harness import users
from email_platform import publish
from email_platform.common.timeutil import utcnow
from email_platform.db.schema import email_outbox
from email_platform.store import suppressions

#: Poison: how a good signup's payload is rewritten, and the dead letter's reason it must get.
POISONS: dict[str, tuple[dict, str]] = {
    "long_dedupe_key": ({"user_id": "u" * 300}, "value_too_long"),
    "lone_surrogate": ({"first_name": "Ja\ud800ne"}, "unencodable_text"),
    "encoded_line_break": (
        {"first_name": "=?utf-8?q?Jane=0D=0ABcc:_evil@attacker.example?="},
        "header_injection",
    ),
    "invalid_recipient": ({"email": "jane..doe@example.com"}, "invalid_recipient"),
    "provider_rejects": ({}, "provider_rejected"),
}
#: Recipient directives of good events: they fail first, then the provider accepts them.
TRANSIENT = ("429x2", "503x1", "500x1", "timeoutx1", "accepttimeoutx1")

SENT, DUPLICATE, SUPPRESSED, EXPIRED, IGNORED = (
    "sent",
    "duplicate",
    "suppressed",
    "expired",
    "ignored",
)


def dead(reason: str) -> str:
    return f"dead:{reason}"


@dataclass
class Expected:
    """Every published event and the fate it must end in (``sent``, ``dead:<reason>``, ...)."""

    fates: dict[str, str] = field(default_factory=dict)
    #: publish() calls that raised (the database was down): never committed, so never owed.
    refused: int = 0
    kinds: dict[str, int] = field(default_factory=dict)

    def add(self, event_id: str, fate: str, kind: str) -> None:
        self.fates[event_id] = fate
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


def prepare(engine: Engine) -> None:
    with engine.begin() as connection:
        users.metadata.create_all(connection)


class Stream:
    """Publishes ``total`` events at ``per_s`` from the calling thread, recording fates."""

    def __init__(
        self,
        engine: Engine,
        total: int,
        per_s: float,
        seed: int,
        *,
        keyless: bool = False,
        poison_share: float = 0.01,
    ) -> None:
        self.poison_share = poison_share
        self.engine = engine
        self.total = total
        self.per_s = per_s
        self.rng = random.Random(seed)
        self.expected = Expected()
        #: Good signups so far: (user id, address, event id), for repeats of them.
        self._signups: list[tuple[str, str, str]] = []
        self._n = 0
        # A provider without keys sends a message twice after a timeout past its acceptance:
        # that is by design, and not what a keyless run measures.
        self.transient = tuple(t for t in TRANSIENT if not (keyless and "accept" in t))

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> Expected:
        started = time.monotonic()
        while self._n < self.total and not should_stop():
            try:
                self._publish_one()
            except DBAPIError:
                # The product's transaction failed (database restarting): nothing committed,
                # nothing owed. The product would retry its request; the stream goes on.
                self.expected.refused += 1
                time.sleep(0.2)
            self._n += 1
            wait = started + self._n / self.per_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        return self.expected

    def _address(self, user_id: str) -> str:
        if self.rng.random() < 0.05:
            return f"{user_id}+{self.rng.choice(self.transient)}@example.com"
        return f"{user_id}@{self.rng.choice(['example.com', 'example.org', 'example.net'])}"

    def _publish_one(self) -> None:
        n, poison, roll = self._n, self.rng.random() < self.poison_share, self.rng.random()
        user_id = f"user{n}"
        # Owed only once committed: a commit the restarting database refused raises after the
        # event was written in the transaction, and that event never existed.
        owed: list[tuple[str, str, str]] = []
        signups: list[tuple[str, str, str]] = []

        def owe(event_id: str, fate: str, kind: str) -> None:
            owed.append((event_id, fate, kind))

        with self.engine.begin() as connection:
            if poison:
                kind = self.rng.choice(sorted(POISONS))
                changes, reason = POISONS[kind]
                email = f"{user_id}+reject@example.com" if kind == "provider_rejects" else None
                event_id = self._signup(connection, user_id, email or f"{user_id}@example.com")
                if changes:
                    row = connection.execute(
                        email_outbox.select().where(email_outbox.c.event_id == event_id)
                    ).one()
                    connection.execute(
                        update(email_outbox)
                        .where(email_outbox.c.event_id == event_id)
                        .values(payload={**row.payload, **changes})
                    )
                owe(event_id, dead(reason), f"poison:{kind}")
            elif roll < 0.03 and self._signups:
                # A retried signup handler: the same user again is a duplicate, never sent.
                old_user, email, first = self.rng.choice(self._signups)
                event_id = publish(
                    connection,
                    event_type="user.signed_up",
                    aggregate_id=old_user,
                    payload={"user_id": old_user, "email": email, "first_name": "Again"},
                )
                owe(event_id, f"{DUPLICATE}:{first}", "duplicate_signup")
            elif roll < 0.30:
                email = self._address(user_id)
                connection.execute(insert(users).values(id=user_id, email=email))
                if roll < 0.06:
                    event_id = publish(
                        connection,
                        event_type="user.signed_up",
                        event_version=1,
                        aggregate_id=user_id,
                        payload={"user_id": user_id, "email": email, "name": f"User {n}"},
                    )
                    owe(event_id, SENT, "signup_v1")
                else:
                    event_id = self._signup(connection, user_id, email, add_user=False)
                    owe(event_id, SENT, "signup")
                signups.append((user_id, email, event_id))
            elif roll < 0.40:
                email = self._address(user_id)
                connection.execute(insert(users).values(id=user_id, email=email))
                event_id = publish(
                    connection,
                    event_type="user.password_reset_requested",
                    aggregate_id=user_id,
                    payload={"user_id": user_id, "reset_token": f"tok{n}"},
                )
                owe(event_id, SENT, "password_reset")
            elif roll < 0.62:
                email = self._address(user_id)
                fate, kind = SENT, "receipt"
                if roll < 0.42:
                    email = f"{user_id}@example.com"
                    suppressions.add(
                        connection, email, reason="hard_bounce", source="faults", now=utcnow()
                    )
                    fate, kind = SUPPRESSED, "receipt_suppressed"
                event_id = publish(
                    connection,
                    event_type="order.paid",
                    aggregate_id=f"order{n}",
                    payload={
                        "order_id": f"O-{n}",
                        "email": email,
                        "first_name": "Jane",
                        "items": [{"name": "Mug", "quantity": 1, "unit_price": 9.5}],
                        "total": 9.5,
                        "currency": "EUR",
                    },
                )
                owe(event_id, fate, kind)
            elif roll < 0.99:
                fate, kind, extra = SENT, "digest", {}
                if roll < 0.63:
                    # Not before 2 s from now, and expired 1 ms after that: never sent.
                    send_after = utcnow() + timedelta(seconds=2)
                    extra = {
                        "send_after": send_after,
                        "expires_at": send_after + timedelta(0, 0, 0, 1),
                    }
                    fate, kind = EXPIRED, "digest_expired"
                event_id = publish(
                    connection,
                    event_type="digest.ready",
                    aggregate_id=user_id,
                    payload={
                        "email": self._address(user_id),
                        "first_name": "Jane",
                        "highlights": ["3 new followers"],
                    },
                    **extra,
                )
                owe(event_id, fate, kind)
            else:
                event_id = publish(
                    connection,
                    event_type="cart.viewed",
                    aggregate_id=f"cart{n}",
                    payload={"cart_id": f"cart{n}"},
                )
                owe(event_id, IGNORED, "unrouted")
        for event_id, fate, kind in owed:
            self.expected.add(event_id, fate, kind)
        self._signups.extend(signups)

    def _signup(self, connection, user_id: str, email: str, add_user: bool = True) -> str:  # type: ignore[no-untyped-def]
        if add_user:
            connection.execute(insert(users).values(id=user_id, email=email))
        return publish(
            connection,
            event_type="user.signed_up",
            aggregate_id=user_id,
            payload={"user_id": user_id, "email": email, "first_name": f"User{self._n}"},
        )
