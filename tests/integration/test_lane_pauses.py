"""Pausing a lane, on SQLite and PostgreSQL: ``email-platform lanes pause|resume|status``, the
lane's outbox sensor that then requests nothing and says who paused it, why and since when,
and its resident lane-worker run that gives back what it holds and ends "paused" within
seconds while the other lanes go on sending.
"""

import json
import string
import threading
import time

from click.testing import CliRunner
from dagster import (
    DagsterInstance,
    SensorResult,
    SkipReason,
    build_sensor_context,
    execute_job,
    reconstructable,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select

from email_platform.cli import main
from email_platform.common.lanes import Lane
from email_platform.common.timeutil import isoformat, utcnow
from email_platform.db.schema import lane_pauses as lane_pauses_table
from email_platform.db.schema import lane_workers as lane_workers_table
from email_platform.ops.lane_worker import stop_check
from email_platform.resources import AppDatabase, LanePolicy
from email_platform.sensors.outbox import make_outbox_sensor
from email_platform.store import lane_pauses
from tests.support import event, publish_across_lanes, publish_one, sandbox_messages, signup


def _lanes(database_url: str, *args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(main, ["lanes", *args, "--url", database_url])


def _status(database_url: str) -> dict:
    result = _lanes(database_url, "status", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["lanes"]


def _digest(engine: Engine, n: int) -> str:
    return publish_one(
        engine,
        event_type="digest.ready",
        aggregate_id=f"d{n}",
        payload={"email": f"d{n}@example.org", "first_name": "Dee", "highlights": ["a"]},
    )


def test_pause_resume_and_status_from_the_command_line(database_url):
    before = utcnow()
    paused = _lanes(database_url, "pause", "bulk", "--reason", "bad list import", "--by", "alice")
    assert paused.exit_code == 0, paused.output
    assert "bulk lane paused by alice" in paused.output and "bad list import" in paused.output
    state = _status(database_url)
    assert state["bulk"]["paused"] is True and state["bulk"]["brake"] is False
    assert state["bulk"]["paused_by"] == "alice" and state["bulk"]["reason"] == "bad list import"
    assert state["bulk"]["paused_at"] >= before.isoformat().replace("+00:00", "Z")
    assert state["critical"]["paused"] is False and state["transactional"]["paused"] is False
    text = _lanes(database_url, "status")
    assert "lane bulk          PAUSED by alice since " in text.output
    assert "lane critical      not paused; workers alive: none" in text.output
    # The main status says it too, beside the lane's depth.
    overall = CliRunner().invoke(main, ["status", "--json", "--url", database_url])
    lanes_now = json.loads(overall.output)["lanes"]
    assert lanes_now["bulk"]["paused"] == {
        "by": "alice",
        "reason": "bad list import",
        "since": state["bulk"]["paused_at"],
    }
    assert lanes_now["critical"]["paused"] is None
    shown = CliRunner().invoke(main, ["status", "--url", database_url]).output
    assert f"PAUSED by alice since {state['bulk']['paused_at']}" in shown

    # Pausing again keeps the first pause: it says who paused it first and since when.
    again = _lanes(database_url, "pause", "bulk", "--by", "bob")
    assert again.exit_code == 0 and "already paused" in again.output and "alice" in again.output
    assert _status(database_url)["bulk"]["paused_by"] == "alice"

    resumed = _lanes(database_url, "resume", "bulk", "--by", "carol")
    assert resumed.exit_code == 0 and "resumed bulk lane" in resumed.output
    state = _status(database_url)["bulk"]
    assert state["paused"] is False and state["resumed_by"] == "carol"
    assert state["paused_by"] == "alice"  # the last pause stays on record
    assert "resumed by carol" in _lanes(database_url, "status").output
    nothing = _lanes(database_url, "resume", "bulk")
    assert nothing.exit_code == 0 and "not paused" in nothing.output

    # A lane paused after a resume is paused anew, with the new pauser and time.
    repaused = _lanes(database_url, "pause", "bulk", "--by", "dave")
    assert repaused.exit_code == 0 and "paused by dave" in repaused.output
    assert _status(database_url)["bulk"]["paused_by"] == "dave"


def test_the_command_line_refuses_what_it_cannot_store(database_url):
    for args, hint in [
        (["pause", "nope"], "unknown lane 'nope'"),
        (["resume", "Bulk "], "unknown lane"),
        (["pause", "bulk", "--by", "brake:bounce_rate"], "marks a brake's pause"),
        (["pause", "bulk", "--by", "   "], "must not be empty"),
        (["pause", "bulk", "--reason", "two\nlines"], "control character"),
        (["pause", "bulk", "--reason", "x" * 1001], "at most 1000"),
        (["pause", "bulk", "--by", "a\x00b"], "NUL"),
    ]:
        result = _lanes(database_url, *args)
        assert result.exit_code == 2 and hint in result.output, (args, result.output)
    assert all(not state["paused"] for state in _status(database_url).values())
    unmigrated = CliRunner().invoke(main, ["lanes", "status", "--url", "sqlite://"])
    assert unmigrated.exit_code == 1 and "db upgrade" in unmigrated.output


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    reason=st.text(
        st.characters(codec="utf-8") | st.sampled_from(["\n", "\r", "\x00", "\x7f", " "]),
        max_size=40,
    ),
    by=st.text(string.printable + "éü\u2028", min_size=0, max_size=30),
)
def test_any_reason_and_name_is_stored_as_given_or_refused_by_name(engine, reason, by):
    url = engine.url.render_as_string(hide_password=False)
    result = CliRunner().invoke(
        main,
        [
            "lanes",
            "pause",
            "transactional",
            "--reason",
            reason,
            "--by",
            by,
            "--url",
            url,
        ],
    )
    with engine.begin() as connection:
        row = lane_pauses.active(connection, "transactional")
        lane_pauses.resume(connection, "transactional", resumed_by="test", now=utcnow())
    if result.exit_code == 2:  # refused, naming the option; nothing stored
        assert "--reason" in result.output or "--by" in result.output, result.output
        assert row is None
        return
    assert result.exit_code == 0, (result.output, result.exception)
    assert row is not None and row.paused_by == by.strip()
    assert row.reason == (reason.strip() or None)
    assert not any(ord(c) < 32 for c in (row.reason or "") + row.paused_by)


# ---- the paused lane's sensor --------------------------------------------------------------


def _tick(lane: Lane, database_url: str, instance=None, lanes_json: str = "{}"):  # type: ignore[no-untyped-def]
    resources = {
        "email_database": AppDatabase(url=database_url),
        "email_lanes": LanePolicy(overrides_json=lanes_json),
    }
    with build_sensor_context(instance=instance, resources=resources) as context:
        return make_outbox_sensor(lane)(context)


def test_a_paused_lane_sensor_requests_nothing_and_says_who_why_and_since_when(
    engine, database_url
):
    publish_across_lanes(engine, {"critical": 1, "transactional": 1, "bulk": 3})
    assert (
        _lanes(database_url, "pause", "bulk", "--reason", "complaints", "--by", "ops").exit_code
        == 0
    )
    with engine.connect() as connection:
        since = lane_pauses.active(connection, "bulk").paused_at
    batch_mode = '{"bulk": {"workers": 0}, "critical": {"workers": 0}}'
    with DagsterInstance.ephemeral() as instance:
        for lanes_json in ("{}", batch_mode):  # lane workers, and one run per batch
            skipped = _tick(Lane.BULK, database_url, instance, lanes_json)
            assert isinstance(skipped, SkipReason), skipped
            message = skipped.skip_message
            assert "bulk lane paused by ops since" in message and "complaints" in message
            assert f"since {isoformat(since)}" in message
            assert "An operator paused it" in message and "lanes resume bulk" in message
            # The other lanes go on.
            going = _tick(Lane.CRITICAL, database_url, instance, lanes_json)
            assert isinstance(going, SensorResult) and going.run_requests
    # Nothing was marked requested while paused: the batch mode asks for all three on resume.
    assert _lanes(database_url, "resume", "bulk").exit_code == 0
    resumed = _tick(Lane.BULK, database_url, None, batch_mode)
    assert isinstance(resumed, SensorResult)
    assert resumed.run_requests[0].tags["email/batch_size"] == "3"


def test_a_brake_pause_is_marked_in_the_sensor(engine, database_url):
    _digest(engine, 1)
    with engine.begin() as connection:
        lane_pauses.pause(
            connection,
            "bulk",
            paused_by="brake:bounce_rate",
            reason="hard-bounce rate 9.00% is over 5.00%",
            now=utcnow(),
        )
    skipped = _tick(Lane.BULK, database_url)
    assert isinstance(skipped, SkipReason)
    assert "paused by brake:bounce_rate" in skipped.skip_message
    assert "A brake paused it" in skipped.skip_message and "9.00%" in skipped.skip_message
    assert _status(database_url)["bulk"]["brake"] is True


def test_the_stop_check_of_a_worker_sees_its_own_lanes_pause_only(engine):
    with DagsterInstance.ephemeral() as instance:
        bulk = stop_check(instance, "bulk", "run-bulk", None, engine)
        critical = stop_check(instance, "critical", "run-critical", None, engine)
        assert bulk() is None and critical() is None
        with engine.begin() as connection:
            lane_pauses.pause(connection, "bulk", paused_by="ops", reason="why", now=utcnow())
        # Read again within STOP_CHECK_EVERY_S (2 s), not on every poll.
        bulk.checked = critical.checked = 0.0
        assert bulk() == "paused" and critical() is None
        assert bulk.detail is not None and "paused by ops" in bulk.detail and "why" in bulk.detail


# ---- a real worker run ends "paused" within seconds; the other lanes keep sending ------------


def _worker_job():
    from email_platform.definitions import build_definitions

    return build_definitions().get_job_def("lane_worker_job")


def _worker_config(lane: str) -> dict:
    return {"ops": {"run_lane_worker": {"config": {"lane": lane}}}}


def _run_logs(instance: DagsterInstance, run_id: str) -> list[str]:
    return [e.user_message for e in instance.all_logs(run_id) if not e.is_dagster_event]


def _wait_for(predicate, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_paused_lanes_worker_run_ends_paused_within_seconds_and_other_lanes_go_on(
    engine, database_url, sandbox, tmp_path, monkeypatch
):
    monkeypatch.setenv("EMAIL_PLATFORM_DATABASE_URL", database_url)
    monkeypatch.setenv("EMAIL_PLATFORM_SANDBOX_BASE_URL", sandbox.base_url)
    # Idle for minutes: only the pause can end the bulk worker within the test.
    monkeypatch.setenv(
        "EMAIL_PLATFORM_LANES",
        json.dumps(
            {
                "bulk": {"worker_idle_s": 300, "worker_poll_s": 0.05},
                "transactional": {"worker_idle_s": 3, "worker_poll_s": 0.05},
            }
        ),
    )
    first = _digest(engine, 1)
    (tmp_path / "dagster").mkdir()
    outcome: dict = {}
    with DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:

        def run(lane: str) -> None:
            with execute_job(
                reconstructable(_worker_job),
                instance=instance,
                run_config=_worker_config(lane),
                tags={"email/lane": lane},
            ) as result:
                outcome[lane] = (result.success, result.run_id)

        bulk = threading.Thread(target=run, args=("bulk",))
        bulk.start()
        try:
            assert _wait_for(lambda: event(engine, first).status == "done", 60)
            paused = _lanes(database_url, "pause", "bulk", "--reason", "spike", "--by", "ops")
            asked = time.monotonic()
            assert paused.exit_code == 0, paused.output
        finally:
            bulk.join(90)
        ended_after = time.monotonic() - asked
        assert not bulk.is_alive() and ended_after < 15, ended_after
        success, run_id = outcome["bulk"]
        assert success is True  # a pause is a clean end, not a failure
        logs = _run_logs(instance, run_id)
        assert any(
            "lane worker ended, paused: bulk lane paused by ops" in line and "spike" in line
            for line in logs
        ), logs
        with engine.connect() as connection:
            (end_reason,) = connection.execute(
                select(lane_workers_table.c.end_reason).where(lane_workers_table.c.run_id == run_id)
            ).one()
        assert end_reason == "paused"
        late = _digest(engine, 2)  # published while paused: it waits

        # Another lane's worker sends while bulk is paused; bulk's event still waits.
        welcome = signup(engine, "u1")
        run("transactional")
        assert outcome["transactional"][0] is True
        assert event(engine, welcome).status == "done"
        assert event(engine, late).status == "pending"
    keys = sorted(m["idempotency_key"] for m in sandbox_messages(sandbox.base_url))
    assert keys == sorted([f"{first}:weekly_digest", f"{welcome}:welcome"])
    with engine.connect() as connection:
        assert connection.execute(select(lane_pauses_table.c.lane)).scalars().all() == ["bulk"]


def test_stopping_a_lane_sensor_in_the_ui_still_pauses_only_that_locations_lane(tmp_path):
    """What the UI writes when an operator stops a sensor: an instigator state. Only this code
    location's sensor counts; the selector (location and repository name) is what matches, so
    a webserver whose workspace reaches the code server at another address still counts."""
    from dagster._core.remote_origin import (
        GrpcServerCodeLocationOrigin,
        RemoteInstigatorOrigin,
        RemoteRepositoryOrigin,
    )
    from dagster._core.scheduler.instigation import (
        InstigatorState,
        InstigatorStatus,
        InstigatorType,
    )

    from email_platform.ops.lane_worker import stopped_lane_sensors

    def origin(host: str, location: str) -> RemoteRepositoryOrigin:
        location_origin = GrpcServerCodeLocationOrigin(host=host, port=4000, location_name=location)
        return RemoteRepositoryOrigin(location_origin, "__repository__")

    ours, elsewhere = origin("daemon-side", "email"), origin("other", "another_location")
    with DagsterInstance.local_temp(str(tmp_path)) as instance:
        for repository, name, status in [
            (origin("webserver-side", "email"), "bulk_outbox_sensor", InstigatorStatus.STOPPED),
            (elsewhere, "critical_outbox_sensor", InstigatorStatus.STOPPED),
            (ours, "transactional_outbox_sensor", InstigatorStatus.RUNNING),
        ]:
            instance.add_instigator_state(
                InstigatorState(
                    RemoteInstigatorOrigin(repository, name), InstigatorType.SENSOR, status
                )
            )
        selector = ours.get_selector_id()
        assert stopped_lane_sensors(instance, selector) == {"bulk"}
        assert stopped_lane_sensors(instance) == {"bulk", "critical"}
        assert stop_check(instance, "bulk", "run-1", selector)() == "paused"
        assert stop_check(instance, "critical", "run-2", selector)() is None
        assert stop_check(instance, "transactional", "run-3", selector)() is None


def test_lanes_status_shows_a_lane_whose_sensor_was_stopped_in_the_ui(
    database_url, tmp_path, monkeypatch
):
    from dagster._core.remote_origin import (
        GrpcServerCodeLocationOrigin,
        RemoteInstigatorOrigin,
        RemoteRepositoryOrigin,
    )
    from dagster._core.scheduler.instigation import (
        InstigatorState,
        InstigatorStatus,
        InstigatorType,
    )

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    assert _status(database_url)["bulk"]["sensor_stopped"] is None  # no instance to ask yet
    (tmp_path / "dagster.yaml").write_text("{}\n")
    location = GrpcServerCodeLocationOrigin(host="h", port=4000, location_name="email")
    repository = RemoteRepositoryOrigin(location, "__repository__")
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        instance.add_instigator_state(
            InstigatorState(
                RemoteInstigatorOrigin(repository, "bulk_outbox_sensor"),
                InstigatorType.SENSOR,
                InstigatorStatus.STOPPED,
            )
        )
    state = _status(database_url)
    assert (state["bulk"]["paused"], state["bulk"]["sensor_stopped"]) == (True, True)
    assert state["bulk"]["paused_by"] is None  # not in the pause table: stopped in the UI
    assert all(
        (state[lane]["paused"], state[lane]["sensor_stopped"]) == (False, False)
        for lane in ("critical", "transactional")
    )
    text = _lanes(database_url, "status").output
    assert "lane bulk          PAUSED: its outbox sensor (bulk_outbox_sensor) is stopped" in text
    assert "lane critical      not paused" in text
