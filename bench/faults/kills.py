"""The kill schedule: ``kill -9`` of the stack's processes at random moments during a drain.

Targets, by what their command line says they are: the daemon and the code server (each
restarted at once, as an orchestrator would), run processes (spawned by the code server: a lane
worker or a batch send run), step processes (the multiprocess executor's spawned children,
which outlive a killed run process) and the webhook receiver (restarted). A kind with no live
process at that moment is skipped for another.
"""

import contextlib
import random
import threading
import time
from collections import Counter

import psutil

from bench.faults.stack import Stack

KINDS = ("run", "step", "daemon", "code_server", "receiver")
WEIGHTS = {"run": 4, "step": 4, "daemon": 1, "code_server": 1, "receiver": 1}


def kind_of(proc: psutil.Process) -> str | None:
    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    if "spawn_main" in cmdline:
        # The code server starts each run in a spawned process; the run's multiprocess
        # executor spawns its steps. A step whose run was killed is an orphan: still a step.
        try:
            parent = " ".join(proc.parent().cmdline()) if proc.parent() else ""
        except psutil.Error:
            parent = ""
        return "run" if "grpc" in parent else "step"
    if "execute_run" in cmdline:
        return "run"
    if "dagster-daemon" in cmdline or "dagster._daemon" in cmdline:
        # The daemon spawns helpers with the same name; only the one we started counts.
        return "daemon_child"
    if "api grpc" in cmdline:
        return "code_server"
    if "webhooks serve" in cmdline:
        return "receiver"
    return None


class KillSchedule:
    """From a thread: every ``every_s`` (jittered) kill one process of a random kind."""

    def __init__(
        self,
        stack: Stack,
        every_s: float,
        rng: random.Random,
        kinds: tuple[str, ...] = KINDS,
        min_age_s: float = 10.0,
        min_run_age_s: float = 1.0,
    ) -> None:
        #: A service younger than this is left alone: killing a daemon or code server again
        #: before it has come up would only keep the system from doing anything.
        self.min_age_s = min_age_s
        #: Runs and steps need far less: a batch run lives a few seconds, and a run killed
        #: as it starts is a fault worth having.
        self.min_run_age_s = min_run_age_s
        self.stack = stack
        self.every_s = every_s
        self.rng = rng
        self.kinds = kinds
        self.killed: Counter = Counter()
        #: Draws of a kind that had no process old enough to kill at that moment.
        self.skipped = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kills", daemon=True)

    def start(self) -> "KillSchedule":
        if self.every_s > 0 and self.kinds:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s * self.rng.uniform(0.5, 1.5)):
            try:
                self.kill_one(patience_s=self.every_s / 2)
            except Exception as exc:  # a fault of the harness must not end the run silently
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def candidates(self) -> dict[str, list[psutil.Process]]:
        found: dict[str, list[psutil.Process]] = {kind: [] for kind in self.kinds}
        daemon = self.stack.daemon
        now = time.time()
        for proc in self.stack.processes():
            kind = kind_of(proc)
            if daemon is not None and daemon.process is not None and proc.pid == daemon.process.pid:
                kind = "daemon"
            if kind not in found:
                continue
            min_age_s = self.min_run_age_s if kind in ("run", "step") else self.min_age_s
            try:
                if now - proc.create_time() < min_age_s:
                    continue
            except psutil.Error:
                continue
            found[kind].append(proc)
        return found

    def kill_one(self, patience_s: float = 0.0) -> str | None:
        """Kill one process of a kind drawn by weight, waiting up to ``patience_s`` for one to
        be alive (batch runs come and go); none if that kind has none by then.

        Drawing the kind first keeps each kind's rate fixed: while runs are down, the daemon
        and code server are not killed more often for being the only ones left.
        """
        kind = self.rng.choices(self.kinds, weights=[WEIGHTS[k] for k in self.kinds])[0]
        deadline = time.monotonic() + patience_s
        found = self.candidates()[kind]
        while not found and time.monotonic() < deadline and not self._stop.wait(0.25):
            found = self.candidates()[kind]
        if not found:
            self.skipped += 1
            return None
        proc = self.rng.choice(found)
        with contextlib.suppress(psutil.Error):
            proc.kill()
            psutil.wait_procs([proc], timeout=10)
        self.killed[kind] += 1
        return kind


class Supervisor:
    """Restarts the daemon, the code server and the receiver when they die, as an
    orchestrator (systemd, Kubernetes) would; from its own thread, so kills go on meanwhile."""

    def __init__(self, stack: Stack, every_s: float = 1.0) -> None:
        self.stack = stack
        self.every_s = every_s
        self.restarts: Counter = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)

    def start(self) -> "Supervisor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.check()

    def check(self) -> None:
        """Each service on its own: one that keeps failing to start must not keep the others
        down."""
        stack = self.stack
        for name, process, start in (
            ("code_server", stack.code_server, stack.start_code_server),
            ("receiver", stack.receiver, stack.start_receiver),
            ("daemon", stack.daemon.process if stack.daemon else None, self._start_daemon),
        ):
            if process is None or process.poll() is None:
                continue
            try:
                start()
                self.restarts[name] += 1
            except Exception as exc:
                self.errors.append(f"{name}: {type(exc).__name__}: {exc}")

    def _start_daemon(self) -> None:
        daemon = self.stack.daemon
        if daemon is not None:
            with contextlib.suppress(Exception):
                daemon._log.close()
        self.stack.start_daemon()
