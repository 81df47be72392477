"""The benchmark and the generator run end to end at a tiny size (a smoke test, not timed)."""

from datetime import UTC, datetime, timedelta

from sqlalchemy import create_engine, text

from bench.analytics import run
from bench.generate import generate
from email_platform.webhooks.vocabulary import combine


def test_benchmark_smoke(tmp_path):
    results = run(messages=500, increment=100, rounds=1, days=2, workdir=tmp_path)
    steps = {r["step"].split(" ")[0]: r for r in results}
    assert steps["full"]["funnel_rows"] == 500
    assert steps["full"]["events_rows"] > 500 * 3
    assert steps["incremental"]["funnel_rows"] == 600
    # The 100 new messages and the older ones that got late opens; not the whole funnel.
    assert 100 < steps["incremental"]["messages_rebuilt"] < 600
    assert steps["re-run,"]["loaded"] == 0


def test_generated_events_arrive_after_they_occur_and_by_the_batch_end(tmp_path):
    """The generator writes only what a provider has sent by ``end``, each event received after
    it occurred; in steady state older messages bring as many late events, spread over the
    batch's span, as the new ones still owe."""
    url = f"sqlite:///{tmp_path / 'history.sqlite3'}"
    end = datetime(2026, 11, 2, 12, 0, tzinfo=UTC)
    history = generate(url, messages=2_000, days=1, end=end)
    assert history.deferred > 0  # opens and clicks due after the history's end
    later = end + timedelta(minutes=10)
    batch = generate(url, messages=200, days=0.005, end=later, seed=2, steady_state=True)
    engine = create_engine(url)
    with engine.connect() as connection:
        before, after, wrong_order = connection.execute(
            text(
                "SELECT sum(received_at <= :end), sum(received_at > :end), "
                "sum(received_at < occurred_at) FROM email_events"
            ),
            {"end": str(later.replace(tzinfo=None))},
        ).one()
        late = connection.execute(
            text(
                "SELECT count(*), min(received_at), max(received_at) FROM email_events "
                "WHERE message_id <= 2000 AND received_at > :end"
            ),
            {"end": str(end.replace(tzinfo=None))},
        ).one()
        undelivered = connection.execute(
            text(
                "SELECT count(*) FROM email_events AS e JOIN email_messages AS m "
                "ON m.message_id = e.message_id WHERE e.received_at > :end "
                "AND m.message_id <= 2000 AND (m.status != 'sent' OR EXISTS (SELECT 1 FROM "
                "email_events AS b WHERE b.message_id = m.message_id AND b.event_type = 'bounced'))"
            ),
            {"end": str(end.replace(tzinfo=None))},
        ).scalar()
        events = connection.execute(
            text("SELECT message_id, event_type FROM email_events WHERE message_id IS NOT NULL")
        ).all()
        statuses = dict(
            connection.execute(text("SELECT message_id, delivery_status FROM email_messages")).all()
        )
    engine.dispose()
    # Each message shows the status ingestion would give it from its events, late ones too.
    expected: dict[int, str | None] = dict.fromkeys(statuses)
    for message_id, kind in events:
        expected[message_id] = combine(expected[message_id], kind)
    assert statuses == expected
    assert batch.statuses_raised > 0
    assert undelivered == 0  # late opens only for messages that were delivered
    assert after == 0 and wrong_order == 0
    assert before == history.provider_events + batch.provider_events
    # Late opens for the first 2,000 messages: as many as the batch deferred, less the few
    # that would fall less than a minute after their message was created.
    assert 0.9 * batch.deferred <= late[0] <= batch.deferred
    span_start = str((later - timedelta(days=0.005)).replace(tzinfo=None))
    assert late[1] >= span_start and late[2] <= str(later.replace(tzinfo=None))
