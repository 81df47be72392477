"""Publish-time guards: one event per idempotency key, route rate limits, authorization hooks.

Each is checked inside the caller's transaction against the outbox; the concurrent tests run
two publishers in their own transactions, on SQLite and PostgreSQL.
"""

import dataclasses
import threading
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, select

from email_platform import EventRefusedError, RateLimitedError, publish, publish_many
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane
from email_platform.db.schema import email_outbox
from email_platform.mail.routes import EventDraft, RateLimit, RouteTable, default_routes
from email_platform.providers.sandbox import SandboxProvider
from tests.support import batch_sender, messages_of, sandbox_messages


def _routes(route_name: str, **changes) -> RouteTable:  # type: ignore[no-untyped-def]
    table = default_routes()
    table.routes = [
        dataclasses.replace(r, **changes) if r.name == route_name else r for r in table.routes
    ]
    return table


RESETS_5_PER_HOUR = _routes("password_reset", rate_limit=RateLimit(max_events=5, per_s=3600))


def _reset(connection, user_id: str, routes: RouteTable = RESETS_5_PER_HOUR, **kwargs) -> str:  # type: ignore[no-untyped-def]
    return publish(
        connection,
        event_type="user.password_reset_requested",
        aggregate_id=user_id,
        payload={"user_id": user_id, "reset_token": "t"},
        routes=routes,
        **kwargs,
    )


def _count(engine: Engine, **where) -> int:  # type: ignore[no-untyped-def]
    query = select(func.count()).select_from(email_outbox)
    for name, value in where.items():
        query = query.where(email_outbox.c[name] == value)
    with engine.connect() as connection:
        return connection.execute(query).scalar_one()


def test_a_route_rate_limit_refuses_the_event_over_it_and_says_when_to_retry(engine):
    for _ in range(5):
        with engine.begin() as connection:
            _reset(connection, "u1")
    with pytest.raises(RateLimitedError) as refused, engine.begin() as connection:
        _reset(connection, "u1")
    error = refused.value
    assert error.field == "aggregate_id" and error.route == "password_reset"
    assert 3590 <= error.retry_after_s <= 3600
    assert "5 event(s) per 3600s" in str(error)
    # Another account has its own allowance; other routes have none.
    with engine.begin() as connection:
        _reset(connection, "u2")
        publish(
            connection,
            event_type="digest.ready",
            aggregate_id="u1",
            payload={"email": "u1@example.com", "first_name": "U", "highlights": []},
            routes=RESETS_5_PER_HOUR,
        )
    assert _count(engine, aggregate_id="u1") == 6 and _count(engine, aggregate_id="u2") == 1


def test_publish_many_counts_the_batch_itself_and_writes_nothing_when_refused(engine):
    with engine.begin() as connection:
        _reset(connection, "u1")
        _reset(connection, "u1")
    batch = [
        {
            "event_type": "user.password_reset_requested",
            "aggregate_id": user,
            "payload": {"user_id": user, "reset_token": "t"},
        }
        for user in ["u1", "u9", "u1", "u1", "u1"]
    ]
    with pytest.raises(RateLimitedError) as refused, engine.begin() as connection:
        publish_many(connection, batch, routes=RESETS_5_PER_HOUR)
    # Two published before, three in the batch fit: the fourth u1 of the batch is the sixth.
    assert refused.value.field == "events[4].aggregate_id"
    assert _count(engine) == 2


def test_the_window_slides_past_old_events(engine):
    short = _routes("password_reset", rate_limit=RateLimit(max_events=1, per_s=1))
    with engine.begin() as connection:
        _reset(connection, "u1", routes=short)
    with pytest.raises(RateLimitedError), engine.begin() as connection:
        _reset(connection, "u1", routes=short)
    time.sleep(1.1)
    with engine.begin() as connection:
        _reset(connection, "u1", routes=short)
    assert _count(engine, aggregate_id="u1") == 2


def _concurrently(engine: Engine, attempts: int, publish_one) -> tuple[list, list]:  # type: ignore[no-untyped-def]
    """``attempts`` publishes from two threads, each in its own transaction that stays open a
    moment after publishing (so the other publisher's check overlaps it)."""
    start = threading.Barrier(2)
    results: list = []
    errors: list = []

    def publisher() -> None:
        start.wait()
        for _ in range(attempts // 2):
            try:
                with engine.begin() as connection:
                    results.append(publish_one(connection))
                    time.sleep(0.02)
            except RateLimitedError as error:
                errors.append(error)

    threads = [threading.Thread(target=publisher) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results, errors


def test_the_rate_limit_holds_across_two_concurrent_publishers(engine):
    published, refused = _concurrently(engine, 12, lambda c: _reset(c, "u1"))
    assert len(published) == 5 and len(refused) == 7
    assert _count(engine, aggregate_id="u1") == 5


def test_an_idempotency_key_names_one_event_even_between_concurrent_publishers(engine, sandbox):
    published, _ = _concurrently(
        engine,
        8,
        lambda c: publish(
            c,
            event_type="user.signed_up",
            aggregate_id="u1",
            payload={"user_id": "u1", "email": "u1@example.com", "first_name": "U"},
            idempotency_key="signup-request-42",
        ),
    )
    assert len(published) == 8 and len(set(published)) == 1
    assert _count(engine, idempotency_key="signup-request-42") == 1
    (event_id,) = set(published)
    lane = DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL]
    sender = batch_sender(engine, SandboxProvider(sandbox.base_url, timeout_s=5), lane)
    sender.run([event_id], run_id="r1")
    (message,) = messages_of(engine, event_id)
    assert message.status == "sent" and message.idempotency_key == "signup-request-42:welcome"
    assert len(sandbox_messages(sandbox.base_url)) == 1


def test_publish_many_returns_the_first_event_for_a_repeated_key(engine):
    def signup(key: str | None, name: str) -> dict:
        return {
            "event_type": "user.signed_up",
            "aggregate_id": name,
            "payload": {"user_id": name, "email": f"{name}@example.com", "first_name": "U"},
            "idempotency_key": key,
        }

    with engine.begin() as connection:
        first = publish(connection, **signup("k1", "a"))
    with engine.begin() as connection:
        ids = publish_many(
            connection, [signup("k1", "b"), signup("k2", "c"), signup("k2", "d"), signup(None, "e")]
        )
    assert ids[0] == first and ids[1] == ids[2] and len(set(ids)) == 3
    assert _count(engine) == 3  # k1 once, k2 once, the keyless one


def test_an_authorization_hook_refuses_with_its_reason_and_lets_the_rest_through(engine):
    seen: list[EventDraft] = []

    def own_account_only(event: EventDraft) -> bool | str | None:
        seen.append(event)
        if event.payload.get("user_id") != event.aggregate_id:
            return f"user {event.payload.get('user_id')} is not account {event.aggregate_id}"
        return None

    routes = _routes("password_reset", authorize=own_account_only)
    with engine.begin() as connection:
        _reset(connection, "u1", routes=routes)
    with pytest.raises(EventRefusedError) as refused, engine.begin() as connection:
        publish(
            connection,
            event_type="user.password_reset_requested",
            aggregate_id="u1",
            payload={"user_id": "u2", "reset_token": "t"},
            routes=routes,
        )
    assert refused.value.field == "event" and refused.value.route == "password_reset"
    assert "user u2 is not account u1" in str(refused.value)
    assert seen[0].event_type == "user.password_reset_requested" and seen[0].event_version == 1
    silent = _routes("password_reset", authorize=lambda event: False)
    with pytest.raises(EventRefusedError, match="no reason given"), engine.begin() as connection:
        publish_many(
            connection,
            [
                {
                    "event_type": "user.password_reset_requested",
                    "aggregate_id": "u3",
                    "payload": {"user_id": "u3", "reset_token": "t"},
                }
            ],
            routes=silent,
        )
    assert _count(engine) == 1


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(limit=st.integers(1, 6), attempts=st.integers(0, 9))
def test_exactly_the_limit_gets_through(engine, limit: int, attempts: int) -> None:
    routes = _routes("password_reset", rate_limit=RateLimit(max_events=limit, per_s=600))
    account = f"acct-{uuid.uuid4().hex}"  # hypothesis shares the database between examples
    accepted = 0
    for _ in range(attempts):
        try:
            with engine.begin() as connection:
                _reset(connection, account, routes=routes)
            accepted += 1
        except RateLimitedError as error:
            assert error.field == "aggregate_id" and 0 < error.retry_after_s <= 600
    assert accepted == min(limit, attempts) == _count(engine, aggregate_id=account)


def test_a_rate_limit_must_allow_something():
    with pytest.raises(ValueError, match="max_events >= 1"):
        RateLimit(max_events=0, per_s=60)
