"""Priority lanes: each has its own sensor, batch size, concurrency and retry policy.

A lane is what keeps a bulk backlog from delaying a password reset: separate sensors, separate
run tags (and so separate run-queue limits), separate knobs.
"""

from dataclasses import dataclass
from enum import StrEnum


class Lane(StrEnum):
    CRITICAL = "critical"
    TRANSACTIONAL = "transactional"
    BULK = "bulk"


LANES: tuple[Lane, ...] = (Lane.CRITICAL, Lane.TRANSACTIONAL, Lane.BULK)


@dataclass(frozen=True)
class LaneConfig:
    lane: Lane
    #: Most events one run carries.
    batch_size: int
    #: Provider requests in flight at once for one batch (tasks on one event loop for the HTTP
    #: adapters; for SMTP or a provider behind the circuit breaker, threads, at most 64). A lane
    #: worker with ``batches_in_flight`` N makes up to N x this, and opens that many
    #: connections: set both to stay within a provider's connection limit.
    concurrency: int
    #: How often the lane's sensor looks at the outbox (the daemon loop is ~5 s anyway).
    interval_s: int
    #: Retries of the send step after the first attempt.
    max_retries: int
    #: Base delay of the exponential backoff with full jitter.
    retry_delay_s: float
    #: Cap on any single wait, including a provider's Retry-After.
    max_retry_delay_s: float
    #: How long a run's claim holds unless renewed. A live run renews it every 10 s (a sixth
    #: of a shorter lease), so a run killed outright frees its events this long after.
    lease_s: int
    #: A requested batch that no run claimed within this long is requested again.
    request_timeout_s: int
    #: Most run requests one sensor tick yields.
    max_runs_per_tick: int
    #: ``dagster/priority`` of the lane's runs: the run queue dequeues higher first.
    run_priority: int
    #: Resident lane-worker runs kept alive while the lane has work (0: one launched run per
    #: batch). A worker claims batches itself as they come due, so an event waits for neither
    #: the sensor loop (~5 s) nor a run's process start (seconds under load).
    workers: int = 1
    #: How often an idle worker looks at the outbox.
    worker_poll_s: float = 0.5
    #: A worker stops claiming after this long; the sensor has started its successor by then.
    worker_lifetime_s: int = 900
    #: A worker that found nothing to do for this long ends (the sensor starts one on new work).
    worker_idle_s: int = 120
    #: Workers kept running with nothing due, like a Celery worker waiting on its queue: the
    #: first event after a quiet spell waits for no sensor tick and no run start. With any warm
    #: worker the lane's workers do not end for being idle (only at their lifetime, with a
    #: successor). 0 to ``workers``.
    warm_workers: int = 0
    #: How old the lane's oldest due event may get before the lane counts as late: what alerts
    #: and the latency test hold the lane to.
    target_s: float = 300.0
    #: Added to the niceness of the lane's worker processes (0 to 19): a bulk worker that keeps
    #: hundreds of calls in flight can use every core, and the critical lane must still get
    #: one at once. The scheduler still gives a nicer worker all CPU nobody else wants.
    nice: int = 0
    #: Batches a lane worker has with the provider at once. With one, a batch prepared while
    #: another is sent waits for it to be sent and recorded: a critical lane's one-event
    #: batches queued behind each other. A big batch gains nothing from more (it already keeps
    #: ``concurrency`` calls in flight).
    batches_in_flight: int = 1
    #: Most messages a second the lane sends, over every worker and run of it (0: no cap of
    #: its own). Shared through the database like the provider's rate (docs/rate-limits.md).
    rate_limit_per_s: float = 0.0
    #: Share of the provider's rate (``EMAIL_PLATFORM_PROVIDER_RATE_LIMIT_PER_S``) that only
    #: this lane may use; the other lanes draw from the rest. Nothing without a provider rate.
    rate_reserved_share: float = 0.0

    @property
    def calls_in_flight(self) -> int:
        """Most provider calls a run of the lane makes at once: ``concurrency`` per batch in
        flight (what its connections to the provider are sized for)."""
        return max(1, self.concurrency) * max(1, self.batches_in_flight)


DEFAULT_LANE_CONFIGS: dict[Lane, LaneConfig] = {
    Lane.CRITICAL: LaneConfig(
        lane=Lane.CRITICAL,
        batch_size=25,
        # A whole batch in flight at once: one provider round trip, not three, per batch.
        concurrency=25,
        interval_s=5,
        max_retries=5,
        retry_delay_s=1.0,
        max_retry_delay_s=30.0,
        lease_s=60,
        request_timeout_s=180,
        max_runs_per_tick=4,
        run_priority=10,
        # Half of what a password reset may wait is this poll: 0.1 s keeps the lane's p99 under
        # 0.5 s with a provider answering in 100 ms, for ten indexed reads a second.
        worker_poll_s=0.1,
        worker_idle_s=600,
        # One worker always polling: a password reset waits for no sensor tick and no run start.
        warm_workers=1,
        # A reset published while another is with the provider goes out at once (four in
        # flight lengthened the tail instead: bench/README.md).
        batches_in_flight=2,
        target_s=30.0,
        # With a provider rate set, a bulk backlog cannot take the rate password resets need.
        rate_reserved_share=0.1,
    ),
    Lane.TRANSACTIONAL: LaneConfig(
        lane=Lane.TRANSACTIONAL,
        batch_size=100,
        concurrency=100,
        interval_s=5,
        max_retries=4,
        retry_delay_s=2.0,
        max_retry_delay_s=120.0,
        lease_s=60,
        request_timeout_s=300,
        max_runs_per_tick=4,
        run_priority=5,
    ),
    Lane.BULK: LaneConfig(
        lane=Lane.BULK,
        batch_size=1000,
        # With a provider answering in 100 ms and one message a call, calls in flight set the
        # speed (256 / 0.1 s); on the event-loop path each costs a connection and a task.
        concurrency=256,
        # Lane workers make a tick cheap (it only checks that a worker runs), and a backlog
        # should not wait 15 s for its first worker.
        interval_s=5,
        max_retries=3,
        retry_delay_s=5.0,
        max_retry_delay_s=300.0,
        lease_s=60,
        request_timeout_s=900,
        max_runs_per_tick=2,
        run_priority=0,
        # A campaign's first mail waits up to this for an idle worker; a poll is two indexed
        # reads that stop at the first due row.
        worker_poll_s=0.25,
        worker_idle_s=60,
        target_s=3600.0,
        nice=5,
    ),
}


#: A lane-worker run tagged with this (any value) finishes its batch in flight, gives back what it
#: holds and ends as a success: how the demo and a clean shutdown stop workers. Terminating the
#: run also stops it, but Dagster then shows the run as canceled.
STOP_TAG = "email/stop"


def outbox_sensor_name(lane: str) -> str:
    """The lane's outbox sensor: stopping it pauses the lane (its workers watch for that)."""
    return f"{lane}_outbox_sensor"


def parse_lane(value: str) -> Lane:
    try:
        return Lane(value)
    except ValueError:
        raise ValueError(
            f"unknown lane {value!r}; expected one of {', '.join(lane.value for lane in LANES)}"
        ) from None
