"""Prometheus metrics read from the operational tables at scrape time.

``metrics_registry(engine)`` is a fresh ``CollectorRegistry`` holding one ``OperationalCollector``
(nothing global: the receiver and ``email-platform metrics serve`` each build their own);
``metrics_endpoint(engine)`` is the Starlette endpoint that serves it, and
``create_metrics_app(engine)`` the app ``metrics serve`` runs. docs/metrics.md lists the series.

What a scrape reads stays bounded however large the tables grow:

* queue gauges: one range over the outbox's (lane, status, available_at) index;
* the latency histogram: messages accepted inside the window, over the ``updated_at`` index;
* counters of the append-only tables (attempts, dead letters): the collector counts the whole
  table once, at its first scrape, then only rows past the last id it settled (a primary-key
  range), so ``_total`` series are the table's totals and never go down within a process;
* open dead letters over the status index; lane workers over their small table.
"""

import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from email_platform.common.lanes import LANES
from email_platform.common.timeutil import as_utc, utcnow
from email_platform.store import attempts, circuits, messages, metrics_queries

log = logging.getLogger(__name__)

PREFIX = "email_platform_"
#: Publish-to-accepted buckets, in seconds (the +Inf bucket is added).
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0)
LATENCY_WINDOW_S = 900.0
#: A worker whose last heartbeat is older than this is not counted alive (one definition, with
#: ``email-platform status``).
WORKER_STALE_S = metrics_queries.WORKER_STALE_S
#: Rows of an append-only table older than this are counted once and kept: no transaction that
#: writes attempts or dead letters stays open this long.
SETTLE_S = 300.0


def retry_reason(outcome: str, http_status: int | None) -> str:
    """Why an attempt failed, from its HTTP status (a bounded label: no error text)."""
    if outcome == "accepted":
        return "none"
    if http_status is None:
        return "no_response"  # network error or timeout: the provider never answered
    if http_status == 429:
        return "rate_limited"
    if http_status >= 500:
        return "server_error"
    if http_status == 408:
        return "timeout"
    if http_status == 425:
        return "too_early"
    return "rejected" if 400 <= http_status < 500 else f"http_{http_status // 100}xx"


class _GrowingCounts:
    """Counts, by label tuple, of a table that only grows, read incrementally by id.

    ``count(connection, after_id, upto_id)`` counts rows in an id range; ``settled(connection,
    before)`` is the id up to which rows are old enough never to change again. Each read adds
    the rows settled since the last one to the kept totals, then counts only the recent tail.
    """

    def __init__(
        self,
        count: Callable[[Connection, int, int | None], dict[Any, int]],
        settled: Callable[[Connection, datetime], int],
    ) -> None:
        self._count, self._settled = count, settled
        self._lock = threading.Lock()  # concurrent scrapes share the kept totals
        self._upto: int | None = None
        self._kept: Counter = Counter()

    def read(self, connection: Connection, now: datetime) -> Counter:
        with self._lock:
            boundary = self._settled(connection, now - timedelta(seconds=SETTLE_S))
            if self._upto is None:
                self._kept = Counter(self._count(connection, 0, boundary))
                self._upto = boundary
            elif boundary > self._upto:
                self._kept.update(self._count(connection, self._upto, boundary))
                self._upto = boundary
            totals = Counter(self._kept)
            totals.update(self._count(connection, self._upto, None))
            return totals


class OperationalCollector(Collector):
    """Reads the platform's tables on every scrape; see the module docstring for the cost."""

    def __init__(
        self,
        engine: Engine,
        *,
        latency_window_s: float = LATENCY_WINDOW_S,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.engine = engine
        self.latency_window_s = latency_window_s
        self.clock = clock
        self._attempts = _GrowingCounts(
            attempts.counts_in_range, metrics_queries.settled_attempt_id
        )
        self._dead_letters = _GrowingCounts(
            metrics_queries.dead_letter_counts, metrics_queries.settled_dead_letter_id
        )

    def describe(self) -> Iterable[Metric]:
        return []  # registering must not query the database

    def collect(self) -> Iterator[Metric]:
        started = time.monotonic()
        up = GaugeMetricFamily(PREFIX + "database_up", "1 if this scrape read the database.")
        try:
            families = self._read()
        except SQLAlchemyError as exc:
            log.warning("metrics: cannot read the database: %s", exc.__class__.__name__)
            families = []
            up.add_metric([], 0)
        else:
            up.add_metric([], 1)
        yield up
        yield from families
        duration = GaugeMetricFamily(
            PREFIX + "scrape_duration_seconds", "Seconds this scrape spent reading the database."
        )
        duration.add_metric([], time.monotonic() - started)
        yield duration

    def _read(self) -> list[Metric]:
        now = self.clock()
        lanes = [lane.value for lane in LANES]
        with self.engine.connect() as connection:
            queues = metrics_queries.lane_queues(connection, lanes, now)
            since = now - timedelta(seconds=self.latency_window_s)
            latency = messages.accepted_latency_histogram(connection, since, LATENCY_BUCKETS)
            tried = self._attempts.read(connection, now)
            dead = self._dead_letters.read(connection, now)
            open_dead = metrics_queries.open_dead_letters(connection)
            workers = metrics_queries.live_lane_workers(
                connection, now - timedelta(seconds=WORKER_STALE_S)
            )
            not_closed = circuits.by_provider(circuits.not_closed(connection, now))
        every_lane = sorted({*lanes, *queues, *latency, *workers})
        return [
            *_queue_families(queues, every_lane, now),
            _latency_family(latency, every_lane, self.latency_window_s),
            *_attempt_families(tried),
            *_dead_letter_families(dead, open_dead),
            _gauge(
                "lane_workers_alive",
                "Lane-worker runs with a recent heartbeat.",
                workers,
                every_lane,
            ),
            _circuit_family(not_closed),
        ]


def _circuit_family(not_closed: dict[str, dict[str, int]]) -> Metric:
    family = GaugeMetricFamily(
        PREFIX + "provider_circuit_not_closed",
        "Sending processes whose circuit breaker for the provider is open (turning sends away) "
        "or half_open (one probe out); no sample: every circuit closed.",
        labels=["provider", "state"],
    )
    for provider, states in sorted(not_closed.items()):
        for state, n in sorted(states.items()):
            family.add_metric([provider, state], n)
    return family


def _gauge(name: str, doc: str, values: dict[str, float], lanes: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=["lane"])
    for lane in lanes:
        family.add_metric([lane], values.get(lane, 0))
    return family


def _queue_families(
    queues: dict[str, metrics_queries.LaneQueue], lanes: list[str], now: datetime
) -> list[Metric]:
    empty = metrics_queries.LaneQueue()
    ages = {}
    for lane in lanes:
        oldest = as_utc(queues.get(lane, empty).oldest_due_at)
        ages[lane] = max(0.0, (now - oldest).total_seconds()) if oldest else 0.0
    return [
        _gauge(
            "queue_depth",
            "Pending events due now (send_after passed or none): the lane's backlog.",
            {lane: q.due for lane, q in queues.items()},
            lanes,
        ),
        _gauge(
            "queue_oldest_due_age_seconds",
            "Seconds the oldest due pending event has been due (0 when none).",
            ages,
            lanes,
        ),
        _gauge(
            "queue_scheduled",
            "Pending events whose send_after is still ahead (not backlog).",
            {lane: q.scheduled for lane, q in queues.items()},
            lanes,
        ),
        _gauge(
            "queue_in_flight",
            "Events claimed by a run and not finished.",
            {lane: q.in_flight for lane, q in queues.items()},
            lanes,
        ),
    ]


def _latency_family(
    latency: dict[str, tuple[list[int], int, float]], lanes: list[str], window_s: float
) -> Metric:
    # A gauge histogram: the window slides, so counts fall as messages leave it and rate()
    # would be wrong; read the buckets directly (histogram_quantile over _bucket).
    family = GaugeHistogramMetricFamily(
        PREFIX + "publish_to_accepted_seconds",
        f"Seconds from publish (or a later send_after) to the provider's acceptance, over "
        f"messages accepted in the last {window_s:g} s.",
        labels=["lane"],
    )
    for lane in lanes:
        buckets, count, total = latency.get(lane, ([0] * len(LATENCY_BUCKETS), 0, 0.0))
        pairs = [(floatToGoString(b), n) for b, n in zip(LATENCY_BUCKETS, buckets, strict=True)]
        family.add_metric([lane], [*pairs, ("+Inf", count)], gsum_value=total)
    return family


def _attempt_families(tried: Counter) -> list[Metric]:
    by_reason: Counter = Counter()
    sends: Counter = Counter()
    for (lane, outcome, http_status, provider), n in tried.items():
        by_reason[(lane, outcome, retry_reason(outcome, http_status))] += n
        if outcome == "accepted":
            sends[(lane, provider or "unknown")] += n
    attempts_family = CounterMetricFamily(
        PREFIX + "attempts",
        "Provider calls by outcome (accepted, transient, permanent) and why they failed.",
        labels=["lane", "outcome", "reason"],
    )
    for labels, n in sorted(by_reason.items()):
        attempts_family.add_metric(list(labels), n)
    sends_family = CounterMetricFamily(
        PREFIX + "sends", "Messages the provider accepted.", labels=["lane", "provider"]
    )
    for labels, n in sorted(sends.items()):
        sends_family.add_metric(list(labels), n)
    return [attempts_family, sends_family]


def _dead_letter_families(dead: Counter, open_dead: dict[tuple[str, str], int]) -> list[Metric]:
    written = CounterMetricFamily(
        PREFIX + "dead_letters", "Dead letters written, by reason.", labels=["lane", "reason"]
    )
    for labels, n in sorted(dead.items()):
        written.add_metric(list(labels), n)
    still_open = GaugeMetricFamily(
        PREFIX + "dead_letters_open",
        "Dead letters neither replayed nor discarded.",
        labels=["lane", "reason"],
    )
    for labels, n in sorted(open_dead.items()):
        still_open.add_metric(list(labels), n)
    return [written, still_open]


def metrics_registry(engine: Engine, **collector_options: Any) -> CollectorRegistry:
    """A registry of its own holding one ``OperationalCollector`` over ``engine``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(OperationalCollector(engine, **collector_options))
    return registry


def _encoder(accept: str) -> tuple[Callable[[CollectorRegistry], bytes], str]:
    """The format the scraper asks for; the classic text format for anything unreadable (a
    hostile Accept header can make the library's version parsing raise)."""
    try:
        return choose_encoder(accept)
    except Exception:
        return generate_latest, CONTENT_TYPE_PLAIN_0_0_4


def metrics_endpoint(
    engine: Engine, **collector_options: Any
) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint serving the metrics of ``engine``: mount it with
    ``Route("/metrics", metrics_endpoint(engine), methods=["GET"])``."""
    registry = metrics_registry(engine, **collector_options)

    async def metrics(request: Request) -> Response:
        encode, content_type = _encoder(request.headers.get("accept", ""))
        body = await run_in_threadpool(encode, registry)  # the scrape queries the database
        return Response(body, headers={"Content-Type": content_type})

    return metrics


def create_metrics_app(engine: Engine, **collector_options: Any) -> Starlette:
    """``GET /metrics`` and nothing else: what ``email-platform metrics serve`` runs."""
    endpoint = metrics_endpoint(engine, **collector_options)
    return Starlette(routes=[Route("/metrics", endpoint, methods=["GET"])])
