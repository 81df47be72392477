"""Run keys through a real ``dagster-daemon`` in batch mode (``workers: 0``), on SQLite and
PostgreSQL: a batch run whose key was already requested is not launched again, when the lane's
sensor re-evaluates the same events and when the daemon has been restarted.

The sensor marks the events it requests (``requested_at``, ``request_count``) in the same
transaction as it reads them, so it asks for a batch once; the key is Dagster's gate behind
that. To make the sensor see the same events again, the test takes the marks back (as a
restore of the outbox, or a commit lost in a failover, would): the sensor then yields the very
key of the run that sent them, and Dagster must skip it, its dedupe living in the instance's
run storage, not in the daemon's memory.
"""

import json
from collections import Counter
from pathlib import Path

from dagster import DagsterInstance, RunsFilter
from sqlalchemy import Engine, select, update

from email_platform.db.schema import email_outbox
from email_platform.local.dagster_home import DaemonProcess, prepare_home, wait_for
from email_platform.sensors.outbox import batch_run_key
from tests.support import publish_one, sandbox_stats

BATCH = 5
# Bulk in batch mode; no warm critical worker (nothing but the batch runs launches).
LANES = {"bulk": {"workers": 0, "batch_size": BATCH}, "critical": {"warm_workers": 0}}


def _send_runs(home: Path) -> list:  # type: ignore[type-arg]
    with DagsterInstance.from_config(str(home)) as instance:
        return instance.get_runs(RunsFilter(job_name="send_email_job"))


def _statuses(engine: Engine, ids: list[str]) -> Counter:  # type: ignore[type-arg]
    with engine.connect() as connection:
        rows = connection.execute(
            select(email_outbox.c.status).where(email_outbox.c.event_id.in_(ids))
        ).all()
    return Counter(row.status for row in rows)


def _requested(engine: Engine, ids: list[str]) -> bool:
    with engine.connect() as connection:
        rows = connection.execute(
            select(email_outbox.c.requested_at).where(email_outbox.c.event_id.in_(ids))
        ).all()
    return all(row.requested_at is not None for row in rows)


def _lose_the_marks(engine: Engine, ids: list[str]) -> None:
    """The outbox as it was before the sensor requested the batch: pending, never requested."""
    with engine.begin() as connection:
        connection.execute(
            update(email_outbox)
            .where(email_outbox.c.event_id.in_(ids))
            .values(status="pending", requested_at=None, request_count=0)
        )


def _skipped(log: Path, key: str) -> bool:
    """The daemon's own line for a run request it dropped because its key was seen."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return any(
        "Skipping 1 run for sensor bulk_outbox_sensor already completed" in line
        and json.dumps([key]) in line
        for line in text.splitlines()
    )


def test_a_batch_whose_key_was_requested_is_not_launched_again_even_after_a_restart(
    engine, database_url, sandbox, tmp_path
):
    home = tmp_path / "dagster"
    prepare_home(home)
    env = {
        "EMAIL_PLATFORM_DATABASE_URL": database_url,
        "EMAIL_PLATFORM_PROVIDER": "sandbox",
        "EMAIL_PLATFORM_SANDBOX_BASE_URL": sandbox.base_url,
        "EMAIL_PLATFORM_LANES": json.dumps(LANES),
    }
    ids = sorted(
        publish_one(
            engine,
            event_type="digest.ready",
            aggregate_id=f"k{i}",
            payload={"email": f"k{i}@example.org", "first_name": "Kay", "highlights": ["a"]},
        )
        for i in range(BATCH)
    )
    key = batch_run_key("bulk", ids, 0)
    first_log, second_log = tmp_path / "daemon-1.log", tmp_path / "daemon-2.log"

    with DaemonProcess(home, env, log_path=first_log) as daemon:
        # The batch is requested once and sent by one run under its key.
        assert wait_for(lambda: _statuses(engine, ids) == Counter({"done": BATCH}), 90), (
            _statuses(engine, ids),
            daemon.log_path.read_text()[-3000:],
        )
        (run,) = _send_runs(home)
        assert run.tags["dagster/run_key"] == key
        # The sensor sees the same events again and asks for the same key: Dagster skips it.
        _lose_the_marks(engine, ids)
        assert wait_for(lambda: _skipped(first_log, key), 60), first_log.read_text()[-3000:]
        assert _requested(engine, ids)  # the sensor did request them again
        assert [r.run_id for r in _send_runs(home)] == [run.run_id]

    # A new daemon process, nothing in memory: the key is still known and still skipped.
    _lose_the_marks(engine, ids)
    with DaemonProcess(home, env, log_path=second_log):
        assert wait_for(lambda: _skipped(second_log, key), 60), second_log.read_text()[-3000:]
        assert [r.run_id for r in _send_runs(home)] == [run.run_id]

    stats = sandbox_stats(sandbox.base_url)
    assert stats["accepted"] == BATCH and stats["repeated_keys"] == 0
