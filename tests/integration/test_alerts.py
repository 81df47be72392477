"""Alerts: each condition raises one alert, kept while it lasts and resolved when it ends; each
raise and resolve launches one alert run; the Slack-compatible post is retried and bounded."""

import json
from datetime import timedelta

import pytest
from dagster import (
    DagsterEvent,
    DagsterEventType,
    DagsterInstance,
    RunRequest,
    SkipReason,
    build_sensor_context,
)
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import update
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from email_platform.common.timeutil import utcnow
from email_platform.db.schema import email_outbox
from email_platform.jobs import (
    alert_job,
    lane_worker_job,
    lane_worker_run_config,
    send_email_job,
    send_run_config,
)
from email_platform.operating.alerts import notify
from email_platform.operating.alerts.conditions import Condition
from email_platform.resources import AppDatabase, EmailProviderResource, LanePolicy
from email_platform.resources.alerts import AlertSettings
from email_platform.sandbox.asgi import BackgroundServer
from email_platform.sensors.alerts import alerts_sensor
from email_platform.store import alerts as alert_rows
from email_platform.store import dead_letters, lane_pauses, lane_workers
from tests.support import dead_letters_of, publish_across_lanes, run_send, signup


def _resources(database_url: str, sandbox_url: str, **changes) -> dict:  # type: ignore[no-untyped-def]
    return {
        "email_database": AppDatabase(url=database_url),
        "email_lanes": LanePolicy(overrides_json=changes.pop("lanes", None)),
        "email_provider": changes.pop(
            "provider", EmailProviderResource(provider="sandbox", base_url=sandbox_url)
        ),
        "email_alerts": AlertSettings(**changes),
    }


def _evaluate(resources: dict, instance: DagsterInstance | None = None):  # type: ignore[no-untyped-def]
    with build_sensor_context(resources=resources, instance=instance) as context:
        return alerts_sensor(context)


def _changes(result) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """alert key -> raised | resolved, from a sensor result's run requests."""
    if isinstance(result, SkipReason):
        return {}
    requests: list[RunRequest] = result.run_requests
    return {r.tags["email/alert"]: r.tags["email/alert_state"] for r in requests}


def test_an_alert_is_raised_once_kept_while_it_lasts_resolved_and_raised_again(engine):
    now = utcnow()
    late = Condition(key="lane_late:bulk", kind="lane_late", lane="bulk", summary="late 1")
    with engine.begin() as connection:
        first = alert_rows.reconcile(connection, [late], {"lane_late"}, now)
        again = alert_rows.reconcile(connection, [late], {"lane_late"}, now)
        # A kind not evaluated this time is left open.
        unknown = alert_rows.reconcile(connection, [], {"dead_letters"}, now)
        gone = alert_rows.reconcile(connection, [], {"lane_late"}, now)
        back = alert_rows.reconcile(connection, [late], {"lane_late"}, now)
        (row,) = alert_rows.open_alerts(connection)
    assert [(t.key, t.state, t.raise_count) for t in first] == [("lane_late:bulk", "raised", 1)]
    assert again == [] and unknown == []
    assert [(t.key, t.state) for t in gone] == [("lane_late:bulk", "resolved")]
    assert [(t.state, t.raise_count) for t in back] == [("raised", 2)]
    assert row.raise_count == 2 and row.resolved_at is None


def test_a_dead_letter_raises_one_alert_until_it_is_discarded(engine, database_url, sandbox):
    resources = _resources(database_url, sandbox.base_url)
    assert _changes(_evaluate(resources)) == {}
    bad = signup(engine, "u1", email="u1+reject@example.com")
    assert run_send(database_url, sandbox.base_url, "transactional", [bad]).success is False
    assert len(dead_letters_of(engine, bad)) == 1

    raised = _evaluate(resources)
    (key,) = _changes(raised)
    assert key.startswith("dead_letters:") and _changes(raised)[key] == "raised"
    (request,) = raised.run_requests
    config = request.run_config["ops"]["announce_alert"]["config"]
    assert "1 open dead letter(s)" in config["summary"] and "transactional 1" in config["summary"]
    # Another dead letter of the same reason does not raise a second alert.
    worse = signup(engine, "u2", email="u2+reject@example.com")
    run_send(database_url, sandbox.base_url, "transactional", [worse])
    assert isinstance(_evaluate(resources), SkipReason)

    with engine.begin() as connection:
        ids = [row.dead_letter_id for row in dead_letters.list_letters(connection)]
        dead_letters.discard(connection, ids, utcnow())
    assert _changes(_evaluate(resources)) == {key: "resolved"}
    assert isinstance(_evaluate(resources), SkipReason)


def test_a_lane_whose_oldest_due_event_is_past_its_target_raises_an_alert(
    engine, database_url, sandbox
):
    resources = _resources(database_url, sandbox.base_url, lanes='{"critical": {"target_s": 60}}')
    ids = publish_across_lanes(engine, {"critical": 1, "transactional": 1, "bulk": 0})
    assert _changes(_evaluate(resources)) == {}  # nothing has waited a minute yet
    # Both became due two minutes ago (moved back, not waited for: a loaded machine's pace
    # changes nothing). Only critical is late: transactional is within its 5-minute target.
    with engine.begin() as connection:
        connection.execute(
            update(email_outbox).values(available_at=utcnow() - timedelta(minutes=2))
        )
    assert _changes(_evaluate(resources)) == {"lane_late:critical": "raised"}
    assert run_send(database_url, sandbox.base_url, "critical", ids[:1]).success
    assert _changes(_evaluate(resources)) == {"lane_late:critical": "resolved"}


def test_a_brake_pause_is_an_alert_and_an_operators_pause_is_not(engine, database_url, sandbox):
    resources = _resources(database_url, sandbox.base_url)
    with engine.begin() as connection:
        lane_pauses.pause(connection, "transactional", paused_by="ops", reason="x", now=utcnow())
        lane_pauses.pause(
            connection, "bulk", paused_by="brake:bounce_rate", reason="9% > 5%", now=utcnow()
        )
    result = _evaluate(resources)
    assert _changes(result) == {"brake:bulk": "raised"}
    (request,) = result.run_requests
    assert "9% > 5%" in request.run_config["ops"]["announce_alert"]["config"]["summary"]


def test_a_provider_that_cannot_be_configured_raises_an_alert(engine, database_url, sandbox):
    broken = EmailProviderResource(provider="postmark", api_key="", base_url="")
    resources = _resources(database_url, sandbox.base_url, provider=broken)
    result = _evaluate(resources)
    assert _changes(result) == {"configuration:provider": "raised"}
    summary = result.run_requests[0].run_config["ops"]["announce_alert"]["config"]["summary"]
    assert "POSTMARK" in summary.upper()
    fixed = _resources(database_url, sandbox.base_url)
    assert _changes(_evaluate(fixed)) == {"configuration:provider": "resolved"}


def test_a_failed_run_and_a_silent_worker_raise_alerts(engine, database_url, sandbox):
    instance = DagsterInstance.ephemeral()
    # Silent for a minute: a beat two minutes old is silent, a fresh one is not, at any pace.
    resources = _resources(database_url, sandbox.base_url, silent_worker_s=60)
    failed = instance.create_run_for_job(
        send_email_job, run_config=send_run_config("bulk", ["x"]), tags={"email/lane": "bulk"}
    )
    instance.report_run_failed(failed)
    worker = instance.create_run_for_job(
        lane_worker_job, run_config=lane_worker_run_config("bulk"), tags={"email/lane": "bulk"}
    )
    instance.report_dagster_event(
        DagsterEvent(DagsterEventType.RUN_START.value, job_name=lane_worker_job.name),
        worker.run_id,
    )
    with engine.begin() as connection:
        lane_workers.beat(connection, worker.run_id, "bulk", utcnow() - timedelta(minutes=2))
    changes = _changes(_evaluate(resources, instance))
    assert changes == {f"run_failed:{failed.run_id}": "raised", "worker_silent:bulk": "raised"}
    # The worker beats again: that alert resolves, the failed run's stays.
    with engine.begin() as connection:
        lane_workers.beat(connection, worker.run_id, "bulk", utcnow())
    assert _changes(_evaluate(resources, instance)) == {"worker_silent:bulk": "resolved"}


class _Chat:
    """A Slack-compatible webhook on loopback that fails the first ``fail`` posts."""

    def __init__(self, fail: int = 0, status: int = 503) -> None:
        self.fail, self.status, self.posts = fail, status, []

        async def receive(request: Request) -> JSONResponse:
            self.posts.append(json.loads(await request.body()))
            if len(self.posts) <= self.fail:
                return JSONResponse({"ok": False}, status_code=self.status)
            return JSONResponse({"ok": True})

        self.server = BackgroundServer(
            Starlette(routes=[Route("/hook", receive, methods=["POST"])])
        )

    def __enter__(self) -> str:
        return self.server.start() + "/hook"

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


def _transition(state: str = "raised") -> alert_rows.Transition:
    return alert_rows.Transition(
        key="lane_late:bulk",
        kind="lane_late",
        lane="bulk",
        severity="error",
        summary="bulk is late",
        state=state,
        raised_at=utcnow(),
        raise_count=1,
    )


def test_the_slack_post_is_retried_on_5xx_and_given_up_on_a_4xx():
    chat = _Chat(fail=2)
    with chat as url:
        assert notify.post(url, _transition(), base_delay_s=0.01) is None
    assert len(chat.posts) == 3 and "`lane_late:bulk`" in chat.posts[-1]["text"]
    refusing = _Chat(fail=10, status=400)
    with refusing as url:
        assert notify.post(url, _transition(), base_delay_s=0.01) == "HTTP 400"
    assert len(refusing.posts) == 1
    # Nothing listening: bounded attempts, an error named, no exception.
    error = notify.post("http://127.0.0.1:9/hook", _transition(), attempts=2, base_delay_s=0.01)
    assert error is not None and "Connect" in error


def test_the_alert_run_posts_the_alert_and_succeeds_when_the_chat_is_down():
    from email_platform.jobs import alert_run_config

    chat = _Chat()
    with chat as url:
        result = alert_job.execute_in_process(
            run_config=alert_run_config(_transition("resolved")),
            resources={"email_alerts": AlertSettings(slack_url=url)},
        )
    assert result.success
    assert result.output_for_node("announce_alert")["slack"] == "posted"
    assert chat.posts[0]["text"].startswith(":white_check_mark: RESOLVED `lane_late:bulk`")
    down = alert_job.execute_in_process(
        run_config=alert_run_config(_transition()),
        resources={"email_alerts": AlertSettings(slack_url="http://127.0.0.1:9/hook")},
    )
    assert down.success
    assert down.output_for_node("announce_alert")["slack"].startswith("not posted: ")


@given(st.text(max_size=200))
def test_any_configured_slack_url_is_accepted_or_refused_by_name(url):
    try:
        assert notify.check_url(url) == url
    except ValueError as exc:
        assert "alerts Slack URL" in str(exc)
    else:
        assert url.startswith(("http://", "https://"))


@pytest.mark.parametrize("state", ["raised", "resolved"])
def test_the_alert_log_line_is_one_json_object_with_its_key(state):
    line = notify.alert_line(_transition(state))
    assert json.loads(line)["alert"]["key"] == "lane_late:bulk"
    assert json.loads(line)["alert"]["state"] == state


def test_a_misconfigured_provider_fails_the_run_at_once_and_keeps_the_event(
    engine, database_url, sandbox
):
    from tests.support import event, step_events

    event_id = signup(engine, "u1")
    broken = EmailProviderResource(provider="postmark", api_key="", base_url="")
    result = run_send(database_url, sandbox.base_url, "transactional", [event_id], provider=broken)
    assert not result.success
    # No step retries: a missing key is as missing on the retry.
    assert step_events(result, "STEP_UP_FOR_RETRY") == []
    (failure,) = step_events(result, "STEP_FAILURE")
    assert "POSTMARK" in str(failure.event_specific_data.error).upper()
    assert event(engine, event_id).status == "pending"
