"""Shared-rate drains: lane workers with a limiter each, and counting a rate over a window."""

import dataclasses
import threading

from sqlalchemy import Engine

from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, LANES, Lane, LaneConfig
from email_platform.providers.sandbox import SandboxProvider
from email_platform.sending.shared_rate import SharedRateLimiter, plan_for
from email_platform.sending.worker import LaneWorker
from tests.support import batch_sender


def most_in_window(times: list[float], window_s: float) -> int:
    """The most of ``times`` inside any window of ``window_s`` seconds."""
    times = sorted(times)
    most, start = 0, 0
    for end, t in enumerate(times):
        while t - times[start] >= window_s:
            start += 1
        most = max(most, end - start + 1)
    return most


def rate_lane(**changes: object) -> LaneConfig:
    base: dict[str, object] = dict(
        batch_size=20, concurrency=8, worker_poll_s=0.02, worker_idle_s=0.5, retry_delay_s=0.05
    )
    return dataclasses.replace(DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL], **{**base, **changes})


def drain(
    engine: Engine, url: str, workers: int, rate: float, lane: LaneConfig | None = None
) -> None:
    """Run ``workers`` lane workers on threads, each with its own provider and shared-rate
    limiter (as worker processes have), until the lane is idle."""
    lane = lane or rate_lane()
    lanes = [lane if c == lane.lane else DEFAULT_LANE_CONFIGS[c] for c in LANES]
    plan = plan_for("sandbox", rate, lane, lanes)
    assert plan is not None
    runs = []
    for n in range(workers):
        provider = SandboxProvider(url, batch_max=1, max_connections=lane.concurrency, timeout_s=5)
        sender = batch_sender(engine, provider, lane)
        sender.rate_limiter = SharedRateLimiter(engine, plan)
        sender.provider = provider  # installs the shared limiter in place of the adapter's
        runs.append(LaneWorker(sender=sender, engine=engine, lane=lane, run_id=f"worker-{n}"))
    threads = [threading.Thread(target=w.run) for w in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    for worker in runs:
        worker.sender.close()
