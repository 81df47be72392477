"""The funnel's rates, per template and overall, over the newest days of the warehouse.

Each rate is defined once, in ``analytics/email_funnel_daily.sql``: a count over a count.
``RATES`` names those two counts per rate (tests hold it, and every rate any SQL file computes,
to that file), and every reader here sums them over its window and divides as the model does,
so the asset metadata, the chart, the demo and the CLI print the analysts' numbers.

``template_rates`` is the one reader: the asset metadata, the chart, ``funnel_report`` (the demo)
and the CLI call it. Its window is the newest ``days`` days of ``email_funnel_daily`` (by the UTC
day each message was created), ending on the newest day with messages, as the rate checks'
window does.
"""

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any

import duckdb

from email_platform.warehouse.build import FUNNEL, FUNNEL_DAILY, model_sql
from email_platform.warehouse.files import connect_read_only
from email_platform.warehouse.views import shadowed


@dataclass(frozen=True)
class Rate:
    """``name`` = ``numerator`` / ``denominator``, both count columns of email_funnel_daily."""

    name: str
    numerator: str
    denominator: str

    @property
    def definition(self) -> str:
        return f"{self.numerator} / {self.denominator}"


RATES: tuple[Rate, ...] = (
    Rate("acceptance_rate", "accepted", "messages"),
    Rate("delivery_rate", "delivered", "accepted"),
    Rate("open_rate", "human_opened", "delivered"),
    Rate("machine_open_rate", "machine_opened", "delivered"),
    Rate("click_rate", "clicked", "delivered"),
    Rate("click_to_open_rate", "clicked", "human_opened"),
    Rate("bounce_rate", "bounced", "accepted"),
    Rate("hard_bounce_rate", "hard_bounced", "accepted"),
    Rate("complaint_rate", "complained", "delivered"),
)
RATES_BY_NAME = {rate.name: rate for rate in RATES}
# The rates plotted as asset metadata, overall and per template.
HEADLINE_RATES = (
    "delivery_rate",
    "open_rate",
    "machine_open_rate",
    "click_rate",
    "bounce_rate",
    "complaint_rate",
)
# The counts a reader sums: every numerator and denominator, and the funnel's other steps.
COUNTS = (
    "messages",
    "accepted",
    "delivered",
    "human_opened",
    "machine_opened",
    "clicked",
    "bounced",
    "hard_bounced",
    "complained",
    "unsubscribed",
)
RATE_WINDOW_DAYS = 7


@dataclass(frozen=True)
class FunnelRates:
    """Counts and rates over a window: one row per template (by name) and one overall."""

    # The window: the newest ``days`` days (None: every day) ending on ``last_day``.
    days: int | None
    first_day: date | None
    last_day: date | None
    overall: dict[str, Any]
    templates: list[dict[str, Any]]

    def rate(self, name: str, template: str | None = None) -> float | None:
        """One rate, of one template or (``template=None``) of every message in the window."""
        if name not in RATES_BY_NAME:
            raise ValueError(f"not a rate: {name}")
        if template is None:
            return self.overall[name]
        row = next((r for r in self.templates if r["template"] == template), None)
        return None if row is None else row[name]

    @property
    def suffix(self) -> str:
        """How metadata keys name the window: ``7d`` for the last seven days, ``all`` for all."""
        return "all" if self.days is None else f"{self.days}d"

    @property
    def scope(self) -> str:
        return "all days" if self.days is None else f"last {self.days} days"

    @property
    def window(self) -> str:
        """The window in words, for the metadata, the chart and the demo."""
        if self.last_day is None:
            return "no messages yet"
        return (
            f"{self.scope}, {self.first_day} to {self.last_day} "
            "(UTC, by the day each message was created)"
        )

    def metadata_entries(self) -> dict[str, float]:
        """The headline rates as plotted metadata, ``<rate>_<suffix>`` overall and
        ``<template>_<rate>_<suffix>`` per template; a rate without a denominator is left out."""
        entries = {
            f"{name}_{self.suffix}": self.overall[name]
            for name in HEADLINE_RATES
            if self.overall[name] is not None
        }
        for row in self.templates:
            prefix = _key(row["template"])
            entries.update(
                {
                    f"{prefix}_{name}_{self.suffix}": row[name]
                    for name in HEADLINE_RATES
                    if row[name] is not None
                }
            )
        return entries


def _key(template: str | None) -> str:
    return re.sub(r"[^a-z0-9_]+", "_", str(template).lower()).strip("_") or "unknown"


def template_rates(
    warehouse_path: str | os.PathLike[str],
    *,
    days: int | None = RATE_WINDOW_DAYS,
    event_ids: Sequence[str] | None = None,
) -> FunnelRates:
    """Counts and rates per template and overall over the newest ``days`` days of the
    published snapshot (None: every day), optionally of some events only.

    ``template_rates(path).rate("open_rate", "welcome")`` is the welcome email's open rate over
    the last seven days: what email_funnel_daily plots as ``2 open rate, welcome, 7d (%)`` and
    ``analytics/questions/welcome_open_rate_last_7_days.sql`` answers
    (``rates_by_template_last_7_days.sql``: every template's).
    """
    connection = connect_read_only(warehouse_path)
    try:
        return rates_of(connection, days=days, event_ids=event_ids)
    finally:
        connection.close()


def rates_of(
    connection: duckdb.DuckDBPyConnection,
    *,
    days: int | None = RATE_WINDOW_DAYS,
    event_ids: Sequence[str] | None = None,
) -> FunnelRates:
    """``template_rates`` on an open connection to a warehouse."""
    if days is not None and days < 1:
        raise ValueError(f"days must be at least 1, got {days}")
    first_day, last_day = connection.execute(
        f"SELECT min(day), max(day) FROM {FUNNEL_DAILY}"
    ).fetchone()
    if last_day is not None and days is not None:
        first_day = last_day - timedelta(days=days - 1)
    window = ""
    if days is not None:
        window = f"WHERE day > (SELECT max(day) FROM {FUNNEL_DAILY}) - {int(days)}"
    sums = ", ".join(f"coalesce(sum({name}), 0)::BIGINT AS {name}" for name in COUNTS)
    rates = ", ".join(
        f"{rate.numerator} / nullif({rate.denominator}, 0) AS {rate.name}" for rate in RATES
    )
    try:
        source = FUNNEL_DAILY if event_ids is None else _daily_of_events(connection, event_ids)
        cursor = connection.execute(
            f"""
            WITH counts AS (
                SELECT template, grouping(template) = 1 AS overall, {sums}
                FROM {source} {window}
                GROUP BY ROLLUP (template)
            )
            SELECT * EXCLUDE (overall), {rates} FROM counts ORDER BY overall DESC, template
            """
        )
        names = [d[0] for d in cursor.description]
        rows = [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]
    finally:
        connection.execute("DROP TABLE IF EXISTS temp.main._rate_daily")
        connection.execute("DROP TABLE IF EXISTS temp.main._rate_events")
    # ROLLUP puts the overall row first (ordered so) even with no messages at all.
    return FunnelRates(days, first_day, last_day, rows[0], rows[1:])


def _daily_of_events(connection: duckdb.DuckDBPyConnection, event_ids: Sequence[str]) -> str:
    """The daily model itself over only these events' funnel rows, as a temp table: their
    counts are counted as the model counts them, not by a second copy of its SQL."""
    connection.execute(
        "CREATE OR REPLACE TEMP TABLE _rate_events AS SELECT unnest(?::VARCHAR[]) AS event_id",
        [list(event_ids)],
    )
    with shadowed(connection, {FUNNEL: "event_id IN (SELECT event_id FROM _rate_events)"}):
        connection.execute(
            f"CREATE OR REPLACE TEMP TABLE _rate_daily AS\n{model_sql(FUNNEL_DAILY)}"
        )
    return "temp.main._rate_daily"
