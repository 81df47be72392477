"""The bulk lane's brakes, on SQLite and PostgreSQL: mail really sent through the sandbox,
bounces and complaints really posted to the receiver and ingested, then the brake sensor
evaluated. Over its thresholds it pauses the bulk lane (never critical or transactional) with
the rate, the threshold and the counts; below the minimum volume it does nothing; once an
operator resumes, it measures only mail accepted after the resume.
"""

import json

import pytest
from click.testing import CliRunner
from dagster import SkipReason, build_sensor_context, materialize
from hypothesis import given
from hypothesis import strategies as st
from starlette.testclient import TestClient

from email_platform.assets import analytics_warehouse
from email_platform.assets.brake_check import bulk_brake
from email_platform.cli import main
from email_platform.common import config
from email_platform.common.errors import ConfigurationError
from email_platform.common.lanes import Lane
from email_platform.resources import AppDatabase, LanePolicy, Warehouse
from email_platform.resources.brakes import BrakePolicy
from email_platform.sensors import brakes
from email_platform.sensors.brakes import brake_sensors, make_brake_sensor
from email_platform.sensors.outbox import make_outbox_sensor
from email_platform.store import lane_pauses
from email_platform.webhooks.ingest import WebhookIngestor
from email_platform.webhooks.receiver import create_receiver_app
from tests.support import publish_one, run_send, sandbox_messages, signup
from tests.webhook_support import SETTINGS, inbox_rows, sandbox_event, signed

#: Small enough for a test: the shipped minimum is 200.
POLICY = BrakePolicy(min_messages=20)


def _send_digests(engine, database_url: str, sandbox_url: str, start: int, n: int) -> list[str]:  # type: ignore[no-untyped-def]
    ids = [
        publish_one(
            engine,
            event_type="digest.ready",
            aggregate_id=f"d{i}",
            payload={"email": f"d{i}@example.org", "first_name": "Dee", "highlights": ["a"]},
        )
        for i in range(start, start + n)
    ]
    assert run_send(database_url, sandbox_url, "bulk", ids).success
    return ids


def _report(engine, sandbox_url: str, kinds: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    """The provider reports ``kind`` about each event's message: signed webhooks posted to the
    receiver, then ingested (normalized into email_events) as the ingestion job does."""
    sent = {m["metadata"]["event_id"]: m for m in sandbox_messages(sandbox_url)}
    client = TestClient(create_receiver_app(engine, settings=SETTINGS))
    for event_id, kind in kinds.items():
        m = sent[event_id]
        data = {"bounce": {"type": kind.split(":")[1]}} if kind.startswith("bounced") else {}
        body, headers = signed(
            sandbox_event(
                "email.bounced" if kind.startswith("bounced") else f"email.{kind}",
                message_id=m["id"],
                to=m["to"],
                event_id=event_id,
                idempotency_key=m["idempotency_key"],
                **data,
            )
        )
        assert client.post("/webhooks/sandbox", content=body, headers=headers).status_code == 200
    pending = [row.inbox_id for row in inbox_rows(engine) if row.status == "pending"]
    outcome = WebhookIngestor(engine).run(pending, run_id="test-ingest")
    assert outcome.applied == len(kinds) and outcome.unlinked == 0


def _brake(database_url: str, policy: BrakePolicy | None = POLICY) -> str:
    sensor = make_brake_sensor(policy)
    with build_sensor_context(resources={"email_database": AppDatabase(url=database_url)}) as ctx:
        result = sensor(ctx)
    assert isinstance(result, SkipReason)  # a brake never launches a run
    return result.skip_message


def _pause(engine, lane: str):  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        return lane_pauses.active(connection, lane)


def test_a_hard_bounce_spike_pauses_bulk_only_with_rate_threshold_and_counts(
    engine, database_url, sandbox
):
    bulk = _send_digests(engine, database_url, sandbox.base_url, 0, 40)
    # Transactional mail bouncing far worse: not the brake's business.
    welcomes = [signup(engine, f"u{i}") for i in range(25)]
    assert run_send(database_url, sandbox.base_url, "transactional", welcomes).success
    reports = {event_id: "bounced:hard" for event_id in bulk[:3]}
    reports[bulk[3]] = "bounced:soft"  # a soft bounce is not a hard bounce
    reports.update({event_id: "bounced:hard" for event_id in welcomes})
    _report(engine, sandbox.base_url, reports)
    # 3 hard bounces of 40: 7.50%, over the 5% threshold.
    message = _brake(database_url)
    assert message.startswith("BRAKE: bulk lane paused by brake:bounce_rate"), message
    pause = _pause(engine, "bulk")
    assert pause.paused_by == "brake:bounce_rate"
    assert pause.reason.startswith(
        "hard-bounce rate 7.50% is over 5.00% (3 of 40 bulk message(s) accepted since "
    ), pause.reason
    assert _pause(engine, "transactional") is None and _pause(engine, "critical") is None

    # Visible where an operator looks: the bulk sensor's tick and `lanes status`.
    lanes = LanePolicy(overrides_json="{}")
    resources = {"email_database": AppDatabase(url=database_url), "email_lanes": lanes}
    with build_sensor_context(resources=resources) as context:
        skipped = make_outbox_sensor(Lane.BULK)(context)
    assert isinstance(skipped, SkipReason)
    assert "A brake paused it" in skipped.skip_message and "7.50%" in skipped.skip_message
    status = CliRunner().invoke(main, ["lanes", "status", "--json", "--url", database_url])
    state = json.loads(status.output)["lanes"]
    assert state["bulk"]["paused"] and state["bulk"]["brake"]
    assert not state["transactional"]["paused"] and not state["critical"]["paused"]
    # A paused lane is not measured again: the pause stays as it was.
    again = _brake(database_url)
    assert again.startswith("bulk lane paused by brake:bounce_rate") and "lanes resume" in again
    assert _pause(engine, "bulk").paused_at == pause.paused_at


def test_a_complaint_spike_pauses_bulk(engine, database_url, sandbox):
    bulk = _send_digests(engine, database_url, sandbox.base_url, 0, 30)
    # Delivered: the complaint rate's denominator, as the analysts' complaint_rate divides.
    _report(engine, sandbox.base_url, {event_id: "delivered" for event_id in bulk[1:26]})
    # One hard bounce (3.33% of 30 accepted, under 5%) and one complaint (4.00% of 25
    # delivered, over 0.30%).
    _report(engine, sandbox.base_url, {bulk[0]: "bounced:hard", bulk[1]: "complained"})
    assert _brake(database_url).startswith("BRAKE:")
    pause = _pause(engine, "bulk")
    assert pause.paused_by == "brake:complaint_rate"
    assert pause.reason.startswith(
        "complaint rate 4.00% is over 0.30% (1 of 25 bulk message(s) delivered of those accepted"
    ), pause.reason
    assert "hard-bounce" not in pause.reason


def test_below_the_minimum_volume_or_thresholds_nothing_is_paused(engine, database_url, sandbox):
    bulk = _send_digests(engine, database_url, sandbox.base_url, 0, 40)
    _report(engine, sandbox.base_url, {event_id: "bounced:hard" for event_id in bulk[:20]})
    # Half of them bounced, but 40 messages are under the shipped minimum of 200.
    message = _brake(database_url, policy=None)
    assert (
        "of 40 bulk message(s) accepted since" in message
        and "20 hard-bounced (50.00% of accepted)" in message
    )
    assert "needs at least 200" in message and _pause(engine, "bulk") is None
    # Thresholds are settings too: 50% is under a 60% threshold.
    within = _brake(database_url, BrakePolicy(min_messages=20, max_hard_bounce_rate=0.6))
    assert within.startswith("No brake:") and _pause(engine, "bulk") is None
    # No delivery reports: the complaint rate has no denominator, and the tick says so.
    assert "the complaint rate is not judged: no delivery reports yet" in within
    # Mail accepted before the window is not measured.
    short = _brake(database_url, BrakePolicy(min_messages=1, window_s=0.001))
    assert "of 0 bulk message(s)" in short and _pause(engine, "bulk") is None


def test_after_a_resume_the_brake_measures_only_new_mail(engine, database_url, sandbox):
    old = _send_digests(engine, database_url, sandbox.base_url, 0, 40)
    _report(engine, sandbox.base_url, {event_id: "bounced:hard" for event_id in old[:4]})
    assert _brake(database_url).startswith("BRAKE:")
    resumed = CliRunner().invoke(
        main, ["lanes", "resume", "bulk", "--by", "alice", "--url", database_url]
    )
    assert resumed.exit_code == 0 and "brake:bounce_rate" in resumed.output, resumed.output
    # More bad news about the old mail arrives after the resume: it does not pause again.
    _report(engine, sandbox.base_url, {event_id: "bounced:hard" for event_id in old[4:10]})
    message = _brake(database_url)
    assert "of 0 bulk message(s) accepted since" in message and _pause(engine, "bulk") is None
    # New mail within thresholds: still nothing.
    new = _send_digests(engine, database_url, sandbox.base_url, 100, 25)
    assert _brake(database_url).startswith("No brake: of 25 bulk")
    assert _pause(engine, "bulk") is None
    # New mail that bounces: measured on its own, the brake pauses again.
    _report(engine, sandbox.base_url, {event_id: "bounced:hard" for event_id in new[:2]})
    assert _brake(database_url).startswith("BRAKE:")
    pause = _pause(engine, "bulk")
    assert pause.reason.startswith("hard-bounce rate 8.00% is over 5.00% (2 of 25 bulk")
    assert pause.resumed_by is None


def test_brakes_can_be_turned_off_and_refuse_bad_settings(database_url, monkeypatch):
    assert [sensor.name for sensor in brake_sensors] == ["bulk_brake_sensor"]
    monkeypatch.setenv("EMAIL_PLATFORM_BRAKES", "off")
    assert _brake(database_url, policy=None) == "Brakes are off (EMAIL_PLATFORM_BRAKES=off)."
    monkeypatch.setenv("EMAIL_PLATFORM_BRAKES", "on")
    monkeypatch.setenv("EMAIL_PLATFORM_BRAKE_HARD_BOUNCE_RATE", "5%")
    with pytest.raises(ConfigurationError, match="EMAIL_PLATFORM_BRAKE_HARD_BOUNCE_RATE"):
        BrakePolicy().settings()
    monkeypatch.delenv("EMAIL_PLATFORM_BRAKE_HARD_BOUNCE_RATE")
    with pytest.raises(ConfigurationError, match="max_complaint_rate must be in"):
        BrakePolicy(max_hard_bounce_rate=0.1, max_complaint_rate=2.0).settings()


@given(
    name=st.sampled_from(
        ["BRAKE_MIN_MESSAGES", "BRAKE_HARD_BOUNCE_RATE", "BRAKE_COMPLAINT_RATE", "BRAKE_WINDOW_S"]
    ),
    raw=st.text(max_size=12) | st.floats(allow_nan=True).map(str),
)
def test_any_brake_setting_is_a_number_in_range_or_refused_by_name(name, raw):
    try:
        settings = config.brake_settings({f"EMAIL_PLATFORM_{name}": raw})
    except ValueError as exc:
        assert f"EMAIL_PLATFORM_{name}" in str(exc)
        return
    value = settings[name.removeprefix("BRAKE_").lower()]
    assert value == value and value >= 0  # not NaN, not negative
    if "RATE" in name:
        assert value <= 1


# ---- one brake: the bulk_brake asset check over the warehouse -------------------------------


def _check(database_url: str, warehouse_path: str):  # type: ignore[no-untyped-def]
    """Refresh the warehouse and run the bulk_brake check, as the analytics job does."""
    result = materialize(
        [analytics_warehouse, bulk_brake],
        resources={
            "email_database": AppDatabase(url=database_url),
            "email_warehouse": Warehouse(path=warehouse_path),
        },
        raise_on_error=False,
    )
    (evaluation,) = result.get_asset_check_evaluations()
    assert evaluation.check_name == "bulk_brake"
    return evaluation


def test_the_warehouse_check_and_the_sensor_judge_the_same_rates_and_either_pauses_bulk(
    engine, database_url, sandbox, tmp_path, monkeypatch
):
    monkeypatch.setenv("EMAIL_PLATFORM_BRAKE_MIN_MESSAGES", "20")
    warehouse_path = str(tmp_path / "warehouse.duckdb")
    bulk = _send_digests(engine, database_url, sandbox.base_url, 0, 40)
    _report(engine, sandbox.base_url, {event_id: "delivered" for event_id in bulk[10:40]})
    # 2 hard bounces of 40 accepted (5.00%, not over 5%), no complaint: both pass.
    _report(engine, sandbox.base_url, {event_id: "bounced:hard" for event_id in bulk[:2]})
    passing = _check(database_url, warehouse_path)
    assert passing.passed and passing.description.startswith("No brake: of 40 bulk message(s)")
    sensor_says = _brake(database_url, policy=None)
    assert (
        sensor_says.startswith("No brake: of 40 bulk message(s)") and _pause(engine, "bulk") is None
    )
    meta = {key: value.value for key, value in passing.metadata.items()}
    assert (meta["accepted"], meta["hard_bounced"], meta["delivered"]) == (40, 2, 30)
    assert meta["hard_bounce_rate"] == 0.05 and meta["complaint_rate"] == 0.0

    # One more hard bounce: 7.50% of accepted. The check fails and pauses bulk by itself, with
    # the sensor's brake, reason and counts; the sensor, judging the same, finds it paused.
    _report(engine, sandbox.base_url, {bulk[2]: "bounced:hard"})
    failing = _check(database_url, warehouse_path)
    assert not failing.passed and failing.severity.value == "ERROR"
    pause = _pause(engine, "bulk")
    assert pause.paused_by == "brake:bounce_rate"
    assert pause.reason.startswith(
        "hard-bounce rate 7.50% is over 5.00% (3 of 40 bulk message(s) accepted since "
    ) and pause.reason.endswith("[bulk_brake check]"), pause.reason
    assert failing.description.startswith("BRAKE: bulk lane paused by brake:bounce_rate")
    assert _pause(engine, "transactional") is None and _pause(engine, "critical") is None
    operational = brakes.judge(AppDatabase(url=database_url), BrakePolicy().settings())
    assert operational.rates == lane_pauses.LaneRates(
        accepted=40, hard_bounced=3, complained=0, delivered=30
    )
    assert [trip.brake for trip in operational.tripped] == ["bounce_rate"]
    assert _brake(database_url, policy=None).startswith("bulk lane paused by brake:bounce_rate")
    # Checked again while paused: still failing, the pause left as it was.
    assert not _check(database_url, warehouse_path).passed
    assert _pause(engine, "bulk").paused_at == pause.paused_at

    # After an operator's resume both measure only mail accepted since: both pass.
    resumed = CliRunner().invoke(
        main, ["lanes", "resume", "bulk", "--by", "alice", "--url", database_url]
    )
    assert resumed.exit_code == 0, resumed.output
    after = _check(database_url, warehouse_path)
    assert after.passed and "of 0 bulk message(s) accepted since" in after.description
    assert _pause(engine, "bulk") is None


def test_the_analytics_refresh_runs_the_brake_check():
    """The check pauses bulk only if something runs it: the refresh job (analytics_refresh_
    sensor, after sends and webhooks, and hourly at least) does, after every refresh."""
    from email_platform.definitions import build_definitions

    job = build_definitions().get_job_def("email_analytics_job")
    assert "bulk_brake" in {key.name for key in job.asset_layer.asset_graph.asset_check_keys}
