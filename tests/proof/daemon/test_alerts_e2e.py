"""Alerts through the real daemon: a dead letter made by a lane worker raises one alert, which
shows as an alert_job run in the instance and reaches a Slack-compatible webhook on loopback."""

import json
from pathlib import Path

import pytest
from dagster import DagsterInstance, DagsterRunStatus, RunsFilter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from email_platform.db.engine import make_engine, upgrade
from email_platform.local.dagster_home import DaemonProcess, wait_for
from email_platform.sandbox.asgi import BackgroundServer
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from tests.support import dead_letters_of, signup


def _alert_runs(home: Path) -> list:
    with DagsterInstance.from_config(str(home)) as instance:
        return list(instance.get_runs(RunsFilter(job_name="alert_job")))


@pytest.mark.timeout(300)
def test_a_dead_letter_raises_one_alert_run_and_one_chat_post(tmp_path):
    database_url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    engine = make_engine(database_url)
    upgrade(engine)
    posts: list[dict] = []

    async def hook(request: Request) -> JSONResponse:
        posts.append(json.loads(await request.body()))
        return JSONResponse({"ok": True})

    chat = BackgroundServer(Starlette(routes=[Route("/hook", hook, methods=["POST"])]))
    chat_url = chat.start() + "/hook"
    sandbox = SandboxServer(SandboxConfig())
    sandbox.start()
    home = tmp_path / "dagster"
    env = {
        "EMAIL_PLATFORM_DATABASE_URL": database_url,
        "EMAIL_PLATFORM_PROVIDER": "sandbox",
        "EMAIL_PLATFORM_SANDBOX_BASE_URL": sandbox.base_url,
        "EMAIL_PLATFORM_ALERTS_SLACK_URL": chat_url,
        "EMAIL_PLATFORM_HOME": str(tmp_path),
    }
    daemon = DaemonProcess(home, env)
    try:
        daemon.start()
        assert daemon.wait_until_ticking(), daemon.log_path.read_text()[-3000:]
        bad = signup(engine, "u1", email="u1+reject@example.com")
        assert wait_for(lambda: len(dead_letters_of(engine, bad)) == 1, 120), (
            daemon.log_path.read_text()[-3000:]
        )
        assert wait_for(
            lambda: any(r.status == DagsterRunStatus.SUCCESS for r in _alert_runs(home)), 150
        ), daemon.log_path.read_text()[-3000:]
        assert wait_for(lambda: len(posts) == 1, 30)
    finally:
        daemon.stop(drain_s=20.0)
        sandbox.stop()
        chat.stop()
        engine.dispose()

    (run,) = _alert_runs(home)
    assert run.tags["email/alert_state"] == "raised"
    assert run.tags["email/alert"].startswith("dead_letters:")
    assert posts[0]["text"].startswith(":rotating_light: RAISED `dead_letters:")
    assert "1 open dead letter(s)" in posts[0]["text"]
