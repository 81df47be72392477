"""Why a lane worker should stop, read on a thread of its own.

Reading it takes round trips to Dagster's storage (the run, every sensor's state) and to the
pause table: tens of milliseconds on a busy machine, which the worker's loop spent every couple
of seconds instead of claiming. A critical reset published then waited for it. A ``StopWatch``
asks on its own thread and the loop only reads the answer.
"""

import logging
import threading
from collections.abc import Callable
from typing import Any


class StopWatch:
    """``check`` (a reason to stop, or None) asked every ``every_s`` on a daemon thread, and
    once before the worker starts, so a worker started on a paused lane claims nothing.

    Calling the watch returns the first reason found, at once. A check that raises (the first
    one included) is raised again from the next call, in the worker's loop, as when the loop
    asked itself: the worker then ends through its own clean-up. ``every_s`` is a floor: a
    check with a throttle of its own reads no more often than that allows.
    """

    def __init__(
        self,
        check: Callable[[], str | None],
        every_s: float,
        *,
        log: logging.Logger | Any | None = None,
    ) -> None:
        self.check = check
        self.every_s = every_s
        self.log = log or logging.getLogger(__name__)
        self.reason: str | None = None
        self._error: Exception | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stop-check", daemon=True)

    def __enter__(self) -> "StopWatch":
        if self._read():
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.every_s + 5)

    def __call__(self) -> str | None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error
        return self.reason

    def _run(self) -> None:
        while not self._stop.wait(self.every_s) and self._read():
            pass

    def _read(self) -> bool:
        """Ask once; whether to go on asking (no reason found, no error)."""
        try:
            reason = self.check()
        except Exception as exc:  # handed to the loop, which ends the worker with it
            self.log.warning(f"the stop check failed ({type(exc).__name__}: {exc})")
            with self._lock:
                self._error = exc
            return False
        if reason is not None:
            self.reason = reason
            return False
        return True
