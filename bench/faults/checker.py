"""The verdict: what became of every published event, from the database and the provider.

* **lost**: an event not ``done`` or ``dead`` after settling, or a message still ``pending``.
* **doubled**: the provider accepted one idempotency key twice or two keys for one message, or
  more than one ``accepted`` attempt was recorded for one message (two senders each recorded a
  send: a provider without keys delivered it twice). The sandbox answers a repeated key with
  its first answer, so counting only what it stored would hide that.
* **wrong**: an event whose fate differs from the one it was published for (sent although it
  should have been suppressed, expired, deduplicated or dead; dead although it was good, or
  dead for another reason), or a message the provider accepted that the database does not
  record as sent.

Deduplicated signups are checked as a group: of one user's signups exactly one is sent, the
others are ``duplicate``; which one is sent depends on which a run claimed first.
"""

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from sqlalchemy import Engine, func, select

from bench.faults.stream import DUPLICATE, SENT, Expected
from bench.faults.webhooks import WebhookVerdict
from email_platform.db.schema import dead_letters, email_attempts, email_messages, email_outbox

TERMINAL_EVENT = ("done", "dead")


@dataclass
class Verdict:
    lost: int = 0
    doubled: int = 0
    wrong: int = 0
    #: Fates as found, by kind of fate (``sent``, ``dead:provider_rejected``, ...).
    fates: Counter = field(default_factory=Counter)
    details: list[str] = field(default_factory=list)
    #: Messages the provider accepted more than once (only a provider without keys can), by
    #: what the senders recorded: a timeout on an attempt it had accepted, or nothing (the
    #: sender died, or the database was gone, between the acceptance and the commit).
    accepted_twice: Counter = field(default_factory=Counter)
    #: Requests the sandbox answered from a stored key (a resend it absorbed).
    replayed_keys: int = 0

    def add_webhooks(self, found: "WebhookVerdict", counts: Counter) -> None:
        """Fold in the webhook scenario's verdict; a hostile body the receiver accepted, or
        answered with a 5xx, is wrong."""
        self.lost += found.lost
        self.doubled += found.doubled
        self.wrong += found.wrong + counts["hostile_accepted"] + counts["hostile_5xx"]
        for detail in found.details:
            self.note(f"webhook {detail}")
        for alarm in ("hostile_accepted", "hostile_5xx"):
            if counts[alarm]:
                self.note(f"webhook wrong: {counts[alarm]} {alarm}")

    def note(self, what: str) -> None:
        if len(self.details) < 40:
            self.details.append(what)

    @property
    def line(self) -> str:
        return f"lost={self.lost} doubled={self.doubled} wrong={self.wrong}"


def _rows(engine: Engine, query) -> list:  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        return list(connection.execute(query).all())


def actual_fates(engine: Engine) -> dict[str, str]:
    """Each event's fate as the database records it (``lost`` when it is not terminal)."""
    events = _rows(
        engine, select(email_outbox.c.event_id, email_outbox.c.status, email_outbox.c.resolution)
    )
    messages = {
        r.event_id: r.status
        for r in _rows(engine, select(email_messages.c.event_id, email_messages.c.status))
    }
    reasons: dict[str, str] = {}
    for r in _rows(
        engine,
        select(dead_letters.c.event_id, dead_letters.c.reason, dead_letters.c.error_code)
        .where(dead_letters.c.status == "open")
        .order_by(dead_letters.c.dead_letter_id),
    ):
        reasons[r.event_id] = f"{r.reason}/{r.error_code}" if r.error_code else r.reason
    fates: dict[str, str] = {}
    for event in events:
        message = messages.get(event.event_id)
        if event.status not in TERMINAL_EVENT or message == "pending":
            fates[event.event_id] = "lost"
        elif event.status == "dead" or message == "dead":
            fates[event.event_id] = f"dead:{reasons.get(event.event_id, event.resolution)}"
        elif message is None:
            fates[event.event_id] = event.resolution or "done"
        else:
            fates[event.event_id] = message
    return fates


def check(
    engine: Engine,
    expected: Expected,
    accepted: Iterable[dict],
    replayed_keys: int,
    *,
    keyless: bool = False,
) -> Verdict:
    """``keyless``: the provider ignored idempotency keys, so what it accepted twice is the
    accept-then-die window (``accepted_twice``), reported apart from ``doubled``."""
    verdict = Verdict(replayed_keys=replayed_keys)
    fates = actual_fates(engine)
    verdict.fates.update(fates.values())
    _check_fates(verdict, expected, fates)
    _check_doubles(verdict, engine, list(accepted), fates, keyless)
    return verdict


def _check_fates(verdict: Verdict, expected: Expected, fates: dict[str, str]) -> None:
    groups: dict[str, list[str]] = defaultdict(list)
    repeated = {
        want.partition(":")[2] for want in expected.fates.values() if want.startswith(DUPLICATE)
    }
    for event_id, want in expected.fates.items():
        got = fates.get(event_id, "missing")
        if got in ("lost", "missing"):
            verdict.lost += 1
            verdict.note(f"lost: {event_id} (want {want}, {got})")
            continue
        if want.startswith(DUPLICATE):
            groups[want.partition(":")[2]].append(event_id)
            continue
        if event_id in repeated:
            continue  # checked with its repeats below
        if not _same(got, want):
            verdict.wrong += 1
            verdict.note(f"wrong: {event_id} is {got}, want {want}")
    for first, duplicates in groups.items():
        members = [first, *duplicates]
        sent = [e for e in members if fates.get(e) == SENT]
        others = [fates.get(e) for e in members if fates.get(e) != SENT]
        if len(sent) != 1 or any(o != DUPLICATE for o in others):
            verdict.wrong += 1
            verdict.note(f"wrong: signups of {first}: {[fates.get(e) for e in members]}")


def _why_twice(engine: Engine, keys: list[str]) -> list[str]:
    if not keys:
        return []
    timed_out = {
        key
        for key, error in _rows(
            engine,
            select(email_messages.c.idempotency_key, email_attempts.c.error)
            .join(email_attempts, email_attempts.c.message_id == email_messages.c.message_id)
            .where(
                email_messages.c.idempotency_key.in_(keys),
                email_attempts.c.outcome == "transient",
            ),
        )
        if "timeout" in (error or "").lower() or "timed out" in (error or "").lower()
    }
    return ["after_timeout" if key in timed_out else "unrecorded" for key in keys]


def _same(got: str, want: str) -> bool:
    """``dead:<reason>/<code>`` is the ``dead:<what>`` wanted when either names it."""
    if got == want:
        return True
    if got.startswith("dead:") and want.startswith("dead:"):
        return want[5:] in got[5:].split("/")
    return False


def _check_doubles(
    verdict: Verdict, engine: Engine, accepted: list[dict], fates: dict[str, str], keyless: bool
) -> None:
    by_key = Counter(m["idempotency_key"] for m in accepted)
    by_message: dict[tuple[str, str], set[str]] = defaultdict(set)
    for m in accepted:
        tags = m.get("metadata") or {}
        by_message[(tags.get("event_id", ""), m["idempotency_key"].rpartition(":")[2])].add(
            m["idempotency_key"]
        )
    twice = [key for key, n in by_key.items() if n > 1]
    verdict.accepted_twice.update(_why_twice(engine, twice))
    for key, n in by_key.items():
        if n > 1 and not keyless:
            verdict.doubled += 1
            verdict.note(f"doubled: the provider accepted key {key} {n} times")
    for (event_id, route), keys in by_message.items():
        if len(keys) > 1:
            verdict.doubled += 1
            verdict.note(f"doubled: {event_id}/{route} accepted under keys {sorted(keys)}")
    recorded = _rows(
        engine,
        select(email_attempts.c.message_id, func.count(), func.min(email_attempts.c.event_id))
        .where(email_attempts.c.outcome == "accepted")
        .group_by(email_attempts.c.message_id)
        .having(func.count() > 1),
    )
    for message_id, n, event_id in recorded:
        verdict.doubled += 1
        verdict.note(f"doubled: message {message_id} of {event_id} recorded accepted {n} times")
    for event_id, _route in by_message:
        if fates.get(event_id) not in (SENT, None, "lost"):
            verdict.wrong += 1
            verdict.note(f"wrong: the provider accepted {event_id}, recorded {fates[event_id]}")
