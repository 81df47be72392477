"""``dagster-celery worker`` processes for the send steps (``EMAIL_PLATFORM_EXECUTOR=celery``).

The worker is Dagster's own (``dagster-celery worker start -A dagster_celery.app``); this module
gives it the same broker, backend and queues the run workers submit to, read from the same
``EMAIL_PLATFORM_CELERY_*`` settings, so the two cannot disagree.
"""

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from email_platform.common import config
from email_platform.jobs.executors import celery_app_args


def write_worker_config(settings: config.ExecutorSettings, directory: Path) -> Path:
    """The ``-y`` file of ``dagster-celery worker start``: the executor's config block."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "email_platform_celery.yaml"
    path.write_text(yaml.safe_dump({"execution": {"config": celery_app_args(settings)}}))
    return path


def worker_command(
    settings: config.ExecutorSettings,
    config_path: Path,
    *,
    name: str,
    queues: Sequence[str] = (),
    concurrency: int = 1,
    loglevel: str = "INFO",
) -> list[str]:
    """The ``dagster-celery worker start`` command line.

    ``concurrency`` is how many steps the worker runs at once, each in a prefork child of its
    own; a lane-worker step keeps its child for its whole lifetime (minutes).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    for queue in queues:
        if not queue or not queue.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"queue {queue!r}: letters, digits, _ and - only")
    executable = Path(sys.executable).with_name("dagster-celery")
    # One comma-separated -q: dagster-celery turns each -q into a -Q of its own, and Celery 5
    # keeps only the last -Q, so a worker given two would silently serve one.
    queue_args = ["-q", ",".join(queues or settings.queues())]
    return [
        str(executable) if executable.exists() else "dagster-celery",
        *("worker", "start", "-A", "dagster_celery.app", "-y", str(config_path)),
        *("-n", name, "-l", loglevel, *queue_args),
        "--",
        f"--concurrency={concurrency}",
        "--pool=prefork",
        # No worker-to-worker chatter: each host's workers stand alone on the broker.
        "--without-gossip",
        "--without-mingle",
    ]


def worker_path(env: Mapping[str, str]) -> str:
    """``PATH`` with this interpreter's scripts first: ``dagster-celery`` runs ``celery``."""
    scripts = str(Path(sys.executable).parent)
    return os.pathsep.join([scripts, env.get("PATH", os.defpath)])


class CeleryWorkerProcess:
    """One ``dagster-celery`` worker in a process group of its own (for tests and the stack)."""

    def __init__(
        self,
        name: str,
        env: Mapping[str, str],
        log_path: Path,
        *,
        queues: Sequence[str] = (),
        concurrency: int = 1,
    ) -> None:
        self.name = name
        self.env = {**os.environ, **env}
        self.log_path = log_path
        self.queues = list(queues)
        self.concurrency = concurrency
        self.process: subprocess.Popen | None = None

    def start(self) -> "CeleryWorkerProcess":
        settings = config.executor_settings(self.env)
        home = config.dagster_home(self.env)
        self.env["DAGSTER_HOME"] = str(home)
        self.env["PATH"] = worker_path(self.env)
        config_path = write_worker_config(settings, home / "celery")
        command = worker_command(
            settings,
            config_path,
            name=self.name,
            queues=self.queues,
            concurrency=self.concurrency,
        )
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            command,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the worker and its children at once, as a host that dies would."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Warm shutdown (SIGTERM: the worker finishes its steps), then kill what is left."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout_s)
        self.kill()
        self._log.close()
        self.process = None
