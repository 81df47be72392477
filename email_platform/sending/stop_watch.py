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

    Calling the watch returns the first reason found, at once. A check that raises is raised
    again from the next call, in the worker's loop, as when the loop asked itself.
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
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stop-check", daemon=True)

    def __enter__(self) -> "StopWatch":
        self.reason = self.check()
        if self.reason is None:
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.every_s + 5)

    def __call__(self) -> str | None:
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self.reason

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                reason = self.check()
            except Exception as exc:  # handed to the loop, which ends the worker with it
                self._error = exc
                return
            if reason is not None:
                self.reason = reason
                return
