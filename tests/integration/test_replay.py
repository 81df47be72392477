"""Replays settle exactly what they should: discarded stays discarded, event-level and
suppressed dead letters are closed, and two publishes under one idempotency key send once.
"""

from contextlib import contextmanager

from click.testing import CliRunner
from dagster import DagsterInstance, execute_job, reconstructable

from email_platform import CancelStatus, cancel
from email_platform.cli import main
from email_platform.common.timeutil import utcnow
from email_platform.operating.admin import discard_dead_letters, requeue_dead_letters
from email_platform.publishing import publisher
from email_platform.resources import RoutingResource
from email_platform.store import dead_letters, suppressions
from tests.support import (
    dead_letters_of,
    event,
    messages_of,
    reexecuted,
    routes_ahead,
    run_send,
    sandbox_messages,
    signup,
)


def _send_job():
    from email_platform.definitions import build_definitions

    return build_definitions().get_job_def("send_email_job")


@contextmanager
def _a_failed_run(engine, database_url, sandbox, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """Two signups whose sends fail twice (one retry allowed): a send run that failed with
    both dead-lettered. Yields the job, its instance, the failed run and the two event ids."""
    monkeypatch.setenv("EMAIL_PLATFORM_DATABASE_URL", database_url)
    monkeypatch.setenv("EMAIL_PLATFORM_SANDBOX_BASE_URL", sandbox.base_url)
    monkeypatch.setenv(
        "EMAIL_PLATFORM_LANES", '{"transactional": {"retry_delay_s": 0.01, "max_retries": 1}}'
    )
    keep = signup(engine, "u1", email="u1+503x2@example.com")
    drop = signup(engine, "u2", email="u2+503x2@example.com")
    (tmp_path / "dagster").mkdir()
    job = reconstructable(_send_job)
    with DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:
        config = {
            "ops": {
                "send_email_batch": {"config": {"lane": "transactional", "event_ids": [keep, drop]}}
            }
        }
        with execute_job(job, instance=instance, run_config=config) as failed:
            assert not failed.success
        yield job, instance, failed, keep, drop


def test_reexecution_does_not_resend_a_discarded_dead_letter(
    engine, database_url, sandbox, tmp_path, monkeypatch
):
    with _a_failed_run(engine, database_url, sandbox, tmp_path, monkeypatch) as failing:
        job, instance, failed, keep, drop = failing
        (dropped,) = dead_letters_of(engine, drop)
        assert discard_dead_letters(engine, [dropped.dead_letter_id]) == 1
        with reexecuted(job, instance, failed.run_id) as replayed:
            assert replayed.success
    assert messages_of(engine, keep)[0].status == "sent"
    assert messages_of(engine, drop)[0].status == "dead"
    assert dead_letters_of(engine, drop)[0].status == "discarded"
    assert event(engine, drop).status == "dead"
    assert [m["metadata"]["event_id"] for m in sandbox_messages(sandbox.base_url)] == [keep]


def test_cli_replay_closes_an_event_level_dead_letter_once_routable(engine, database_url, sandbox):
    with engine.begin() as connection:
        newer = publisher.publish(
            connection,
            event_type="user.signed_up",
            event_version=3,
            aggregate_id="u1",
            payload={"user_id": "u1", "email": "u1@example.com", "first_name": "Ada"},
            routes=routes_ahead("user.signed_up", 3),  # a producer ahead of the worker
        )
    assert not run_send(database_url, sandbox.base_url, "transactional", [newer]).success
    (letter,) = dead_letters_of(engine, newer)
    assert letter.reason == "unknown_event_version" and letter.message_id is None
    requeue_dead_letters(engine, [letter])
    # The deployment now routes v3.
    routing = RoutingResource(routes_factory="tests.support:routes_with_signup_v3")
    assert run_send(
        database_url, sandbox.base_url, "transactional", [newer], routing=routing
    ).success
    assert dead_letters_of(engine, newer)[0].status == "replayed"
    assert messages_of(engine, newer)[0].status == "sent"
    assert event(engine, newer).status == "done"


def test_replay_of_an_address_suppressed_meanwhile_closes_the_letter(engine, database_url, sandbox):
    event_id = signup(engine, "u1", email="u1+500x9@example.com")
    lanes = {"transactional": {"retry_delay_s": 0.01, "max_retries": 0}}
    assert not run_send(
        database_url, sandbox.base_url, "transactional", [event_id], lanes=lanes
    ).success
    with engine.begin() as connection:
        suppressions.add(
            connection, "u1+500x9@example.com", reason="complaint", source="test", now=utcnow()
        )
        letters = dead_letters.list_letters(connection)
    requeue_dead_letters(engine, letters)
    assert run_send(database_url, sandbox.base_url, "transactional", [event_id]).success
    assert messages_of(engine, event_id)[0].status == "suppressed"
    assert dead_letters_of(engine, event_id)[0].status == "suppressed"
    assert sandbox_messages(sandbox.base_url) == []


def test_two_publishes_with_one_idempotency_key_send_one_mail(engine, database_url, sandbox):
    ids = []
    for attempt in range(2):  # a producer retrying its request publishes twice
        with engine.begin() as connection:
            ids.append(
                publisher.publish(
                    connection,
                    event_type="order.paid",
                    aggregate_id="o1",
                    idempotency_key="order-o1-paid",
                    payload={
                        "order_id": "o1",
                        "email": "a@example.com",
                        "first_name": "A",
                        "items": [],
                        "total": 0,
                        "currency": "EUR",
                        "try": attempt,
                    },
                )
            )
    # One event per key: the retry got the first event's id and wrote nothing.
    assert ids[0] == ids[1]
    assert event(engine, ids[0]).payload["try"] == 0
    assert run_send(database_url, sandbox.base_url, "transactional", ids[:1]).success
    (message,) = messages_of(engine, ids[0])
    assert message.status == "sent"
    (seen,) = sandbox_messages(sandbox.base_url)
    assert seen["idempotency_key"] == "order-o1-paid:receipt"
    assert event(engine, ids[0]).status == "done"


def test_a_cancelled_dead_event_is_replayed_by_neither_the_dlq_nor_a_reexecution(
    engine, database_url, sandbox, tmp_path, monkeypatch
):
    with _a_failed_run(engine, database_url, sandbox, tmp_path, monkeypatch) as failing:
        job, instance, failed, keep, drop = failing
        assert event(engine, drop).status == "dead"
        # The producer takes it back while it waits for an operator.
        with engine.begin() as connection:
            result = cancel(connection, event_id=drop)
        assert result.status is CancelStatus.CANCELLED and result.event_status == "cancelled"
        (letter,) = dead_letters_of(engine, drop)
        assert letter.status == "discarded"
        replay = CliRunner().invoke(
            main, ["dlq", "replay", str(letter.dead_letter_id), "--url", database_url]
        )
        assert replay.exit_code == 0 and "no open dead letters matched" in replay.output
        with reexecuted(job, instance, failed.run_id) as replayed:
            assert replayed.success
    assert messages_of(engine, keep)[0].status == "sent"
    assert event(engine, drop).status == "cancelled"
    assert [m["metadata"]["event_id"] for m in sandbox_messages(sandbox.base_url)] == [keep]
