"""A local Dagster instance for the demo, end-to-end tests and the send benchmark: dagster.yaml,
workspace, daemon.

Production uses ``deploy/dagster.yaml`` (PostgreSQL storage); this one keeps everything in
local files under ``DAGSTER_HOME`` by default (the benchmark asks for PostgreSQL storage) and
uses the same run queue shape: per-lane tag limits so critical mail always has a free run slot,
and ``dagster/priority`` to dequeue it first.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

_DAGSTER_YAML = """\
# Written by email-platform for local runs. Production: see deploy/dagster.yaml.
{storage}run_queue:
  max_concurrent_runs: {max_runs}
  dequeue_interval_seconds: 1
  dequeue_use_threads: true
  tag_concurrency_limits:
{reserve_note}    - key: email/lane
      value: bulk
      limit: {bulk_runs}
    - key: email/lane
      value: transactional
      limit: {transactional_runs}
run_monitoring:
  enabled: true
  poll_interval_seconds: 5
  start_timeout_seconds: {start_timeout_s}
sensors:
  use_threads: true
  num_workers: 4
telemetry:
  enabled: false
"""

_RESERVE_NOTE = """\
    # Bulk and transactional never take every slot: critical always has room.
"""

_POSTGRES_STORAGE = """\
storage:
  # dagster-postgres's storage, whose connections the daemon holds open (jobs/storage.py).
  custom:
    module: email_platform.jobs.storage
    class: HeldPostgresStorage
    config:
      postgres_db:
        hostname: {hostname}
        port: {port}
        username: {username}
        password: {password}
        db_name: {db_name}
        # psycopg 3 rejects dagster-postgres's parameterized NOTIFY; psycopg2 works.
        scheme: postgresql+psycopg2
"""

WORKSPACE_YAML = """\
load_from:
  - python_module:
      module_name: email_platform.definitions
      location_name: email_platform
"""


@dataclass(frozen=True)
class PostgresStorage:
    """Run, event-log and schedule storage in one PostgreSQL database (dagster-postgres).

    The local servers the benchmark and tests use trust auth: no password.
    """

    hostname: str
    db_name: str
    port: int = 5432
    username: str = "postgres"
    password: str = ""


def render_dagster_yaml(
    *,
    max_runs: int = 6,
    bulk_runs: int | None = None,
    transactional_runs: int | None = None,
    start_timeout_s: int = 120,
    postgres: PostgresStorage | None = None,
) -> str:
    """The local instance's dagster.yaml; the defaults are the demo's.

    ``bulk_runs`` and ``transactional_runs`` default to a third and a half of ``max_runs``;
    ``postgres`` replaces the local-file storage under ``DAGSTER_HOME``.
    """
    bulk_runs = max(1, max_runs // 3) if bulk_runs is None else bulk_runs
    transactional_runs = max(1, max_runs // 2) if transactional_runs is None else transactional_runs
    storage = ""
    if postgres is not None:
        # A JSON string is a YAML double-quoted scalar: any password stays one value. Non-ASCII
        # stays as it is: YAML would read JSON's surrogate-pair escapes as two characters.
        password = json.dumps(postgres.password, ensure_ascii=False)
        storage = _POSTGRES_STORAGE.format(**{**asdict(postgres), "password": password})
    return _DAGSTER_YAML.format(
        storage=storage,
        max_runs=max_runs,
        # Say critical has a reserve only when these limits leave it one.
        reserve_note=_RESERVE_NOTE if bulk_runs + transactional_runs < max_runs else "",
        bulk_runs=bulk_runs,
        transactional_runs=transactional_runs,
        start_timeout_s=start_timeout_s,
    )


def prepare_home(home: Path, *, max_runs: int = 6) -> Path:
    """Create ``home`` with a dagster.yaml and workspace.yaml (kept if already there)."""
    home.mkdir(parents=True, exist_ok=True)
    dagster_yaml = home / "dagster.yaml"
    if not dagster_yaml.exists():
        dagster_yaml.write_text(render_dagster_yaml(max_runs=max_runs))
    workspace = home / "workspace.yaml"
    if not workspace.exists():
        workspace.write_text(WORKSPACE_YAML)
    return workspace


class DaemonProcess:
    """``dagster-daemon run`` in a child process: sensors tick, queued runs launch.

    ``dagster-daemon`` exits cleanly on SIGTERM (``dagster dev`` may leave children behind).
    """

    def __init__(self, home: Path, env: Mapping[str, str], log_path: Path | None = None) -> None:
        self.home = home
        self.env = {**os.environ, **env, "DAGSTER_HOME": str(home)}
        self.log_path = log_path or home / "daemon.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> "DaemonProcess":
        workspace = prepare_home(self.home)
        # Create the instance's storage here, once: the daemon and anyone polling the instance
        # would otherwise race to run the same first migrations on a fresh DAGSTER_HOME.
        from dagster import DagsterInstance

        from email_platform.sensors.runs import hold_warm_workers

        with DagsterInstance.from_config(str(self.home)) as instance:
            hold_warm_workers(instance, 0.0)  # a drain before the last stop held them off
        daemon = Path(sys.executable).with_name("dagster-daemon")
        command = [str(daemon)] if daemon.exists() else [sys.executable, "-m", "dagster._daemon"]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [*command, "run", "-w", str(workspace)],
            env=self.env,
            cwd=str(self.home),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def wait_until_ticking(self, timeout_s: float = 90.0) -> bool:
        """Block until the sensor daemon has sent a heartbeat (the lane sensors are live)."""
        from dagster import DagsterInstance

        def sensor_daemon_up() -> bool:
            if not self.alive():
                return False
            with DagsterInstance.from_config(str(self.home)) as instance:
                return "SENSOR" in instance.get_daemon_heartbeats()

        return wait_for(sensor_daemon_up, timeout_s, interval_s=1.0)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 30.0, drain_s: float = 0.0) -> None:
        """Stop the daemon, first giving in-flight runs up to ``drain_s`` seconds to finish.

        Lane workers are asked to end first: they would otherwise wait out their idle time.
        """
        if self.process is None:
            return
        if drain_s > 0 and self.alive():
            drain_lane_workers(self.home, drain_s)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        # The daemon's code server (and anything else in its session) can outlive it: end the
        # whole process group it was started in.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self._log.close()
        self.process = None

    def __enter__(self) -> "DaemonProcess":
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # On success let running runs end cleanly; on an error, stop at once.
        self.stop(drain_s=60.0 if exc_type is None else 0.0)


def wait_for_runs_to_finish(home: Path, timeout_s: float = 60.0) -> bool:
    """Block until no run of ``home``'s instance is starting, started or canceling.

    Run workers live in the daemon's process group, so stopping the daemon ends them too; a
    run killed while writing its last events would stay STARTED in the UI.
    """
    from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

    in_flight = [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]

    def settled() -> bool:
        with DagsterInstance.from_config(str(home)) as instance:
            return not instance.get_run_ids(RunsFilter(statuses=in_flight), limit=1)

    return wait_for(settled, timeout_s, interval_s=0.5)


def end_lane_workers(home: Path) -> int:
    """Ask every unfinished lane-worker run to end; returns how many are unfinished.

    Workers otherwise stay until their idle time is up. Each is tagged ``STOP_TAG``: it sees
    its batch in flight through, gives back what it holds (idempotency keys kept) and ends as a
    success, where a terminate would show a canceled run in the UI.
    """
    from dagster import DagsterInstance

    from email_platform.sensors.runs import stop_lane_workers

    with DagsterInstance.from_config(str(home)) as instance:
        return stop_lane_workers(instance)


def drain_lane_workers(home: Path, drain_s: float) -> None:
    """Give in-flight runs up to ``drain_s`` seconds to finish, lane workers asked to end first."""
    from dagster import DagsterInstance

    from email_platform.sensors.runs import hold_warm_workers

    deadline = time.monotonic() + drain_s
    # The sensors still tick: one may start a worker for claims a stopped one gave back. Stop
    # until none is left (it converges once nothing is due); warm workers are held off, or each
    # one stopped would be replaced. The next start lifts the hold.
    with DagsterInstance.from_config(str(home)) as instance:
        hold_warm_workers(instance, time.time() + drain_s + 600)
    while end_lane_workers(home) and time.monotonic() < deadline:
        wait_for_runs_to_finish(home, min(10.0, max(0.0, deadline - time.monotonic())))
    wait_for_runs_to_finish(home, max(0.0, deadline - time.monotonic()))


def wait_for(predicate, timeout_s: float, interval_s: float = 0.5) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
