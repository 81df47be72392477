"""The batch statements of the send path, on SQLite and PostgreSQL.

PostgreSQL takes a batch as one JSON document (``json_to_recordset``), or one array per column
where JSON cannot carry a value exactly (``unnest``, and ``= ANY`` for set filters); SQLite keeps
the multi-row forms. Both must give the same answers: rows created in the caller's order with the
caller's values, a unique-key conflict inside a batch still resolved first-come, each accepted
message updated with its own provider id, a set filter matching exactly its members, and a
value too long for its column refused rather than silently cut short.
"""

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError

from email_platform import publish
from email_platform.common.timeutil import as_utc, utcnow
from email_platform.db.errors import refused_by_database
from email_platform.db.schema import email_attempts, email_messages
from email_platform.store import attempts, bulk, messages, outbox
from tests.support import event, signup


def _values(event_id: str, n: int, **overrides: object) -> dict:
    now = utcnow()
    values = {
        "event_id": event_id,
        "route": "welcome",
        "template": "welcome",
        "template_version": 1,
        "lane": "transactional",
        "recipient": f"u{n}@example.com",
        "recipient_domain": "example.com",
        "idempotency_key": f"{event_id}:welcome",
        "dedupe_key": f"welcome:u{n}",
        "status": messages.PENDING,
        "expires_at": now + timedelta(hours=n),
        "created_at": now,
        "updated_at": now,
        "provider": "sandbox",
    }
    values.update(overrides)
    return values


def test_create_many_returns_rows_in_order_with_their_values(engine):
    ids = [signup(engine, f"u{i}") for i in range(30)]
    # Reverse order: the answer follows the input, not the insert or id order.
    rows = [_values(event_id, n) for n, event_id in reversed(list(enumerate(ids)))]
    rows[3]["dedupe_key"] = None
    with engine.begin() as connection:
        created = messages.create_many(connection, rows)
    assert [m.event_id for m in created] == [r["event_id"] for r in rows]
    for message, values in zip(created, rows, strict=True):
        assert message.recipient == values["recipient"]
        assert message.dedupe_key == values["dedupe_key"]
        assert as_utc(message.expires_at) == values["expires_at"]
        assert (message.status, message.attempts) == ("pending", 0)  # server default


def test_create_many_resolves_a_shared_dedupe_key_first_come(engine):
    first, second, third = (signup(engine, f"u{i}") for i in range(3))
    rows = [
        _values(first, 1, dedupe_key="welcome:same"),
        _values(second, 2, dedupe_key="welcome:same"),
        _values(third, 3),
    ]
    with engine.begin() as connection:
        created = messages.create_many(connection, rows)
    assert [m.event_id for m in created] == [first, second, third]
    assert [m.status for m in created] == ["pending", "duplicate", "pending"]
    assert created[0].dedupe_key == "welcome:same" and created[1].dedupe_key is None


def test_record_accepted_many_gives_each_message_its_own_provider_id(engine):
    ids = [signup(engine, f"u{i}") for i in range(5)]
    with engine.begin() as connection:
        created = messages.create_many(connection, [_values(e, n) for n, e in enumerate(ids)])
    accepted = [(m.message_id, f"prov-{m.event_id}") for m in created[:4]]
    now = utcnow()
    with engine.begin() as connection:
        messages.record_accepted_many(connection, accepted, now, "sandbox")
        rows = {m.event_id: m for m in messages.for_events(connection, ids)}
    for event_id in ids[:4]:
        row = rows[event_id]
        assert (row.status, row.attempts, row.provider_message_id) == (
            "sent",
            1,
            f"prov-{event_id}",
        )
        assert as_utc(row.sent_at) == now
    assert (rows[ids[4]].status, rows[ids[4]].attempts) == ("pending", 0)


def test_attempts_add_inserts_every_row_as_given(engine):
    ids = [signup(engine, f"u{i}") for i in range(3)]
    with engine.begin() as connection:
        created = messages.create_many(connection, [_values(e, n) for n, e in enumerate(ids)])
    now = utcnow()
    rows = [
        {
            "message_id": m.message_id,
            "event_id": m.event_id,
            "run_id": "run-1",
            "attempt_no": 1,
            "started_at": now,
            "finished_at": now,
            "outcome": outcome,
            "http_status": status,
            "provider_message_id": None,
            "error": error,
            "retry_after_s": retry_after_s,
        }
        for m, outcome, status, error, retry_after_s in zip(
            created,
            ["accepted", "transient", "permanent"],
            [200, 429, None],
            [None, "rate limited", "refused"],
            [None, 1.5, None],
            strict=True,
        )
    ]
    with engine.begin() as connection:
        attempts.add(connection, rows)
        stored = connection.execute(select(email_attempts).order_by(email_attempts.c.attempt_id))
        got = [(r.message_id, r.outcome, r.http_status, r.error, r.retry_after_s) for r in stored]
    assert got == [
        (r["message_id"], r["outcome"], r["http_status"], r["error"], r["retry_after_s"])
        for r in rows
    ]


def test_set_filters_match_exactly_their_members(engine):
    ids = [signup(engine, f"u{i}") for i in range(6)]
    with engine.begin() as connection:
        messages.create_many(connection, [_values(e, n) for n, e in enumerate(ids)])
        chosen = ids[1:4]
        assert sorted(m.event_id for m in messages.for_events(connection, chosen)) == sorted(chosen)
        outbox.finish(connection, chosen, status=outbox.DONE, resolution="sent", now=utcnow())
        total = connection.execute(select(email_messages)).all()
    assert len(total) == 6
    assert [event(engine, e).status for e in ids] == [
        "pending",
        "done",
        "done",
        "done",
        "pending",
        "pending",
    ]


def test_a_longer_id_sharing_a_prefix_matches_nothing(engine):
    event_id = signup(engine, "u1")
    with engine.begin() as connection:
        messages.create_many(connection, [_values(event_id, 1)])
        assert messages.for_events(connection, [event_id + "XXXX"]) == []
        outbox.finish(
            connection, [event_id + "XXXX"], status=outbox.DONE, resolution="sent", now=utcnow()
        )
    assert event(engine, event_id).status == "pending"


# PostgreSQL only: SQLite does not enforce VARCHAR lengths at all.
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_a_value_too_long_for_its_column_is_refused_not_cut_short(engine):
    event_id = signup(engine, "u1")
    too_long = _values(event_id, 1, idempotency_key="k" * 300)
    with pytest.raises(DBAPIError, match="too long"), engine.begin() as connection:
        messages.create_many(connection, [too_long])


def _attempt(message_id: int, event_id: str, **overrides: object) -> dict:
    now = utcnow()
    return {
        "message_id": message_id,
        "event_id": event_id,
        "run_id": "run-1",
        "attempt_no": 1,
        "started_at": now,
        "finished_at": now,
        "outcome": "transient",
        **overrides,
    }


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_values_json_cannot_carry_go_as_arrays_and_are_stored_exactly(engine):
    event_id = signup(engine, "u1")
    with engine.begin() as connection:
        (message,) = messages.create_many(connection, [_values(event_id, 1)])
    odd = [
        _attempt(message.message_id, event_id, retry_after_s=float("inf"), error='é \u2028 "q"'),
        _attempt(message.message_id, event_id, retry_after_s=float("nan"), error="\\ {1,2}"),
    ]
    plain = [_attempt(message.message_id, event_id, retry_after_s=2.5, error='é \u2028 "q"')]
    types = {name: email_attempts.c[name].type for name in odd[0]}
    assert bulk._as_json(odd, types) is None and bulk._as_json(plain, types) is not None
    # An offset with seconds (Paris's local mean time in 1900): orjson would drop them.
    paris = ZoneInfo("Europe/Paris")
    for year, carried in ((1900, False), (2000, True)):
        at = datetime(year, 1, 1, tzinfo=paris)
        assert (bulk._as_json([{**plain[0], "started_at": at}], types) is not None) is carried
    with engine.begin() as connection:
        attempts.add(connection, odd)
        attempts.add(connection, plain)
        stored = connection.execute(select(email_attempts).order_by(email_attempts.c.attempt_id))
        got = [(r.retry_after_s, r.error, as_utc(r.started_at)) for r in stored]
    assert got[0][0] == float("inf") and got[1][0] != got[1][0]  # NaN is not equal to itself
    assert [g[1] for g in got] == [r["error"] for r in [*odd, *plain]]
    assert [g[2] for g in got] == [r["started_at"] for r in [*odd, *plain]]


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("error", ["nul \x00 inside", "lone \ud800 surrogate"])
def test_text_postgresql_cannot_hold_is_refused_as_a_value(engine, error):
    event_id = signup(engine, "u1")
    with engine.begin() as connection:
        (message,) = messages.create_many(connection, [_values(event_id, 1)])
    with pytest.raises(Exception) as raised, engine.begin() as connection:
        attempts.add(connection, [_attempt(message.message_id, event_id, error=error)])
    # A refused value (one message's to carry), never taken for the database being down.
    assert refused_by_database(raised.value)
    with engine.connect() as connection:
        assert connection.execute(select(email_attempts)).all() == []


def test_json_columns_read_back_what_was_written_where_orjson_alone_would_not(engine):
    """The engines decode JSON columns with orjson, and with ``json.loads`` where the two would
    read a document differently: a payload's integer past 64 bits stays an exact int."""
    big = 2**70 + 1
    payload = {
        "email": "u1@example.com",
        "order_id": big,
        "extra": {"lines": [1.5, -0.0, 10**18], "note": 'é \u2028 "q"'},
    }
    with engine.begin() as connection:
        event_id = publish(connection, event_type="order.paid", aggregate_id="o1", payload=payload)
    stored = event(engine, event_id).payload
    assert stored == payload and type(stored["order_id"]) is int
    assert str(stored["extra"]["lines"][1]) == "-0.0"
