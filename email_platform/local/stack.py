"""The production stack on one machine: ``email-platform stack up`` / ``stack down``.

What a deployment runs, each part its own process group, started in the background:

* PostgreSQL (the machine's server): the application database and the Dagster instance's
  run, event-log and schedule storage (dagster-postgres), two databases created if absent;
* ``dagster-daemon`` (sensors, run queue, run monitoring) and ``dagster-webserver`` (the UI);
* ``webhooks serve --workers N``: N receiver processes behind one port;
* ``dagster-celery`` workers on the broker: one serving only the ``critical`` queue, so bulk
  never holds the slots critical mail needs, and ``celery_workers`` serving the rest. The run
  queue lets no more lane-worker runs start than there are Celery slots for them: a run whose
  step waits in Celery's queue would be given up by its lane sensor for never starting;
* the sandbox provider (no real provider is reachable here), posting signed webhooks to the
  receiver.

``up`` writes ``stack.json`` (process ids, URLs) and ``stack.env`` (the settings, to ``source``
before running other commands against the stack) in the stack's directory; ``down`` asks lane
workers to hand back what they hold, stops every process group and keeps the databases unless
asked to drop them.
"""

import base64
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url

from email_platform.common import config
from email_platform.local.celery_worker import CeleryWorkerProcess
from email_platform.local.dagster_home import (
    WORKSPACE_YAML,
    DaemonProcess,
    PostgresStorage,
    drain_lane_workers,
    render_dagster_yaml,
    wait_for,
)
from email_platform.local.webserver import WebserverProcess
from email_platform.mail.routes import DEMO_ROUTES

STATE_FILE = "stack.json"
ENV_FILE = "stack.env"
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,40}$")


class StackError(RuntimeError):
    """The stack cannot be brought up or down; the message says which part and why."""


@dataclass
class StackSettings:
    directory: Path
    #: Any database on the server (used to create the stack's own two).
    postgres_url: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    #: The application database's name; the Dagster instance's is ``<name>_dagster``.
    name: str = "email_platform"
    receivers: int = 2
    celery_workers: int = 2
    celery_concurrency: int = 2
    #: Resident critical lane workers; their Celery worker has one slot more, for a successor.
    critical_workers: int = 1
    broker: str = "redis://127.0.0.1:6379/0"
    receiver_port: int = 8026
    webserver_port: int = 3000
    sandbox_port: int = 8025
    sandbox_latency_ms: float = 0.0
    #: The sandbox posts webhooks for what it accepts to the receivers.
    webhooks: bool = True
    #: ``EMAIL_PLATFORM_LANES`` overrides, merged over the stack's own.
    lanes: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: More settings for every process (e.g. ``EMAIL_PLATFORM_SANDBOX_BATCH_MAX``).
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise StackError(f"stack name {self.name!r}: lower-case letters, digits and _ only")
        for label, value in (
            ("receivers", self.receivers),
            ("celery_workers", self.celery_workers),
            ("celery_concurrency", self.celery_concurrency),
            ("critical_workers", self.critical_workers),
        ):
            if not isinstance(value, int) or value < 1:
                raise StackError(f"{label} must be a whole number of at least 1, not {value!r}")
        for label, port in (
            ("receiver_port", self.receiver_port),
            ("webserver_port", self.webserver_port),
            ("sandbox_port", self.sandbox_port),
        ):
            if not 1 <= port <= 65535:
                raise StackError(f"{label} must be 1 to 65535, not {port!r}")
        if not 0 <= self.sandbox_latency_ms <= 60_000:  # also refuses NaN
            raise StackError(
                f"sandbox_latency_ms must be 0 to 60000, not {self.sandbox_latency_ms}"
            )
        from email_platform.common.errors import ConfigurationError

        try:  # the Celery workers would refuse it later, with a traceback
            config.executor_settings({config.PREFIX + "CELERY_BROKER": self.broker})
        except ConfigurationError as exc:
            raise StackError(str(exc)) from None
        if self.lane_slots < 2:
            raise StackError(
                "celery_workers x celery_concurrency must be at least 2: transactional and bulk "
                "lane workers each hold a Celery slot"
            )

    @property
    def lane_slots(self) -> int:
        """Celery slots for the transactional and bulk lanes' steps."""
        return self.celery_workers * self.celery_concurrency


def _admin_url(settings: StackSettings) -> URL:
    try:
        url = make_url(settings.postgres_url)
    except Exception as exc:  # any parse failure is the user's URL
        raise StackError(f"--postgres {settings.postgres_url!r} is not a URL: {exc}") from None
    if not url.drivername.startswith("postgresql"):
        raise StackError(f"--postgres must be a postgresql:// URL, not {url.drivername}://")
    return url


def _create_database(admin: URL, name: str) -> None:
    engine = create_engine(admin, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            exists = connection.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
            ).first()
            if exists is None:
                connection.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # say which server refused
        raise StackError(
            f"cannot create database {name} on {admin.render_as_string()}: "
            f"{exc.__class__.__name__}: {exc}"
        ) from None
    finally:
        engine.dispose()


def drop_databases(settings: StackSettings) -> None:
    admin = _admin_url(settings)
    engine = create_engine(admin, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            for name in (settings.name, f"{settings.name}_dagster"):
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        engine.dispose()


def _lanes(settings: StackSettings) -> dict[str, dict[str, Any]]:
    # Bulk gets the lane slots transactional does not need; every lane worker has a slot.
    bulk_workers = settings.lane_slots - 1
    lanes: dict[str, dict[str, Any]] = {
        "critical": {"workers": settings.critical_workers},
        "transactional": {"workers": 1},
        "bulk": {"workers": bulk_workers},
    }
    for lane, overrides in settings.lanes.items():
        lanes.setdefault(lane, {}).update(overrides)
    return lanes


def stack_env(settings: StackSettings) -> dict[str, str]:
    """The settings every process of the stack runs with."""
    directory = settings.directory.resolve()
    app_url = _admin_url(settings).set(database=settings.name)
    env_file = directory / ENV_FILE
    earlier = env_file.read_text() if env_file.exists() else ""

    def kept(name: str) -> str | None:
        """A secret of an earlier ``up``: links and signatures already out stay valid."""
        match = re.search(rf"{name}=(\S+)", earlier)
        return shlex.split(match.group(1))[0] if match else None

    secret = kept("SANDBOX_WEBHOOK_SECRET")
    return {
        "DAGSTER_HOME": str(directory / "dagster"),
        "EMAIL_PLATFORM_HOME": str(directory),
        "EMAIL_PLATFORM_DATABASE_URL": app_url.render_as_string(hide_password=False),
        "EMAIL_PLATFORM_WAREHOUSE": str(directory / "warehouse.duckdb"),
        "EMAIL_PLATFORM_PROVIDER": "sandbox",
        # The stack runs the demo's mail (the bench publishes its events).
        config.ROUTES_SETTING: DEMO_ROUTES,
        "EMAIL_PLATFORM_SANDBOX_BASE_URL": f"http://127.0.0.1:{settings.sandbox_port}",
        "EMAIL_PLATFORM_SANDBOX_WEBHOOK_SECRET": secret
        or "whsec_" + base64.b64encode(os.urandom(24)).decode(),
        # One-click unsubscribe links in bulk mail point at the receivers.
        "EMAIL_PLATFORM_UNSUBSCRIBE_SECRET": kept("UNSUBSCRIBE_SECRET")
        or base64.urlsafe_b64encode(os.urandom(24)).decode(),
        "EMAIL_PLATFORM_UNSUBSCRIBE_BASE_URL": f"http://127.0.0.1:{settings.receiver_port}",
        "EMAIL_PLATFORM_LANES": json.dumps(_lanes(settings), sort_keys=True),
        "EMAIL_PLATFORM_EXECUTOR": "celery",
        "EMAIL_PLATFORM_CELERY_BROKER": settings.broker,
        "EMAIL_PLATFORM_CELERY_LANE_QUEUES": "critical=critical",
        **settings.env,
    }


def _dagster_yaml(settings: StackSettings) -> str:
    admin = _admin_url(settings)
    storage = PostgresStorage(
        hostname=admin.host or "127.0.0.1",
        port=admin.port or 5432,
        db_name=f"{settings.name}_dagster",
        username=admin.username or "postgres",
        password=admin.password or "",
    )
    lanes = _lanes(settings)
    bulk, transactional = lanes["bulk"]["workers"], lanes["transactional"]["workers"]
    # Room for every lane worker, a critical successor and the warehouse refresh (which runs
    # on this host, not on Celery).
    critical = lanes["critical"]["workers"]
    return render_dagster_yaml(
        max_runs=critical + transactional + bulk + 2,
        bulk_runs=bulk,
        transactional_runs=transactional,
        postgres=storage,
    )


def _spawn(args: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "email_platform.cli", *args],
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def receiver_processes(url: str, want: int, timeout_s: float = 60.0) -> set[int]:
    """The receiver processes seen answering ``/health`` on ``url`` (a connection each), until
    ``want`` of them have or ``timeout_s`` is up: uvicorn's workers start one by one."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < want and time.monotonic() < deadline:
        try:
            seen.add(int(httpx.get(f"{url}/health", timeout=2.0).json()["process"]))
        except (httpx.HTTPError, ValueError, KeyError):
            time.sleep(0.2)
    return seen


def _state_path(directory: Path) -> Path:
    return directory / STATE_FILE


def read_state(directory: Path) -> dict[str, Any] | None:
    path = _state_path(directory)
    return json.loads(path.read_text()) if path.exists() else None


def _write_private(path: Path, content: str) -> None:
    """Write ``content`` readable by its owner only (it holds URLs with passwords and the
    webhook secret), atomically: a killed ``up`` never leaves half a file."""
    partial = path.with_name(path.name + ".partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(content)
    os.replace(partial, path)


def _group_alive(pid: int) -> bool:
    if pid <= 0:  # os.killpg(-1 or 0, ...) would mean other groups than the stack's
        return False
    # A leader that is this process's exited child stays a zombie (and its group "alive")
    # until reaped: reap it first.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def status(directory: Path) -> dict[str, bool]:
    """Each process group of the stack in ``directory``: alive or not."""
    state = read_state(directory)
    return {} if state is None else {n: _group_alive(p) for n, p in state["processes"].items()}


def up(settings: StackSettings, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Bring the stack up; returns (and writes) its state. Refuses if it is already up."""
    directory = settings.directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    if any(status(directory).values()):
        raise StackError(f"a stack is already up in {directory}: run `email-platform stack down`")
    admin = _admin_url(settings)
    for name in (settings.name, f"{settings.name}_dagster"):
        _create_database(admin, name)
    env = stack_env(settings)
    from email_platform.db.engine import make_engine, upgrade

    engine = make_engine(env["EMAIL_PLATFORM_DATABASE_URL"])
    try:
        upgrade(engine)
    finally:
        engine.dispose()
    home = Path(env["DAGSTER_HOME"])
    home.mkdir(exist_ok=True)
    _write_private(home / "dagster.yaml", _dagster_yaml(settings))
    (home / "workspace.yaml").write_text(WORKSPACE_YAML)
    _write_private(
        directory / ENV_FILE,
        "".join(f"export {key}={shlex.quote(value)}\n" for key, value in sorted(env.items())),
    )
    from dagster import DagsterInstance

    # Heartbeats of an earlier stack's daemon would make this one look ticking at once.
    with DagsterInstance.from_config(str(home)) as instance:
        instance.wipe_daemon_heartbeats()
    logs = directory / "logs"
    logs.mkdir(exist_ok=True)
    receiver_url = f"http://127.0.0.1:{settings.receiver_port}"
    sandbox_url = env["EMAIL_PLATFORM_SANDBOX_BASE_URL"]
    processes: dict[str, int] = {}
    state = {
        "directory": str(directory),
        "name": settings.name,
        "postgres_url": settings.postgres_url,
        "processes": processes,
        "urls": {
            "receiver": receiver_url,
            "webserver": f"http://127.0.0.1:{settings.webserver_port}",
            "sandbox": sandbox_url,
        },
    }

    def record(name: str, pid: int) -> None:
        processes[name] = pid
        _write_private(_state_path(directory), json.dumps(state, indent=2))  # down works now

    try:
        record(
            "sandbox",
            _spawn(
                [
                    "sandbox",
                    "serve",
                    "--port",
                    str(settings.sandbox_port),
                    "--latency-ms",
                    str(settings.sandbox_latency_ms),
                    *(
                        ["--webhook-url", f"{receiver_url}/webhooks/sandbox"]
                        if settings.webhooks
                        else []
                    ),
                ],
                env,
                logs / "sandbox.log",
            ).pid,
        )
        record(
            "receiver",
            _spawn(
                [
                    "webhooks",
                    "serve",
                    "--port",
                    str(settings.receiver_port),
                    "--workers",
                    str(settings.receivers),
                ],
                env,
                logs / "receiver.log",
            ).pid,
        )
        workers = [
            CeleryWorkerProcess(
                "critical",
                env,
                logs / "celery-critical.log",
                queues=["critical"],
                concurrency=settings.critical_workers + 1,
            )
        ] + [
            CeleryWorkerProcess(
                f"w{i}",
                env,
                logs / f"celery-w{i}.log",
                queues=["dagster"],
                concurrency=settings.celery_concurrency,
            )
            for i in range(1, settings.celery_workers + 1)
        ]
        for worker in workers:
            worker.start()
            assert worker.process is not None
            record(f"celery-{worker.name}", worker.process.pid)
        webserver = WebserverProcess(
            home, env, log_path=logs / "webserver.log", port=settings.webserver_port
        ).start()
        assert webserver.process is not None
        record("webserver", webserver.process.pid)
        daemon = DaemonProcess(home, env, log_path=logs / "daemon.log").start()
        assert daemon.process is not None
        record("daemon", daemon.process.pid)

        echo("waiting for the sandbox, the receivers, the webserver and the daemon")
        if not wait_for(lambda: _answers(f"{sandbox_url}/_sandbox/stats"), 60, 0.5):
            raise StackError(f"the sandbox did not answer; see {logs / 'sandbox.log'}")
        seen = receiver_processes(receiver_url, settings.receivers)
        if len(seen) < settings.receivers:
            raise StackError(
                f"{len(seen)} of {settings.receivers} receiver processes answered; "
                f"see {logs / 'receiver.log'}"
            )
        if not webserver.wait_until_ready(180):
            raise StackError(f"the webserver did not load the code; see {logs / 'webserver.log'}")
        if not daemon.wait_until_ticking(180):
            raise StackError(f"the daemon's sensors did not start; see {logs / 'daemon.log'}")
    except BaseException:
        if read_state(directory) is not None:
            down(directory, drain_s=0.0, echo=echo)
        raise
    return state


#: Stopped in this order: nothing new is started once the daemon is gone.
_STOP_ORDER = ("daemon", "webserver", "receiver", "sandbox")


def down(
    directory: Path,
    *,
    drain_s: float = 30.0,
    drop: bool = False,
    echo: Callable[[str], None] = print,
) -> list[str]:
    """Stop the stack in ``directory``; returns the names of the groups it stopped."""
    directory = directory.resolve()
    state = read_state(directory)
    if state is None:
        raise StackError(f"no stack in {directory} ({STATE_FILE} not found)")
    processes: dict[str, int] = state["processes"]
    home = directory / "dagster"
    if drain_s > 0 and _group_alive(processes.get("daemon", 0)):
        echo("asking lane workers to hand back what they hold")
        try:
            drain_lane_workers(home, drain_s)
        except Exception as exc:  # stopping must go on whatever the drain met
            echo(
                f"could not ask lane workers to stop ({exc.__class__.__name__}: {exc}); "
                "stopping anyway (their claims are recovered when their leases end)"
            )
    order = [n for n in _STOP_ORDER if n in processes]
    order[1:1] = sorted(n for n in processes if n.startswith("celery-"))
    stopped: list[str] = []
    for name in order:
        pid = processes[name]
        if _group_alive(pid):
            _end_group(pid)
            stopped.append(name)
    echo(f"stopped {', '.join(stopped) or 'nothing (already down)'}")
    if drop:
        drop_databases(
            StackSettings(directory, postgres_url=state["postgres_url"], name=state["name"])
        )
        echo(f"dropped databases {state['name']} and {state['name']}_dagster")
    _state_path(directory).unlink()
    return stopped


def _end_group(pid: int, timeout_s: float = 20.0) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    if not wait_for(lambda: not _group_alive(pid), timeout_s, 0.2):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        wait_for(lambda: not _group_alive(pid), 5.0, 0.1)
