"""publish() is atomic with the product's transaction and writes exactly one outbox row."""

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from email_platform import InvalidAddressError, PublishError, publish, publish_many
from email_platform.common.errors import NotInTransactionError
from email_platform.common.timeutil import as_utc
from email_platform.db.schema import email_outbox
from tests.support import product, signup, users


def _outbox_count(engine) -> int:
    with engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(email_outbox)).scalar_one()


def test_committed_transaction_writes_one_row_with_the_envelope(engine):
    event_id = signup(engine, "u1", metadata={"producer": "accounts", "trace_id": "t-1"})
    with engine.connect() as connection:
        row = connection.execute(select(email_outbox)).one()
    assert row.event_id == event_id and len(event_id) == 26
    assert (row.event_type, row.event_version, row.aggregate_id) == ("user.signed_up", 2, "u1")
    assert row.payload == {"user_id": "u1", "email": "u1@example.com", "first_name": "Jane"}
    assert row.event_metadata == {"producer": "accounts", "trace_id": "t-1"}
    assert (row.lane, row.status) == ("transactional", "pending")


def test_rollback_leaves_neither_business_row_nor_event(engine):
    with engine.begin() as connection:
        product.create_all(connection)
    with pytest.raises(RuntimeError), engine.begin() as connection:
        connection.execute(users.insert().values(id="u1", email="u1@example.com"))
        publish(
            connection,
            event_type="user.signed_up",
            aggregate_id="u1",
            payload={"user_id": "u1", "email": "u1@example.com", "first_name": "J"},
        )
        raise RuntimeError("the product's transaction fails after publishing")
    with engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(users)).scalar_one() == 0
    assert _outbox_count(engine) == 0


def test_failed_validation_writes_nothing_and_names_the_field(engine):
    with pytest.raises(InvalidAddressError) as raised, engine.begin() as connection:
        publish(
            connection,
            event_type="user.signed_up",
            aggregate_id="u1",
            payload={"user_id": "u1", "email": "not-an-address", "first_name": "J"},
        )
    assert raised.value.field == "payload.email"
    assert _outbox_count(engine) == 0


def test_publish_refuses_to_run_outside_a_transaction(engine):
    with engine.connect() as connection:
        with pytest.raises(NotInTransactionError):
            publish(
                connection,
                event_type="order.paid",
                aggregate_id="o1",
                payload={"email": "a@example.com", "first_name": "A", "order_id": "o1"},
            )
        assert not connection.in_transaction()
    assert _outbox_count(engine) == 0


def test_session_transaction_is_the_callers(engine):
    with Session(engine) as session:
        publish(
            session,
            event_type="order.paid",
            aggregate_id="o1",
            payload={"email": "a@example.com", "first_name": "A", "order_id": "o1"},
        )
        session.rollback()
    assert _outbox_count(engine) == 0
    with Session(engine) as session, session.begin():
        publish(
            session,
            event_type="order.paid",
            aggregate_id="o1",
            payload={"email": "a@example.com", "first_name": "A", "order_id": "o1"},
        )
    assert _outbox_count(engine) == 1


def test_optional_arguments_are_stored(engine):
    send_after = datetime.now(UTC) + timedelta(hours=1)
    expires_at = send_after + timedelta(hours=1)
    with engine.begin() as connection:
        event_id = publish(
            connection,
            event_type="order.paid",
            aggregate_id="o1",
            payload={"email": "a@example.com", "first_name": "A", "order_id": "o1"},
            priority="critical",
            send_after=send_after,
            expires_at=expires_at,
            idempotency_key="order-o1-receipt",
        )
    with engine.connect() as connection:
        row = connection.execute(
            select(email_outbox).where(email_outbox.c.event_id == event_id)
        ).one()
    assert row.lane == "critical"
    assert abs((as_utc(row.available_at) - send_after).total_seconds()) < 0.001
    assert abs((as_utc(row.expires_at) - expires_at).total_seconds()) < 0.001
    assert row.idempotency_key == "order-o1-receipt"


def _digest(i: int, **extra) -> dict:  # type: ignore[no-untyped-def]
    return {
        "event_type": "digest.ready",
        "aggregate_id": f"u{i}",
        "payload": {"email": f"reader{i}@example.com", "first_name": "Jane", "highlights": []},
        **extra,
    }


def test_publish_many_writes_every_event_in_the_callers_transaction(engine):
    with engine.begin() as connection:
        ids = publish_many(
            connection, [_digest(i) for i in range(250)] + [_digest(250, priority="critical")]
        )
    assert len(ids) == 251 and len(set(ids)) == 251
    with engine.connect() as connection:
        rows = {r.event_id: r for r in connection.execute(select(email_outbox)).all()}
    assert set(rows) == set(ids)
    assert (
        rows[ids[7]].aggregate_id == "u7" and rows[ids[7]].payload["email"] == "reader7@example.com"
    )
    assert [rows[i].lane for i in ids[-2:]] == ["bulk", "critical"]
    assert all(rows[i].status == "pending" and rows[i].event_type == "digest.ready" for i in ids)
    # One product transaction: a rollback takes every event with it.
    with pytest.raises(RuntimeError), engine.begin() as connection:
        publish_many(connection, [_digest(i) for i in range(10)])
        raise RuntimeError("the product's transaction fails after publishing")
    assert _outbox_count(engine) == 251


def test_publish_many_checks_every_event_before_writing_any(engine):
    bad_address = _digest(3)
    bad_address["payload"] = {**bad_address["payload"], "email": "nope"}
    with pytest.raises(InvalidAddressError) as raised, engine.begin() as connection:
        publish_many(connection, [_digest(0), _digest(1), _digest(2), bad_address])
    assert raised.value.field == "events[3].payload.email"
    for events, field in (
        ([_digest(0), {"event_type": "digest.ready"}], "events[1]"),
        ([_digest(0, colour="red")], "events[0]"),
        ([_digest(0), "not a mapping"], "events[1]"),
    ):
        with pytest.raises(PublishError) as raised, engine.begin() as connection:
            publish_many(connection, events)
        assert raised.value.field == field
    assert _outbox_count(engine) == 0
    with pytest.raises(NotInTransactionError), engine.connect() as connection:
        publish_many(connection, [_digest(0)])


def test_an_order_id_bound_for_the_receipt_subject_is_checked_at_publish(engine) -> None:
    """The receipt's subject renders order_id: a line break in it is refused at the call."""
    from email_platform.common.errors import HeaderInjectionError

    with engine.begin() as connection, pytest.raises(HeaderInjectionError) as refused:
        publish(
            connection,
            event_type="order.paid",
            aggregate_id="o1",
            payload={"email": "a@example.com", "order_id": "=?utf-8?q?1=0D=0ABcc:_x@y.example?="},
        )
    assert refused.value.field == "payload.order_id"
