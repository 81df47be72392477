"""Concurrent ingestion runs (the inbox sensor starts up to four a tick) end in the state the
full event set gives (docs/design.md invariant 7), found by the webhook fault scenario:

* two runs applying events of one message each read the events before the other committed,
  and the last to write its delivery status won: a late ``delivered`` could hide ``bounced``;
* two runs suppressing one address both found no row and both inserted it: the second's
  unique violation marked its webhook ``failed``, and its event was never applied;
* two runs raising one suppression each wrote the reason they computed from the same read,
  so a weaker reason could overwrite a stronger one.

Each test holds both runs at the racy point (a barrier) so the interleaving is the bad one.
"""

import contextlib
import json
import threading

import pytest

from email_platform.common.ids import new_ulid
from email_platform.common.timeutil import utcnow
from email_platform.store import email_events, inbox, suppressions
from email_platform.webhooks import ingest as ingest_module
from email_platform.webhooks.ingest import WebhookIngestor
from tests.webhook_support import (
    delivery_status,
    event_rows,
    inbox_rows,
    reasons,
    sandbox_event,
    seed_sent_message,
)


def _stored(engine, event: dict) -> int:  # type: ignore[no-untyped-def]
    with engine.begin() as connection:
        inbox_id = inbox.store(
            connection,
            provider="sandbox",
            delivery_id=event["id"],
            headers={},
            body=json.dumps(event),
            now=utcnow(),
        )
    assert inbox_id is not None
    return inbox_id


def _held_at(monkeypatch, module, name: str, parties: int = 2) -> None:  # type: ignore[no-untyped-def]
    """Make ``module.name`` wait (at most 2 s) until every run has reached it."""
    barrier = threading.Barrier(parties)
    real = getattr(module, name)

    def held(*args, **kwargs):  # type: ignore[no-untyped-def]
        # Broken: the other run waits on a lock this one holds, so this one goes on alone.
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=2)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, held)


def _ingest_concurrently(engine, inbox_ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    errors: list[BaseException] = []

    def run(inbox_id: int) -> None:
        try:
            WebhookIngestor(engine).run([inbox_id], run_id=f"race-{inbox_id}")
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(inbox_id,), name=f"race-{inbox_id}")
        for inbox_id in inbox_ids
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors


def _message_with_event(engine, name: str, to: str, kind: str, **data) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """A sent message ``sbx_<name>`` to ``to`` and one stored webhook about it."""
    event_id = new_ulid()
    message_id = seed_sent_message(
        engine, provider="sandbox", event_id=event_id, recipient=to, provider_message_id=name
    )
    event = sandbox_event(kind, message_id=name, to=to, event_id=event_id, **data)
    return message_id, _stored(engine, event)


@pytest.mark.parametrize("late", ["delivered", "bounced"])
def test_two_runs_on_one_message_end_in_the_highest_ranked_state(engine, monkeypatch, late):
    message_id, first = _message_with_event(engine, "sbx_race", "r@example.com", "email.delivered")
    common = {"message_id": "sbx_race", "to": "r@example.com"}
    bounce = {"type": "soft", "reason": "452"}
    second = _stored(engine, sandbox_event("email.bounced", bounce=bounce, **common))
    _held_at(monkeypatch, email_events, "types_for_message")
    # Whichever wrote last used to win: let ``late`` be that one.
    real = ingest_module.messages.set_delivery_status

    def ordered(connection, message_id, state, now):  # type: ignore[no-untyped-def]
        if state == late:
            threading.Event().wait(0.5)
        real(connection, message_id, state, now)

    monkeypatch.setattr(ingest_module.messages, "set_delivery_status", ordered)
    _ingest_concurrently(engine, [first, second])
    assert {row.status for row in inbox_rows(engine)} == {"processed"}
    assert delivery_status(engine, message_id) == "bounced"


def test_two_runs_suppressing_one_address_apply_both_events(engine, monkeypatch):
    hard = {"type": "hard", "reason": "550"}
    ids = [
        _message_with_event(engine, f"sbx_s{n}", "same@example.com", "email.bounced", bounce=hard)[
            1
        ]
        for n in range(2)
    ]
    _held_at(monkeypatch, ingest_module.suppressions, "add")
    _ingest_concurrently(engine, ids)
    assert [row.status for row in inbox_rows(engine)] == ["processed", "processed"]
    assert len(event_rows(engine)) == 2
    assert reasons(engine, "same@example.com") == {"same@example.com": "hard_bounce"}


def test_the_stronger_reason_stays_when_two_runs_raise_one_suppression(engine, monkeypatch):
    address = "both@example.com"
    with engine.begin() as connection:
        suppressions.add(connection, address, reason="unsubscribe", source="faults", now=utcnow())
    ids = [
        _message_with_event(engine, "sbx_b0", address, "email.complained")[1],
        _message_with_event(engine, "sbx_b1", address, "email.bounced", bounce={"type": "hard"})[1],
    ]
    _held_at(monkeypatch, ingest_module.suppressions, "add")
    # Both read "unsubscribe"; the weaker new reason (the bounce) writes last.
    real_update = suppressions.update

    def late_for_the_bounce(*args, **kwargs):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == f"race-{ids[1]}":
            threading.Event().wait(0.5)
        return real_update(*args, **kwargs)

    monkeypatch.setattr(suppressions, "update", late_for_the_bounce)
    _ingest_concurrently(engine, ids)
    assert reasons(engine, address) == {address: "complaint"}
