"""Send windows: mail due inside a route's quiet hours waits until they end, in the recipient's
time zone when the payload names one; critical mail ignores them; nothing is lost or doubled."""

import dataclasses
from datetime import UTC, datetime, time, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from email_platform.common.timeutil import as_utc, utcnow
from email_platform.mail.routes import QuietHours, RouteTable, default_routes
from email_platform.resources import RoutingResource
from tests.support import (
    event,
    publish_across_lanes,
    publish_one,
    run_send,
    sandbox_messages,
)

NIGHT = QuietHours(start=time(21), end=time(8), default_timezone="Europe/Paris")


def _paris(*args: int) -> datetime:
    return datetime(*args, tzinfo=ZoneInfo("Europe/Paris")).astimezone(UTC)


def test_a_window_over_midnight_ends_at_the_next_morning_local_time():
    assert NIGHT.resume_at(_paris(2026, 12, 2, 23, 30), {}) == _paris(2026, 12, 3, 8)
    assert NIGHT.resume_at(_paris(2026, 12, 3, 7, 59), {}) == _paris(2026, 12, 3, 8)
    assert NIGHT.resume_at(_paris(2026, 12, 3, 8, 0), {}) is None
    assert NIGHT.resume_at(_paris(2026, 12, 3, 20, 59), {}) is None
    lunch = QuietHours(start=time(12), end=time(13))
    noon = datetime(2026, 12, 3, 12, 30, tzinfo=UTC)
    assert lunch.resume_at(noon, {}) == datetime(2026, 12, 3, 13, tzinfo=UTC)
    assert lunch.resume_at(noon + timedelta(hours=1), {}) is None


def test_the_recipients_time_zone_wins_over_the_default():
    # 23:30 in Paris is 17:30 in New York: not quiet there.
    late_in_paris = _paris(2026, 12, 2, 23, 30)
    assert NIGHT.resume_at(late_in_paris, {"timezone": "America/New_York"}) is None
    assert NIGHT.resume_at(late_in_paris, {"timezone": "Europe/Paris"}) is not None


def test_a_window_in_a_daylight_saving_gap_never_waits_backwards():
    # Paris skips 02:00-03:00 on 2026-03-29; a window ending at 02:30 that day.
    gap = QuietHours(start=time(1), end=time(2, 30), default_timezone="Europe/Paris")
    now = datetime(2026, 3, 29, 0, 45, tzinfo=UTC)  # 01:45 local
    resume = gap.resume_at(now, {})
    assert resume is not None and resume > now


@given(
    zone=st.one_of(st.none(), st.integers(), st.text(max_size=80), st.binary(max_size=20)),
    minutes=st.integers(min_value=0, max_value=366 * 24 * 60),
)
def test_any_payload_time_zone_gives_a_resume_time_or_none_never_an_error(zone, minutes):
    now = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=minutes)
    resume = NIGHT.resume_at(now, {"timezone": zone})
    assert resume is None or now < resume <= now + timedelta(hours=12)


def test_a_window_needs_a_length_and_a_known_zone():
    with pytest.raises(ValueError, match="start different"):
        QuietHours(start=time(8), end=time(8))
    with pytest.raises(ValueError, match="unknown time zone"):
        QuietHours(start=time(21), end=time(8), default_timezone="Mars/Olympus")


def quiet_now() -> RouteTable:
    """The shipped routes with every route in a quiet window around this moment (UTC)."""
    now = utcnow()
    window = QuietHours(
        start=(now - timedelta(hours=1)).time(), end=(now + timedelta(hours=1)).time()
    )
    table = default_routes()
    table.routes = [dataclasses.replace(r, quiet_hours=window) for r in table.routes]
    return table


QUIET = RoutingResource(routes_factory="tests.integration.test_quiet_hours:quiet_now")


def test_mail_due_in_quiet_hours_waits_for_their_end_and_critical_mail_does_not(
    engine, database_url, sandbox
):
    ids = publish_across_lanes(engine, {"critical": 1, "transactional": 0, "bulk": 2})
    reset, digests = ids[0], ids[1:]
    started = utcnow()
    assert run_send(database_url, sandbox.base_url, "bulk", digests, routing=QUIET).success
    assert run_send(database_url, sandbox.base_url, "critical", [reset], routing=QUIET).success
    # The reset went; the digests wait, given back, due when the window ends, nothing recorded.
    assert [m["metadata"]["event_id"] for m in sandbox_messages(sandbox.base_url)] == [reset]
    for event_id in digests:
        row = event(engine, event_id)
        assert row.status == "pending" and row.claimed_by is None and row.claim_count == 0
        wait = as_utc(row.available_at) - started
        assert timedelta(minutes=59) < wait <= timedelta(hours=1, seconds=5)
    # The window over (the shipped routes have none): each digest is sent once.
    with engine.begin() as connection:
        from sqlalchemy import update

        from email_platform.db.schema import email_outbox

        connection.execute(
            update(email_outbox)
            .where(email_outbox.c.event_id.in_(digests))
            .values(available_at=utcnow())
        )
    assert run_send(database_url, sandbox.base_url, "bulk", digests).success
    sent = [m["metadata"]["event_id"] for m in sandbox_messages(sandbox.base_url)]
    assert sorted(sent) == sorted([reset, *digests])
    assert all(event(engine, e).status == "done" for e in ids)


def test_the_recipients_zone_in_the_payload_decides(engine, database_url, sandbox):
    # Quiet around now in UTC; a recipient twelve hours away is in the middle of their day.
    far = publish_one(
        engine,
        event_type="digest.ready",
        aggregate_id="far",
        payload={
            "email": "far@example.org",
            "first_name": "Jo",
            "highlights": ["a"],
            "timezone": "Pacific/Kiritimati",  # UTC+14: fourteen hours from the window
        },
    )
    assert run_send(database_url, sandbox.base_url, "bulk", [far], routing=QUIET).success
    assert [m["metadata"]["event_id"] for m in sandbox_messages(sandbox.base_url)] == [far]
