"""The system the fault harness drains: application database, sandbox provider, webhook
receiver and a real ``dagster-daemon``, each a part the fault schedule may kill or cut.

* Application database: a SQLite file, or a PostgreSQL cluster of the harness's own (so it can
  be restarted, stopped and locked without touching the machine's server).
* Dagster instance: local files (SQLite) beside it, or a second owned PostgreSQL cluster.
* Sandbox provider: in the harness's process, which is never killed, so its record of what it
  accepted survives every fault. It posts signed webhooks to the receiver.
* Receiver: ``email-platform webhooks serve`` in its own process (killed and restarted).
* Code server: ``dagster api grpc`` in its own process on a loopback port, as a deployment
  runs it (restarted by the harness when killed, as an orchestrator would). A daemon that
  starts its own code server from a ``python_module`` workspace is blind for up to a minute
  after that server dies (it reloads its workspace every 60 s).
* Daemon: ``dagster-daemon run`` against that code server; its run and step processes are the
  kill schedule's main targets. Every process started for this stack
  carries ``EMAIL_PLATFORM_FAULTS_RUN`` in its environment, so the schedule finds exactly
  these, orphans included.
"""

import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from sqlalchemy import Engine
from sqlalchemy.engine import make_url

from bench.faults import stream
from bench.faults.pg import PgCluster
from email_platform.db.engine import make_engine, upgrade
from email_platform.local.dagster_home import (
    DaemonProcess,
    PostgresStorage,
    prepare_home,
    render_dagster_yaml,
)
from email_platform.sandbox.emitter import WebhookPlan
from email_platform.sandbox.server import SandboxConfig, SandboxServer

BIN = Path(sys.executable).parent
RUN_MARK = "EMAIL_PLATFORM_FAULTS_RUN"
WEBHOOK_ATTEMPTS = 48


@dataclass
class StackSettings:
    workdir: Path
    database: str = "sqlite"  # or "postgres"
    mode: str = "workers"  # or "batch" (workers: 0)
    seed: int = 1
    #: Random faults of the sandbox, on a key's first attempt.
    rate_429: float = 0.02
    rate_5xx: float = 0.02
    rate_accept_timeout: float = 0.002
    #: The connection cut mid-answer, before or after the sandbox accepted the message.
    rate_reset: float = 0.003
    rate_accept_reset: float = 0.002
    retry_after_style: str = "mixed"
    #: False: the sandbox behaves as a provider without idempotency keys.
    idempotency: bool = True
    webhooks: bool = True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lane_overrides(mode: str) -> dict[str, dict[str, Any]]:
    """Lane settings of the drain: the shipped ones, with retries short enough that a run of
    minutes sees them exhausted, and two bulk workers (two workers on one lane)."""
    quick = {"retry_delay_s": 0.2, "max_retry_delay_s": 2.0, "max_retries": 4}
    lanes: dict[str, dict[str, Any]] = {
        "critical": dict(quick),
        "transactional": dict(quick),
        "bulk": {**quick, "batch_size": 200, "workers": 2},
    }
    if mode == "batch":
        for lane in lanes.values():
            lane.update(workers=0, warm_workers=0, request_timeout_s=60, max_runs_per_tick=4)
    return lanes


class Stack:
    def __init__(self, settings: StackSettings) -> None:
        self.settings = settings
        self.work = settings.workdir
        self.work.mkdir(parents=True, exist_ok=True)
        self.mark = f"{os.getpid()}-{time.time_ns()}"
        self.app_pg: PgCluster | None = None
        self.dagster_pg: PgCluster | None = None
        self.receiver: subprocess.Popen | None = None
        self.daemon: DaemonProcess | None = None
        self.daemon_starts = 0
        self.receiver_starts = 0
        self.secret = "whsec_" + base64.b64encode(os.urandom(24)).decode()
        self.receiver_port = _free_port()
        self.code_server: subprocess.Popen | None = None
        self.code_server_port = _free_port()
        self.code_server_starts = 0
        self.receiver_url = f"http://127.0.0.1:{self.receiver_port}"

    # -- bring up ---------------------------------------------------------------------------
    def start(self) -> "Stack":
        s = self.settings
        if s.database == "postgres":
            self.app_pg = PgCluster(self.work / "pg_app").init()
            self.app_pg.start()
            self.app_url = self.app_pg.create_database("app")
        else:
            self.app_url = f"sqlite:///{self.work / 'app.sqlite3'}"
        self.engine: Engine = make_engine(self.app_url)
        upgrade(self.engine)
        stream.prepare(self.engine)
        plan = (
            WebhookPlan(
                webhook_url=f"{self.receiver_url}/webhooks/sandbox",
                secret=self.secret,
                # Real providers retry a webhook for hours; 8 attempts (about 20 s) are shorter
                # than the drain's database outage, so webhooks were given up as the receiver
                # answered 503. 48 retry for about 4 minutes.
                max_attempts=WEBHOOK_ATTEMPTS,
            )
            if s.webhooks
            else None
        )
        self.sandbox = SandboxServer(
            SandboxConfig(
                rate_429=s.rate_429,
                rate_5xx=s.rate_5xx,
                rate_accept_timeout=s.rate_accept_timeout,
                rate_reset=s.rate_reset,
                rate_accept_reset=s.rate_accept_reset,
                retry_after_s=0.3,
                retry_after_style=s.retry_after_style,
                timeout_delay_s=3.0,
                seed=s.seed,
                idempotency=s.idempotency,
                webhooks=plan,
            )
        )
        self.sandbox.start()
        self.start_receiver()
        self._write_home()
        self.start_code_server()
        self.start_daemon()
        return self

    def env(self) -> dict[str, str]:
        return {
            RUN_MARK: self.mark,
            "EMAIL_PLATFORM_HOME": str(self.work),
            "EMAIL_PLATFORM_DATABASE_URL": self.app_url,
            "EMAIL_PLATFORM_PROVIDER": "sandbox",
            "EMAIL_PLATFORM_SANDBOX_BASE_URL": self.sandbox.base_url,
            # Below the sandbox's 3 s stall: a timeout fault is a real client timeout.
            "EMAIL_PLATFORM_PROVIDER_TIMEOUT_S": "1.5",
            "EMAIL_PLATFORM_SANDBOX_WEBHOOK_SECRET": self.secret,
            "EMAIL_PLATFORM_LANES": json.dumps(lane_overrides(self.settings.mode)),
            "EMAIL_PLATFORM_ANALYTICS_REFRESH_S": "3600",
            "DAGSTER_HOME": str(self.home),
        }

    @property
    def home(self) -> Path:
        return self.work / "dagster_home"

    def _write_home(self) -> None:
        self.home.mkdir(exist_ok=True)
        postgres = None
        if self.settings.database == "postgres":
            self.dagster_pg = PgCluster(self.work / "pg_dagster").init()
            self.dagster_pg.start()
            self.dagster_pg.create_database("dagster")
            postgres = PostgresStorage(
                hostname="127.0.0.1", port=self.dagster_pg.port, db_name="dagster"
            )
        (self.home / "dagster.yaml").write_text(
            render_dagster_yaml(max_runs=8, bulk_runs=3, transactional_runs=3, postgres=postgres)
        )
        (self.home / "workspace.yaml").write_text(
            "load_from:\n  - grpc_server:\n      host: 127.0.0.1\n"
            f"      port: {self.code_server_port}\n      location_name: email_platform\n"
        )
        prepare_home(self.home)

    def start_code_server(self) -> None:
        log = open(self.work / "code_server.log", "ab")  # noqa: SIM115 - lives with the process
        self.code_server = subprocess.Popen(
            [
                str(BIN / "dagster"),
                "api",
                "grpc",
                "-m",
                "email_platform.definitions",
                "-h",
                "127.0.0.1",
                "-p",
                str(self.code_server_port),
            ],
            env={**os.environ, **self.env()},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.code_server_starts += 1
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.code_server_port), timeout=1),
            ):
                return
            if self.code_server.poll() is not None:
                break
            time.sleep(0.3)
        raise RuntimeError(f"the code server did not come up; see {self.work / 'code_server.log'}")

    def start_daemon(self) -> None:
        self.daemon = DaemonProcess(self.home, self.env(), self.work / "daemon.log").start()
        self.daemon_starts += 1
        if not self.daemon.wait_until_ticking(timeout_s=180):
            raise RuntimeError(f"dagster-daemon did not come up; see {self.daemon.log_path}")

    def start_receiver(self) -> None:
        log = open(self.work / "receiver.log", "ab")  # noqa: SIM115 - lives with the process
        self.receiver = subprocess.Popen(
            [
                str(BIN / "email-platform"),
                "webhooks",
                "serve",
                "--port",
                str(self.receiver_port),
                "--url",
                self.app_url,
            ],
            env={**os.environ, **self.env()},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.receiver_starts += 1
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.receiver.poll() is None:
            if self.receiver_healthy():
                return
            time.sleep(0.2)
        raise RuntimeError(f"the receiver did not come up; see {self.work / 'receiver.log'}")

    def receiver_healthy(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.receiver_url}/health", timeout=1).status_code == 200
        return False

    # -- the processes of this stack --------------------------------------------------------
    def processes(self) -> list[psutil.Process]:
        """Every live process started for this stack (orphans of killed parents included)."""
        found = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if proc.pid != os.getpid() and proc.environ().get(RUN_MARK) == self.mark:
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    def database_label(self) -> str:
        url = make_url(self.app_url)
        return url.get_backend_name()

    # -- tear down --------------------------------------------------------------------------
    def stop(self) -> None:
        if self.daemon is not None:
            with contextlib.suppress(Exception):
                self.daemon.stop(timeout_s=10)
        for process in (self.receiver, self.code_server):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        leftovers = self.processes()
        for proc in leftovers:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(leftovers, timeout=10)
        with contextlib.suppress(Exception):
            self.sandbox.stop()
        self.engine.dispose()
        for cluster in (self.app_pg, self.dagster_pg):
            if cluster is not None:
                cluster.destroy()
