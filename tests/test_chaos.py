"""The fault harness (``python -m bench.faults``) at its small size, and its checker.

The drain runs the real stack (daemon, code server, launched runs, receiver, sandbox) while
processes are killed with SIGKILL, the provider has an outage longer than the retry budget,
answers 429 with every kind of Retry-After and cuts connections mid-answer, the outbox is
locked, PostgreSQL is restarted and then absent, events commit out of id order, an extra
batch run sends events the lanes are sending, and two operators replay the same dead letters
at once; then hostile webhooks arrive while the receiver is killed. Every event's and
webhook's fate is then counted; the run passes only with nothing lost, doubled or wrong.

The checker tests show it can fail: each defect it exists to catch, planted in a database,
is counted.
"""

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import insert, update

from bench.faults.checker import check
from bench.faults.stream import Stream, prepare
from email_platform.db.schema import email_attempts, email_messages, email_outbox
from email_platform.timeutil import utcnow
from tests.support import run_send, sandbox_messages

ROOT = Path(__file__).resolve().parent.parent


def _drain(tmp_path: Path, *args: str) -> tuple[int, list[str]]:
    process = subprocess.run(
        [sys.executable, "-m", "bench.faults", "--workdir", str(tmp_path / "work"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = process.stdout.strip().splitlines()
    assert lines, process.stderr[-3000:]
    return process.returncode, lines


def _figures(lines: list[str], prefix: str) -> dict[str, str]:
    line = next(line for line in lines if line.startswith(prefix))
    return dict(part.split("=", 1) for part in line[len(prefix) :].split())


@pytest.mark.e2e
@pytest.mark.timeout(960)
@pytest.mark.parametrize(
    ("database", "mode"),
    [("sqlite", "workers"), ("postgres", "workers"), ("sqlite", "batch"), ("postgres", "batch")],
)
def test_a_drain_under_faults_loses_doubles_and_misroutes_nothing(tmp_path, database, mode):
    code, lines = _drain(
        tmp_path,
        *("--events", "300", "--database", database, "--mode", mode),
        *("--kill-every-s", "3", "--kill-tail-s", "30"),
    )
    report = "\n".join(lines)
    assert lines[-1] == "lost=0 doubled=0 wrong=0", report
    assert code == 0, report
    kills = _figures(lines, "kills:")
    assert int(kills["total"]) >= 5, report
    assert int(kills.get("run", 0)) + int(kills.get("step", 0)) >= 1, report
    faults = _figures(lines, "faults:")
    expected = {"provider_outage", "outbox_locked", "late_commit", "replay_twice_at_once"}
    expected |= {"hostile_webhooks"}
    if database == "postgres":
        expected |= {"database_restart", "database_unreachable"}
    assert expected <= set(faults), report
    published = _figures(lines, "published:")
    assert any(kind.startswith("poison:") for kind in published), report
    fates = _figures(lines, "fates:")
    assert int(fates["sent"]) > 200, report
    hooks = _figures(lines, "webhooks:")
    assert int(hooks["planned"]) == int(hooks["applied"]) > 200, report
    assert int(hooks["receiver_kills"]) >= 1 and hooks["inbox_settled"] == "True", report
    assert int(hooks["forged"]) >= 6 and int(hooks["flood"]) >= 100, report


def _stream(engine, total: int = 60) -> Stream:  # type: ignore[no-untyped-def]
    prepare(engine)  # the product's users table, which signups write to
    stream = Stream(engine, total=total, per_s=10_000, seed=3)
    stream.run()
    return stream


def test_the_stream_owes_only_events_whose_transaction_committed(engine):
    """Found by the large drain: a commit PostgreSQL refused as it restarted raised after the
    event was written in the transaction, and the stream had already counted it owed, so the
    checker called an event that never existed lost."""
    from sqlalchemy import event as sa_event
    from sqlalchemy.exc import OperationalError

    commits = {"n": 0}

    def refuse_the_third(_connection) -> None:  # type: ignore[no-untyped-def]
        commits["n"] += 1
        if commits["n"] == 3:
            raise OperationalError("COMMIT", {}, Exception("server closed the connection"))

    sa_event.listen(engine, "commit", refuse_the_third)
    try:
        stream = _stream(engine, total=10)
    finally:
        sa_event.remove(engine, "commit", refuse_the_third)
    assert stream.expected.refused == 1
    with engine.connect() as connection:
        stored = set(
            connection.execute(
                email_outbox.select().with_only_columns(email_outbox.c.event_id)
            ).scalars()
        )
    assert set(stream.expected.fates) == stored and len(stored) == 9


def test_the_checker_counts_an_unfinished_event_as_lost(engine):
    stream = _stream(engine)
    assert stream.expected.refused == 0 and stream.expected.kinds["signup"] > 0
    verdict = check(engine, stream.expected, [], 0)
    # Nothing was sent: every event is still pending.
    assert verdict.lost == len(stream.expected.fates)


def test_the_checker_passes_a_clean_send_and_catches_each_planted_defect(
    engine, database_url, sandbox
):
    stream = _stream(engine)
    by_lane: dict[str, list[str]] = {}
    with engine.connect() as connection:
        for event_id, lane in connection.execute(
            email_outbox.select().with_only_columns(email_outbox.c.event_id, email_outbox.c.lane)
        ):
            by_lane.setdefault(lane, []).append(event_id)
    for lane, event_ids in by_lane.items():
        # Past send_after and their expiry (1 ms after it): the expiring digests are due and
        # expired, as they are 2 s after publishing.
        with engine.begin() as connection:
            connection.execute(
                update(email_outbox)
                .where(email_outbox.c.available_at > utcnow())
                .values(
                    available_at=utcnow() - timedelta(seconds=1),
                    expires_at=utcnow() - timedelta(seconds=1) + timedelta(milliseconds=1),
                )
            )
        run_send(database_url, sandbox.base_url, lane, event_ids)
    accepted = sandbox_messages(sandbox.base_url)
    clean = check(engine, stream.expected, accepted, 0)
    assert (clean.lost, clean.doubled, clean.wrong) == (0, 0, 0), clean.details

    with engine.begin() as connection:
        sent = connection.execute(
            email_messages.select().where(email_messages.c.status == "sent").limit(1)
        ).one()
        suppressed = connection.execute(
            email_messages.select().where(email_messages.c.status == "suppressed").limit(1)
        ).first()
        # A second sender recorded the same acceptance.
        connection.execute(
            insert(email_attempts).values(
                message_id=sent.message_id,
                event_id=sent.event_id,
                run_id="another-run",
                attempt_no=9,
                started_at=utcnow(),
                finished_at=utcnow(),
                outcome="accepted",
            )
        )
        # An event left in flight by a dead run.
        connection.execute(
            update(email_outbox)
            .where(email_outbox.c.event_id == stream_first_sent(stream, sent.event_id))
            .values(status="in_flight")
        )
    planted = check(engine, stream.expected, accepted, 0)
    assert planted.doubled == 1, planted.details
    assert planted.lost == 1, planted.details
    if suppressed is not None:
        with engine.begin() as connection:
            connection.execute(
                update(email_messages)
                .where(email_messages.c.message_id == suppressed.message_id)
                .values(status="sent")
            )
        assert check(engine, stream.expected, accepted, 0).wrong == 1
    # The provider accepting one message under two keys is doubled too.
    twice = [
        *accepted,
        {**accepted[0], "idempotency_key": "other:" + accepted[0]["idempotency_key"]},
    ]
    assert check(engine, stream.expected, twice, 0).doubled == planted.doubled + 1


def stream_first_sent(stream: Stream, but_not: str) -> str:
    """A sent-fated event other than ``but_not``."""
    return next(e for e, fate in stream.expected.fates.items() if fate == "sent" and e != but_not)
