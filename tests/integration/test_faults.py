"""A run worker killed mid-send: the run-failure sensor releases its claim and the next run
sends every message exactly once, the provider's idempotency key closing the window in which
the dead worker's request was accepted but never recorded (docs/design.md invariants 2 and 3).
"""

import multiprocessing
import os
import signal
import time
from pathlib import Path

from dagster import (
    DagsterInstance,
    RunsFilter,
)

from email_platform.sandbox.server import SandboxConfig, SandboxServer
from tests.support import (
    attempts_of,
    event,
    report_failed_and_release,
    run_send,
    sandbox_messages,
    sandbox_stats,
    signup,
)


def _send_in_child(database_url: str, sandbox_url: str, ids: list[str], home: str) -> None:
    with DagsterInstance.from_config(home) as instance:
        run_send(database_url, sandbox_url, "transactional", ids, instance=instance)


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_killed_worker_releases_its_claim_and_nothing_is_sent_twice(
    engine, database_url, tmp_path: Path
):
    home = tmp_path / "dagster"
    home.mkdir()
    # The provider accepts each message, then stalls before answering.
    ids = [signup(engine, f"u{i}", email=f"u{i}+accepttimeoutx1@example.com") for i in range(5)]
    with SandboxServer(SandboxConfig(timeout_delay_s=30)) as sandbox_url:
        child = multiprocessing.get_context("spawn").Process(
            target=_send_in_child, args=(database_url, sandbox_url, ids, str(home))
        )
        child.start()
        # Kill the worker once the provider has accepted all five, before any answer arrived.
        assert _wait(lambda: sandbox_stats(sandbox_url)["accepted"] == 5, 60)
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert all(event(engine, i).status == "in_flight" for i in ids)
        assert all(attempts_of(engine, i) == [] for i in ids)  # accepted, never recorded

        with DagsterInstance.from_config(str(home)) as instance:
            (run,) = instance.get_runs(RunsFilter(job_name="send_email_job"))
            # What run monitoring does for a dead worker: the run is marked failed, and the
            # failure sensor gives its claim back.
            report_failed_and_release(instance, run, database_url)
        assert all(event(engine, i).status == "pending" for i in ids)

        assert run_send(database_url, sandbox_url, "transactional", ids).success
        stats = sandbox_stats(sandbox_url)
        keys = [m["idempotency_key"] for m in sandbox_messages(sandbox_url)]
    assert sorted(keys) == sorted(f"{i}:welcome" for i in ids)  # five messages, not ten
    assert stats["accepted"] == 5 and stats["repeated_keys"] == 5
    for event_id in ids:
        assert event(engine, event_id).status == "done"
        assert [a.outcome for a in attempts_of(engine, event_id)] == ["accepted"]


def test_a_batch_run_killed_holding_claims_is_failed_once_its_leases_lapse(
    engine, database_url, tmp_path: Path
):
    """The default run launcher never notices a killed run process: the run would show as
    running forever. Once its claims' leases lapse unrenewed, the lane sensor marks it failed
    and requests its events again."""
    from datetime import timedelta

    from dagster import DagsterRunStatus, SensorResult, build_sensor_context
    from sqlalchemy import update

    from email_platform.common.lanes import Lane
    from email_platform.common.timeutil import utcnow
    from email_platform.db.schema import email_outbox
    from email_platform.resources import AppDatabase, LanePolicy
    from email_platform.sensors.outbox import make_outbox_sensor

    home = tmp_path / "dagster"
    home.mkdir()
    ids = [signup(engine, f"u{i}", email=f"u{i}+accepttimeoutx1@example.com") for i in range(3)]
    with SandboxServer(SandboxConfig(timeout_delay_s=30)) as sandbox_url:
        child = multiprocessing.get_context("spawn").Process(
            target=_send_in_child, args=(database_url, sandbox_url, ids, str(home))
        )
        child.start()
        assert _wait(lambda: sandbox_stats(sandbox_url)["accepted"] == 3, 60)
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    resources = {
        "email_database": AppDatabase(url=database_url),
        "email_lanes": LanePolicy(overrides_json='{"transactional": {"workers": 0}}'),
    }
    with DagsterInstance.from_config(str(home)) as instance:
        # Within its leases the run is left alone: its process might be alive.
        with build_sensor_context(instance=instance, resources=resources) as context:
            make_outbox_sensor(Lane.TRANSACTIONAL)(context)
        (run,) = instance.get_runs(RunsFilter(job_name="send_email_job"))
        assert run.status == DagsterRunStatus.STARTED
    # Time passes with no one renewing: the leases lapse.
    with engine.begin() as connection:
        connection.execute(
            update(email_outbox).values(lease_expires_at=utcnow() - timedelta(seconds=1))
        )
    with DagsterInstance.from_config(str(home)) as instance:
        with build_sensor_context(instance=instance, resources=resources) as context:
            result = make_outbox_sensor(Lane.TRANSACTIONAL)(context)
        assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.FAILURE
        assert isinstance(result, SensorResult)
        (request,) = result.run_requests
        assert request.run_config["ops"]["send_email_batch"]["config"]["event_ids"] == sorted(ids)


def test_events_whose_run_waits_in_the_queue_are_not_requested_again(engine, database_url):
    """Found by the fault harness: on a full run queue, a batch's run waited past the lane's
    ``request_timeout_s`` and its events were requested again, each time in a run that would
    claim nothing; those runs filled the queue further, and batch mode moved a few events a
    second. A queued run's events wait for it; once it is gone they are requested again.

    And while a run of the lane waits in the queue, only full batches are requested: the
    harness's batch drain queued one small run per lane per tick (critical runs of 21 events,
    bulk of 97 where 200 fit), each two process starts, and sent 3 events a second with no
    fault at all."""
    from datetime import timedelta

    from dagster import DagsterRunStatus, SensorResult, SkipReason, build_sensor_context
    from sqlalchemy import update

    from email_platform.common.lanes import Lane
    from email_platform.common.timeutil import utcnow
    from email_platform.db.schema import email_outbox
    from email_platform.definitions import defs
    from email_platform.jobs import send_run_config
    from email_platform.resources import AppDatabase, LanePolicy
    from email_platform.sensors.outbox import (
        STARTUP_GRACE_S,
        awaited_event_ids,
        lane_send_runs,
        make_outbox_sensor,
    )

    resources = {
        "email_database": AppDatabase(url=database_url),
        "email_lanes": LanePolicy(
            overrides_json=(
                '{"transactional": {"workers": 0, "request_timeout_s": 1, "batch_size": 2}}'
            )
        ),
    }

    def tick(instance):  # type: ignore[no-untyped-def]
        with build_sensor_context(instance=instance, resources=resources) as context:
            return make_outbox_sensor(Lane.TRANSACTIONAL)(context)

    def event_ids(result) -> list[list[str]]:  # type: ignore[no-untyped-def]
        assert isinstance(result, SensorResult), result
        return [
            r.run_config["ops"]["send_email_batch"]["config"]["event_ids"]
            for r in result.run_requests
        ]

    def age_requests() -> None:
        with engine.begin() as connection:
            connection.execute(
                update(email_outbox).values(requested_at=utcnow() - timedelta(seconds=30))
            )

    def awaited(lane: str, now_ts: float) -> set[str]:
        return awaited_event_ids(lane_send_runs(instance, lane), now_ts)

    waiting = sorted(signup(engine, f"u{i}") for i in range(2))
    with DagsterInstance.ephemeral() as instance:
        (request,) = tick(instance).run_requests
        assert event_ids(SensorResult(run_requests=[request])) == [waiting]
        queued = _queue(instance, "send_email_job", request)
        age_requests()
        assert isinstance(tick(instance), SkipReason)  # its run will claim them
        first = signup(engine, "u7")
        held = tick(instance)  # a partial batch would only queue behind it
        assert isinstance(held, SkipReason) and "1 due transactional" in (held.skip_message or "")
        second, third = signup(engine, "u8"), signup(engine, "u9")
        assert event_ids(tick(instance)) == [[first, second]]  # a full batch goes out
        # However long it has queued; a run created but never queued is given the grace.
        later = time.time() + STARTUP_GRACE_S + 5
        assert awaited("transactional", later) == set(waiting)
        instance.report_run_failed(queued)  # its run is gone: requested again, and the queue
        age_requests()  # is empty, so the partial batch goes out too
        assert event_ids(tick(instance)) == [waiting, [first, second], [third]]
        instance.create_run_for_job(
            defs.get_job_def("send_email_job"),
            run_config=send_run_config("transactional", [third]),
            tags={"email/lane": "transactional"},
            status=DagsterRunStatus.NOT_STARTED,
        )
        assert awaited("transactional", time.time()) == {third}
        assert awaited("bulk", time.time()) == set()
        assert awaited("transactional", later) == set()


def test_stored_webhooks_wait_for_a_full_batch_while_an_ingestion_run_is_queued(
    engine, database_url
):
    """The webhook inbox sensor batches as the outbox sensors do: with an ingestion run in the
    queue it requests only full batches of ``BATCH_SIZE``; once the queue is empty the rest
    goes out at once."""
    from dagster import SensorResult, SkipReason, build_sensor_context

    from email_platform.common.timeutil import utcnow
    from email_platform.resources import AppDatabase
    from email_platform.sensors.webhooks import BATCH_SIZE, webhook_inbox_sensor
    from email_platform.store import inbox

    resources = {"email_database": AppDatabase(url=database_url)}

    def store(n: int) -> list[int]:
        with engine.begin() as connection:
            return [
                inbox.store(
                    connection,
                    provider="sandbox",
                    delivery_id=None,
                    headers={},
                    body="{}",
                    now=utcnow(),
                )
                for _ in range(n)
            ]

    def tick(instance):  # type: ignore[no-untyped-def]
        with build_sensor_context(instance=instance, resources=resources) as context:
            return webhook_inbox_sensor(context)

    def inbox_ids(result) -> list[list[int]]:  # type: ignore[no-untyped-def]
        assert isinstance(result, SensorResult), result
        return [
            r.run_config["ops"]["ingest_webhook_batch"]["config"]["inbox_ids"]
            for r in result.run_requests
        ]

    first = store(3)
    with DagsterInstance.ephemeral() as instance:
        (request,) = tick(instance).run_requests
        assert inbox_ids(SensorResult(run_requests=[request])) == [first]
        queued = _queue(instance, "ingest_webhooks_job", request)
        later = store(2)
        held = tick(instance)
        assert isinstance(held, SkipReason) and "2 stored webhook(s)" in (held.skip_message or "")
        later += store(BATCH_SIZE)
        assert inbox_ids(tick(instance)) == [later[:BATCH_SIZE]]
        instance.report_run_failed(queued)
        assert inbox_ids(tick(instance)) == [later[BATCH_SIZE:]]


def test_webhooks_of_an_ingestion_run_that_died_before_its_claim_are_requested_again_at_once(
    engine, database_url
):
    """An ingestion run that fails before it claims anything (its process killed while it
    started, the code server gone) gives its stored webhooks back through the run-failure
    sensor, as a send run gives back its events: the next inbox tick requests them again
    instead of after the sensor's request timeout (five minutes, seen in the fault drain)."""
    from dagster import SensorResult, build_sensor_context

    from email_platform.common.timeutil import utcnow
    from email_platform.resources import AppDatabase
    from email_platform.sensors.webhooks import webhook_inbox_sensor
    from email_platform.store import inbox

    resources = {"email_database": AppDatabase(url=database_url)}
    with engine.begin() as connection:
        ids = [
            inbox.store(
                connection,
                provider="sandbox",
                delivery_id=None,
                headers={},
                body="{}",
                now=utcnow(),
            )
            for _ in range(3)
        ]

    def tick(instance):  # type: ignore[no-untyped-def]
        with build_sensor_context(instance=instance, resources=resources) as context:
            return webhook_inbox_sensor(context)

    with DagsterInstance.ephemeral() as instance:
        (request,) = tick(instance).run_requests
        assert not isinstance(tick(instance), SensorResult)  # requested: it waits for its run
        run = _queue(instance, "ingest_webhooks_job", request)
        report_failed_and_release(instance, run, database_url)
        again = tick(instance)
        assert isinstance(again, SensorResult), again
        (retried,) = again.run_requests
        assert retried.run_config == request.run_config
        assert retried.run_key != request.run_key
        assert ids == retried.run_config["ops"]["ingest_webhook_batch"]["config"]["inbox_ids"]


def _queue(instance, job_name: str, request):  # type: ignore[no-untyped-def]
    """A run of ``request`` waiting in the run queue, as the daemon's queue holds one."""
    from dagster import DagsterRunStatus

    from email_platform.definitions import defs

    return instance.create_run_for_job(
        defs.get_job_def(job_name),
        run_config=request.run_config,
        tags=request.tags,
        status=DagsterRunStatus.QUEUED,
        remote_job_origin=_job_origin(job_name),
    )


def _job_origin(job_name: str):  # type: ignore[no-untyped-def]
    """A queued run must name where its job comes from (the daemon launches it from there)."""
    from dagster._core.remote_origin import (
        InProcessCodeLocationOrigin,
        RemoteJobOrigin,
        RemoteRepositoryOrigin,
    )
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

    location = InProcessCodeLocationOrigin(
        LoadableTargetOrigin(module_name="email_platform.definitions")
    )
    return RemoteJobOrigin(RemoteRepositoryOrigin(location, "__repository__"), job_name)


def test_a_killed_batch_run_holding_nothing_is_failed_after_the_startup_grace(
    engine, database_url, tmp_path: Path
):
    """Found by the fault harness: a batch run killed after what it held was taken over (or
    before it claimed) holds no lease to lapse, so it showed as running for good and filled
    one of the run queue's slots; seven of them starved batch mode."""
    import time
    from datetime import timedelta

    from dagster import DagsterRunStatus
    from sqlalchemy import update

    from email_platform.common.timeutil import utcnow
    from email_platform.db.schema import email_outbox
    from email_platform.sensors.outbox import (
        STARTUP_GRACE_S,
        lane_send_runs,
        report_idle_send_runs,
    )

    home = tmp_path / "dagster"
    home.mkdir()
    ids = [signup(engine, f"u{i}", email=f"u{i}+accepttimeoutx1@example.com") for i in range(2)]
    with SandboxServer(SandboxConfig(timeout_delay_s=30)) as sandbox_url:
        child = multiprocessing.get_context("spawn").Process(
            target=_send_in_child, args=(database_url, sandbox_url, ids, str(home))
        )
        child.start()
        assert _wait(lambda: sandbox_stats(sandbox_url)["accepted"] == 2, 60)
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    later = time.time() + STARTUP_GRACE_S + 5
    with DagsterInstance.from_config(str(home)) as instance:
        (run,) = instance.get_runs(RunsFilter(job_name="send_email_job"))

        def runs(lane: str):  # type: ignore[no-untyped-def]
            return lane_send_runs(instance, lane)

        with engine.connect() as connection:
            # Holding its events (within their leases), it is left alone however old.
            assert report_idle_send_runs(instance, connection, runs("transactional"), later) == 0
        with engine.begin() as connection:  # another run took them over
            connection.execute(
                update(email_outbox).values(
                    claimed_by="its-successor", lease_expires_at=utcnow() + timedelta(seconds=60)
                )
            )
        with engine.connect() as connection:
            # Within the startup grace it might still be about to claim.
            assert (
                report_idle_send_runs(instance, connection, runs("transactional"), time.time()) == 0
            )
            assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.STARTED
            assert (
                report_idle_send_runs(instance, connection, runs("bulk"), later) == 0
            )  # its lane only
            assert report_idle_send_runs(instance, connection, runs("transactional"), later) == 1
        assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.FAILURE
