"""Retention: the purge deletes finished rows past their retention in bounded transactions,
children before parents, and never anything pending, in flight, open or suppressing; a dry run
counts exactly what a real one deletes; the Dagster job and schedule, its run-history purge,
and the CLI run the same purge."""

import json
from datetime import UTC, timedelta

import pytest
from click.testing import CliRunner
from dagster import DagsterInstance, DagsterRun, DagsterRunStatus
from dagster._core.storage.compute_log_manager import ComputeIOType
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import event as sa_event
from sqlalchemy import func, insert, select, update

from email_platform.cli import main
from email_platform.common import config
from email_platform.common.config import RetentionSettings
from email_platform.common.errors import ConfigurationError
from email_platform.common.timeutil import utcnow
from email_platform.db.schema import (
    dead_letters,
    email_attempts,
    email_event_deletions,
    email_events,
    email_messages,
    email_outbox,
    suppressions,
    webhook_inbox,
)
from email_platform.operating import retention
from email_platform.store import circuits
from tests.hostile_support import hostile_settings
from tests.support import publish_one, run_send

DAY = timedelta(days=1)
TABLES = (
    dead_letters,
    email_attempts,
    email_event_deletions,
    email_events,
    email_messages,
    email_outbox,
    suppressions,
    webhook_inbox,
)


# ---- rows written straight into the tables, each state the purge must tell apart ------------


class Rows:
    """Writes outbox events with messages, attempts and provider events at chosen ages."""

    def __init__(self, connection) -> None:  # type: ignore[no-untyped-def]
        self.connection = connection
        self.now = utcnow()
        self.n = 0

    def event(
        self,
        status: str,
        *,
        age_days: float,
        messages: int = 1,
        attempts: int = 1,
        provider_events: int = 1,
        dedupe: bool = False,
        message_status: str = "sent",
    ) -> str:
        self.n += 1
        event_id = f"01RETENTION{self.n:015d}"
        at = self.now - timedelta(days=age_days)
        self.connection.execute(
            insert(email_outbox).values(
                event_id=event_id,
                event_type="digest.ready",
                event_version=1,
                aggregate_id=f"a{self.n}",
                occurred_at=at,
                published_at=at,
                available_at=at,
                payload={"email": f"p{self.n}@example.com"},
                event_metadata={},
                lane="bulk",
                status=status,
                done_at=at if status in ("done", "dead", "cancelled") else None,
            )
        )
        for m in range(messages):
            message_id = self.connection.execute(
                insert(email_messages)
                .values(
                    event_id=event_id,
                    route=f"r{m}",
                    template="weekly_digest",
                    template_version=1,
                    lane="bulk",
                    recipient=f"p{self.n}@example.com",
                    idempotency_key=f"{event_id}:r{m}",
                    dedupe_key=f"r{m}:{event_id}" if dedupe else None,
                    status=message_status,
                    created_at=at,
                    updated_at=at,
                )
                .returning(email_messages.c.message_id)
            ).scalar_one()
            for a in range(attempts):
                self.connection.execute(
                    insert(email_attempts).values(
                        message_id=message_id,
                        event_id=event_id,
                        attempt_no=a + 1,
                        started_at=at,
                        finished_at=at,
                        outcome="accepted",
                    )
                )
            for p in range(provider_events):
                self.provider_event(at, event_id=event_id, message_id=message_id, key=f"{m}.{p}")
        return event_id

    def provider_event(self, at, *, event_id=None, message_id=None, key="") -> None:  # type: ignore[no-untyped-def]
        self.n += 1
        self.connection.execute(
            insert(email_events).values(
                provider="sandbox",
                provider_event_id=f"pe{self.n}{key}",
                event_type="delivered",
                occurred_at=at,
                received_at=at,
                event_id=event_id,
                message_id=message_id,
            )
        )

    def letter(self, event_id: str, status: str, *, resolved_age_days: float | None) -> None:
        resolved = None if resolved_age_days is None else self.now - resolved_age_days * DAY
        self.connection.execute(
            insert(dead_letters).values(
                event_id=event_id,
                message_id=None,
                lane="bulk",
                reason="rejected",
                attempts=1,
                status=status,
                created_at=self.now - 400 * DAY,
                resolved_at=resolved,
            )
        )

    def webhook(self, status: str, *, age_days: float) -> None:
        self.n += 1
        self.connection.execute(
            insert(webhook_inbox).values(
                provider="sandbox",
                delivery_id=f"d{self.n}",
                headers={},
                body="{}",
                status=status,
                received_at=self.now - age_days * DAY,
            )
        )


def _counts(engine) -> dict[str, int]:  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        return {
            table.name: connection.execute(select(func.count()).select_from(table)).scalar()
            for table in TABLES
        }


def _event_ids(engine) -> set[str]:  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        return set(connection.execute(select(email_outbox.c.event_id)).scalars())


def _landscape(engine) -> dict[str, list[str]]:  # type: ignore[no-untyped-def]
    """Old finished rows to go, and every row the purge must keep, in one database."""
    with engine.begin() as connection:
        rows = Rows(connection)
        gone = [rows.event("done", age_days=100, attempts=2) for _ in range(5)]
        gone.append(rows.event("cancelled", age_days=95, provider_events=0))
        # Its letter was resolved 200 days ago: past the dead letters' 180, so both go.
        old_dead = rows.event("dead", age_days=300, message_status="dead")
        rows.letter(old_dead, "discarded", resolved_age_days=200)
        gone.append(old_dead)
        kept = {
            "young done": rows.event("done", age_days=10),
            "old pending": rows.event("pending", age_days=100, provider_events=0),
            "old in flight": rows.event("in_flight", age_days=100, provider_events=0),
            "dedupe key": rows.event("done", age_days=100, dedupe=True),
            "open letter": rows.event("dead", age_days=100, message_status="dead"),
            "young letter": rows.event("dead", age_days=300, message_status="dead"),
        }
        rows.letter(kept["open letter"], "open", resolved_age_days=None)
        rows.letter(kept["young letter"], "discarded", resolved_age_days=100)
        for _ in range(3):
            rows.webhook("processed", age_days=91)
        rows.webhook("processed", age_days=5)
        rows.webhook("pending", age_days=200)
        rows.webhook("malformed", age_days=200)
        rows.webhook("in_flight", age_days=200)
        rows.provider_event(rows.now - 100 * DAY)  # never matched to a message: an orphan
        rows.provider_event(rows.now - 5 * DAY)  # young orphan, kept
        connection.execute(
            insert(email_event_deletions).values(
                email_event_id=999_999, received_at=rows.now, deleted_at=rows.now - 100 * DAY
            )
        )
        connection.execute(
            insert(suppressions).values(
                address="old@example.com",
                reason="hard_bounce",
                source="test",
                created_at=rows.now - 900 * DAY,
            )
        )
    return {"gone": gone, "kept": list(kept.values())}


EXPECTED = {
    "dead_letters": 1,
    # Five done events with two attempts each, one cancelled and one dead with one each.
    "email_attempts": 12,
    # One per message but the cancelled one's, plus the old orphan.
    "email_events": 7,
    "email_messages": 7,
    "email_outbox": 7,
    "webhook_inbox": 3,
    "email_event_deletions": 1,
}


def test_purge_deletes_old_finished_rows_in_batches_and_keeps_everything_else(engine):
    made = _landscape(engine)
    before = _counts(engine)
    settings = RetentionSettings(batch_size=2)

    dry = retention.purge(engine, settings, dry_run=True)
    assert dry.counts == EXPECTED
    assert _counts(engine) == before  # a dry run changes nothing

    commits: list[int] = []

    def count_commit(_connection) -> None:  # type: ignore[no-untyped-def]
        commits.append(1)

    sa_event.listen(engine, "commit", count_commit)
    report = retention.purge(engine, settings)
    sa_event.remove(engine, "commit", count_commit)
    assert report.counts == dry.counts == EXPECTED
    # batch_size 2: letters 1 (1 row), events 4 (2+2+2+1), orphans 1, inbox 2 (2+1),
    # deletion records 1; each its own transaction, plus the expiry sweep's one.
    assert report.batches == 9
    assert len(commits) == report.batches + 1

    after = _counts(engine)
    assert {name: before[name] - after[name] for name in before} == {
        **EXPECTED,
        "suppressions": 0,
    }
    remaining = _event_ids(engine)
    assert remaining == set(made["kept"])
    with engine.connect() as connection:
        statuses = sorted(connection.execute(select(webhook_inbox.c.status)).scalars())
        letters = sorted(connection.execute(select(dead_letters.c.status)).scalars())
        # The trigger's records of the purge's own deletions went with them.
        deletion_records = connection.execute(select(email_event_deletions)).all()
        # The kept events keep their children.
        kept_messages = connection.execute(
            select(func.count()).select_from(email_messages)
        ).scalar()
    assert statuses == ["in_flight", "malformed", "pending", "processed"]
    assert letters == ["discarded", "open"]
    assert deletion_records == []
    assert kept_messages == len(made["kept"])

    again = retention.purge(engine, settings)
    assert again.total == 0 and _event_ids(engine) == remaining


def test_a_dedupe_retention_lets_old_key_holders_go(engine):
    with engine.begin() as connection:
        rows = Rows(connection)
        old = rows.event("done", age_days=400, dedupe=True)
        recent = rows.event("done", age_days=100, dedupe=True)
    report = retention.purge(engine, RetentionSettings(dedupe_days=365))
    assert report.counts["email_outbox"] == 1
    assert _event_ids(engine) == {recent} and old not in _event_ids(engine)


def test_purge_after_real_sends_keeps_the_dead_letter_until_it_is_resolved_and_old(
    engine, database_url, sandbox
):
    from email_platform.operating.admin import discard_dead_letters

    ids = [
        publish_one(
            engine,
            event_type="digest.ready",
            aggregate_id=f"d{i}",
            payload={"email": address, "first_name": "Jo", "highlights": ["a"]},
        )
        for i, address in enumerate(["d0@example.org", "d1@example.org", "d2+reject@example.org"])
    ]
    assert not run_send(database_url, sandbox.base_url, "bulk", ids).success  # one rejected
    with engine.begin() as connection:  # all of it finished 100 days ago
        connection.execute(update(email_outbox).values(done_at=utcnow() - 100 * DAY))
    report = retention.purge(engine, RetentionSettings())
    assert report.counts["email_outbox"] == 2 and report.counts["email_messages"] == 2
    assert report.counts["email_attempts"] == 2
    assert _event_ids(engine) == {ids[2]}  # its dead letter is open

    with engine.connect() as connection:
        (letter_id,) = connection.execute(select(dead_letters.c.dead_letter_id)).scalars()
    assert discard_dead_letters(engine, [letter_id]) == 1
    assert retention.purge(engine, RetentionSettings()).total == 0  # resolved only just now
    with engine.begin() as connection:
        connection.execute(update(dead_letters).values(resolved_at=utcnow() - 181 * DAY))
    report = retention.purge(engine, RetentionSettings())
    assert (report.counts["dead_letters"], report.counts["email_outbox"]) == (1, 1)
    assert _counts(engine)["email_attempts"] == 0 and _event_ids(engine) == set()


# ---- Dagster: run history, the job, the schedule ---------------------------------------------


def _backdate_run(instance: DagsterInstance, run_id: str, days: int) -> None:
    from dagster._core.storage.runs.schema import RunsTable

    old = (utcnow() - timedelta(days=days)).astimezone(UTC).replace(tzinfo=None)
    with instance.run_storage.connect() as connection:
        connection.execute(
            RunsTable.update()
            .where(RunsTable.c.run_id == run_id)
            .values(update_timestamp=old, create_timestamp=old)
        )


def test_dagster_runs_past_retention_are_deleted_oldest_first_and_bounded(tmp_path):
    from email_platform.ops.retention import purge_dagster_runs

    with DagsterInstance.local_temp(str(tmp_path)) as instance:
        runs = {}
        for name, status in [
            ("oldest", DagsterRunStatus.FAILURE),
            ("old", DagsterRunStatus.SUCCESS),
            ("old running", DagsterRunStatus.STARTED),
            ("young", DagsterRunStatus.SUCCESS),
        ]:
            run = instance.add_run(DagsterRun(job_name="some_job", status=status))
            runs[name] = run.run_id
        _backdate_run(instance, runs["oldest"], 60)
        _backdate_run(instance, runs["old"], 40)
        _backdate_run(instance, runs["old running"], 90)
        # What a run's step wrote to stderr (a lane worker's per-message JSON lines) goes too.
        captured = {}
        for name, run_id in runs.items():
            key = [run_id, "compute_logs", "step"]
            with instance.compute_log_manager.open_log_stream(key, ComputeIOType.STDERR) as f:
                f.write(f'{{"msg": "accepted by the provider", "run": "{name}"}}\n')
            captured[name] = instance.compute_log_manager.get_log_data(key).stderr
        assert all(captured.values())

        assert purge_dagster_runs(instance, older_than_days=30, limit=10, dry_run=True) == 2
        assert len(instance.get_runs()) == 4
        assert purge_dagster_runs(instance, older_than_days=30, limit=1) == 1
        left = {run.run_id for run in instance.get_runs()}
        assert runs["oldest"] not in left and runs["old"] in left
        assert purge_dagster_runs(instance, older_than_days=30, limit=10) == 1
        assert {run.run_id for run in instance.get_runs()} == {
            runs["old running"],
            runs["young"],
        }
        logs_left = {
            name
            for name, run_id in runs.items()
            if instance.compute_log_manager.get_log_data([run_id, "compute_logs", "step"]).stderr
        }
        assert logs_left == {"old running", "young"}


def test_retention_job_purges_and_reports_counts(engine, database_url, monkeypatch, tmp_path):
    from email_platform.definitions import build_definitions
    from email_platform.resources import AppDatabase

    made = _landscape(engine)
    monkeypatch.setenv("EMAIL_PLATFORM_RETENTION_BATCH_SIZE", "3")
    job = build_definitions(email_database=AppDatabase(url=database_url)).get_job_def(
        "retention_job"
    )
    with DagsterInstance.local_temp(str(tmp_path)) as instance:
        with engine.begin() as connection:  # a killed run's circuit row, and a fresh one
            for holder, age_s in [("killed-run", circuits.STALE_S + 60), ("live-run", 1)]:
                circuits.record(
                    connection,
                    provider="sandbox",
                    holder=holder,
                    lane="bulk",
                    state="open",
                    now=utcnow() - timedelta(seconds=age_s),
                )
        old_run = instance.add_run(DagsterRun(job_name="send_email_job"))
        instance.report_run_failed(old_run)
        _backdate_run(instance, old_run.run_id, 31)

        dry = job.execute_in_process(
            instance=instance,
            run_config={"ops": {"purge_retention": {"config": {"dry_run": True}}}},
        )
        assert dry.success
        counted = dry.output_for_node("purge_retention")
        assert counted == {
            **EXPECTED,
            "dead_letters_expired": 0,
            "provider_circuits": 1,
            "dagster_runs": 1,
        }
        assert instance.get_run_by_id(old_run.run_id) is not None
        assert _event_ids(engine) >= set(made["gone"])

        result = job.execute_in_process(instance=instance)
        assert result.success
        assert result.output_for_node("purge_retention") == counted
        assert instance.get_run_by_id(old_run.run_id) is None
        assert instance.get_run_by_id(result.run_id) is not None  # not its own run
        (materialized,) = [
            e
            for e in result.all_events
            if e.event_type_value == "STEP_OUTPUT" and e.step_key == "purge_retention"
        ]
        metadata = materialized.event_specific_data.metadata
        assert metadata["email_outbox"].value == EXPECTED["email_outbox"]
        assert metadata["dry_run"].value is False
    assert _event_ids(engine) == set(made["kept"])
    with engine.connect() as connection:
        assert [v.holder for v in circuits.not_closed(connection, utcnow())] == ["live-run"]
        assert circuits.delete_stale(connection, utcnow(), dry_run=True) == 0


def test_the_retention_schedule_runs_the_job_daily_by_default():
    from email_platform.definitions import defs

    repository = defs.get_repository_def()
    schedule = repository.get_schedule_def("retention_schedule")
    assert schedule.job_name == "retention_job"
    assert schedule.default_status.value == "RUNNING"
    minute, hour, day, month, weekday = schedule.cron_schedule.split()
    assert (day, month, weekday) == ("*", "*", "*") and minute.isdigit() and hour.isdigit()
    assert repository.get_job("retention_job").description


# ---- the CLI -----------------------------------------------------------------------------------


def test_cli_dry_run_counts_and_purge_deletes(engine, database_url):
    made = _landscape(engine)
    before = _counts(engine)
    runner = CliRunner()
    dry = runner.invoke(main, ["retention", "purge", "--dry-run", "--url", database_url])
    assert dry.exit_code == 0, dry.output
    assert "dry run: nothing changed" in dry.output
    lines = {line.split()[0]: line.split()[-1] for line in dry.output.splitlines()[1:-1]}
    assert {table: int(lines[table]) for table in EXPECTED} == EXPECTED
    assert _counts(engine) == before

    done = runner.invoke(main, ["retention", "purge", "--json", "--url", database_url])
    assert done.exit_code == 0, done.output
    body = json.loads(done.output)
    assert body["dry_run"] is False
    assert body["counts"] == {**EXPECTED, "dead_letters_expired": 0}
    assert _event_ids(engine) == set(made["kept"])


def test_cli_refuses_a_bad_setting_by_name(database_url):
    result = CliRunner().invoke(
        main,
        ["retention", "purge", "--url", database_url],
        env={"EMAIL_PLATFORM_EVENT_RETENTION_DAYS": "0"},
    )
    assert result.exit_code == 1
    assert "EMAIL_PLATFORM_EVENT_RETENTION_DAYS" in result.output
    assert "Traceback" not in result.output


# ---- settings ----------------------------------------------------------------------------------


def test_default_settings_reuse_the_webhook_retention_variable():
    assert config.retention_settings({}) == RetentionSettings()
    chosen = config.retention_settings(
        {"EMAIL_PLATFORM_WEBHOOK_RETENTION_DAYS": "7", "EMAIL_PLATFORM_DEDUPE_RETENTION_DAYS": "9"}
    )
    assert (chosen.webhook_inbox_days, chosen.dedupe_days) == (7, 9)
    assert chosen.webhook_inbox_days == config.webhook_retention_days(
        {"EMAIL_PLATFORM_WEBHOOK_RETENTION_DAYS": "7"}
    )


@pytest.mark.parametrize(
    "name",
    [
        "EVENT_RETENTION_DAYS",
        "WEBHOOK_RETENTION_DAYS",
        "DEAD_LETTER_RETENTION_DAYS",
        "DAGSTER_RUN_RETENTION_DAYS",
        "DEDUPE_RETENTION_DAYS",
        "RETENTION_BATCH_SIZE",
        "DAGSTER_RUN_PURGE_LIMIT",
    ],
)
@given(raw=st.text(max_size=12))
@hostile_settings(60)
def test_any_setting_value_is_a_positive_whole_number_or_a_named_error(name, raw):
    text = raw.strip()
    valid = not text or (text.isascii() and text.isdigit() and len(text) <= 9 and int(text) >= 1)
    try:
        settings = config.retention_settings({f"EMAIL_PLATFORM_{name}": raw})
    except ConfigurationError as exc:
        assert not valid and f"EMAIL_PLATFORM_{name}" in str(exc)
        return
    assert valid
    values = [v for v in vars(settings).values() if v is not None]
    assert all(isinstance(v, int) and v >= 1 for v in values)
    if text:
        assert int(text) in values
