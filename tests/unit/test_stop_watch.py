"""A lane worker's stop check runs on a thread of its own: the worker's loop reads the answer
and never waits for Dagster's storage. Through a real worker run, a pause still ends it within
seconds (``test_lane_pauses.py``)."""

import threading
import time

import pytest

from email_platform.sending.stop_watch import StopWatch


class _SlowCheck:
    """Takes ``delay_s`` per read, as a read of a busy Dagster storage does; says ``reason``
    from read ``stop_at`` on."""

    def __init__(self, delay_s: float, stop_at: int, reason: str = "paused") -> None:
        self.delay_s, self.stop_at, self.reason = delay_s, stop_at, reason
        self.reads = 0
        self.reading = threading.Event()

    def __call__(self) -> str | None:
        self.reads += 1
        self.reading.set()
        time.sleep(self.delay_s)
        self.reading.clear()
        return self.reason if self.reads >= self.stop_at else None


def test_the_loop_reads_the_answer_without_waiting_for_the_check() -> None:
    check = _SlowCheck(delay_s=0.3, stop_at=3)
    with StopWatch(check, every_s=0.05) as watch:
        assert check.reads == 1  # the first read before the worker starts
        assert check.reading.wait(30)  # a later read, on the watch's thread
        started = time.monotonic()
        assert watch() is None
        assert time.monotonic() - started < check.delay_s / 2  # not a read of 0.3 s
        deadline = time.monotonic() + 5
        while watch() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch() == "paused"
    assert check.reads == 3  # no read after the reason was found


def test_a_worker_started_on_a_paused_lane_sees_it_before_its_first_claim() -> None:
    check = _SlowCheck(delay_s=0.0, stop_at=1, reason="canceled")
    with StopWatch(check, every_s=0.05) as watch:
        assert watch() == "canceled"
        time.sleep(0.2)
    assert check.reads == 1


def test_a_first_check_that_fails_is_raised_in_the_loop_not_before_it() -> None:
    """Raised from ``__enter__`` it would skip the worker's clean-up (giving back what a retried
    attempt held, recording its end)."""

    def check() -> str | None:
        raise ConnectionError("Dagster storage unreachable")

    with StopWatch(check, every_s=0.02) as watch:
        with pytest.raises(ConnectionError, match="unreachable"):
            watch()
        assert watch() is None  # raised once


def test_a_check_that_fails_fails_the_loop_that_reads_it() -> None:
    calls = 0

    def check() -> str | None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise ConnectionError("Dagster storage unreachable")
        return None

    with StopWatch(check, every_s=0.02) as watch:
        deadline = time.monotonic() + 5
        with pytest.raises(ConnectionError, match="unreachable"):
            while time.monotonic() < deadline:
                watch()
                time.sleep(0.01)
    assert calls == 2
