"""End to end: ``email-platform stack up`` / ``stack down``, the production stack on this
machine, through the real command line.

PostgreSQL holds both the application database and the Dagster instance; the daemon, the
webserver, two webhook receiver processes behind one port, a ``dagster-celery`` worker for the
critical queue and one for the rest, and the sandbox provider each run in a process group of
their own. Mail is published into the outbox, sent through Celery, and the sandbox's webhooks
come back through the receivers; a webhook posted many times at once, across both receiver
processes, is stored once.
"""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import URL

from email_platform.db.engine import make_engine
from email_platform.db.schema import webhook_inbox
from email_platform.local.dagster_home import wait_for
from email_platform.local.stack import receiver_processes
from email_platform.webhooks.standard import sign
from tests.support import (
    celery_workers_by_lane,
    outbox_statuses,
    publish_across_lanes,
    sandbox_messages,
)

BROKER = "redis://127.0.0.1:6379/12"
CLI = [sys.executable, "-m", "email_platform.cli", "stack"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stack_env(directory: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in (directory / "stack.env").read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = shlex.split(value)[0]
    return env


def _group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _databases(admin_url: URL, prefix: str) -> set[str]:
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        names = connection.execute(
            text("SELECT datname FROM pg_database WHERE datname LIKE :p"), {"p": prefix + "%"}
        ).scalars()
        found = set(names)
    admin.dispose()
    return found


def _post(url: str, body: bytes, headers: dict[str, str]) -> int:
    with httpx.Client(timeout=10.0) as client:  # a connection of its own each time
        return client.post(url, content=body, headers=headers).status_code


@pytest.mark.timeout(900)
def test_stack_up_sends_through_celery_takes_webhooks_on_two_receivers_and_down_stops_it(
    postgres_admin_url, tmp_path
):
    redis.Redis.from_url(BROKER).flushdb()
    name = f"ep_stack_{uuid.uuid4().hex[:8]}"
    directory = tmp_path / "stack"
    receiver_port, webserver_port, sandbox_port = (_free_port() for _ in range(3))
    admin = postgres_admin_url.render_as_string(hide_password=False)
    command = [
        *CLI,
        "up",
        "--dir",
        str(directory),
        "--postgres",
        admin,
        "--name",
        name,
        "--broker",
        BROKER,
        "--celery-workers",
        "1",
        "--concurrency",
        "2",
        "--receiver-port",
        str(receiver_port),
        "--webserver-port",
        str(webserver_port),
        "--sandbox-port",
        str(sandbox_port),
    ]
    state: dict = {}
    try:
        try:
            up = subprocess.run(
                command, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
            )
        finally:  # whatever it started, down must find (also if it was killed at the timeout)
            if (directory / "stack.json").exists():
                state = json.loads((directory / "stack.json").read_text())
        assert up.returncode == 0, up.stderr[-3000:]
        assert oct((directory / "stack.env").stat().st_mode & 0o777) == "0o600"
        assert set(state["processes"]) == {
            "sandbox",
            "receiver",
            "celery-critical",
            "celery-w1",
            "webserver",
            "daemon",
        }
        assert _databases(postgres_admin_url, name) == {name, f"{name}_dagster"}
        status = subprocess.run([*CLI, "status", "--dir", str(directory)], capture_output=True)
        assert status.returncode == 0, status.stdout

        env = _stack_env(directory)
        assert env["EMAIL_PLATFORM_DATABASE_URL"].startswith("postgresql")
        engine = make_engine(env["EMAIL_PLATFORM_DATABASE_URL"])
        ids = publish_across_lanes(engine, {"critical": 5, "transactional": 15, "bulk": 40})
        assert wait_for(lambda: outbox_statuses(engine, ids) == Counter(done=60), 300, 1.0), (
            outbox_statuses(engine, ids),
            (directory / "logs" / "daemon.log").read_text()[-3000:],
        )
        sandbox = state["urls"]["sandbox"]
        per_event = Counter(m["metadata"]["event_id"] for m in sandbox_messages(sandbox))
        assert set(per_event) == set(ids) and set(per_event.values()) == {1}

        # Steps ran on the Celery workers, critical ones only on the critical queue's worker.
        hosts = celery_workers_by_lane(Path(env["DAGSTER_HOME"]))
        assert hosts["critical"] == {"critical"}, hosts
        assert hosts["bulk"] == hosts["transactional"] == {"w1"}, hosts

        # The sandbox's webhooks (delivered, opened, bounced, ...) land through the receivers.
        def webhooks_in() -> bool:
            answer = httpx.get(f"{sandbox}/_sandbox/webhooks").json()
            planned = answer["webhooks"]
            delivered = all(r["outcome"] == "delivered" for r in planned)
            return bool(planned) and not answer["posting"] and delivered

        assert wait_for(webhooks_in, 120, 1.0)
        planned = httpx.get(f"{sandbox}/_sandbox/webhooks").json()["webhooks"]
        with engine.connect() as connection:
            stored = connection.execute(
                select(func.count())
                .select_from(webhook_inbox)
                .where(webhook_inbox.c.provider == "sandbox")
            ).scalar_one()
        assert stored == len(planned) >= 60  # one delivery webhook per message at least

        # One webhook posted 24 times at once over fresh connections to the port both
        # receiver processes serve is stored once.
        receiver = state["urls"]["receiver"]
        assert len(receiver_processes(receiver, 2, timeout_s=30)) == 2
        event = {**planned[0]["event"], "id": f"dup-{uuid.uuid4().hex}"}
        body = json.dumps(event).encode()
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "webhook-id": event["id"],
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(
                env["EMAIL_PLATFORM_SANDBOX_WEBHOOK_SECRET"], event["id"], timestamp, body
            ),
        }
        with ThreadPoolExecutor(8) as pool:
            answers = list(
                pool.map(lambda _: _post(f"{receiver}/webhooks/sandbox", body, headers), range(24))
            )
        assert all(200 <= status < 300 for status in answers), answers
        with engine.connect() as connection:
            copies = connection.execute(
                select(func.count())
                .select_from(webhook_inbox)
                .where(webhook_inbox.c.delivery_id == event["id"])
            ).scalar_one()
        assert copies == 1

        # The UI serves the code location from the PostgreSQL instance.
        answer = httpx.post(
            f"{state['urls']['webserver']}/graphql",
            json={
                "query": "{ repositoriesOrError { ... on RepositoryConnection { nodes { name "
                "jobs { name } } } } }"
            },
            timeout=30.0,
        ).json()
        jobs = {
            j["name"] for r in answer["data"]["repositoriesOrError"]["nodes"] for j in r["jobs"]
        }
        assert {"send_email_job", "lane_worker_job"} <= jobs
        engine.dispose()
    finally:
        down = subprocess.run(
            [*CLI, "down", "--dir", str(directory), "--drop-databases"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if down.returncode != 0:  # the databases at least
            admin_engine = create_engine(postgres_admin_url, isolation_level="AUTOCOMMIT")
            with admin_engine.connect() as connection:
                for db in (name, f"{name}_dagster"):
                    connection.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
            admin_engine.dispose()
        for pid in state.get("processes", {}).values():  # whatever down missed, end here
            if _group_alive(pid):
                os.killpg(pid, signal.SIGKILL)
    assert down.returncode == 0, down.stderr[-3000:]
    assert not [n for n, pid in state["processes"].items() if _group_alive(pid)]
    assert not (directory / "stack.json").exists()
    assert _databases(postgres_admin_url, name) == set()
