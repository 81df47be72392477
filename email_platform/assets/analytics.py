"""Analytics assets: the operational tables loaded into DuckDB and joined into the email funnel.

A thin shell over ``email_platform.warehouse``: one multi-asset loads and builds every table in
one step and publishes them together as one snapshot (so ``email_funnel_daily`` never disagrees
with the ``email_funnel`` an analyst sees next to it); asset checks read that published snapshot
read-only, exactly as an analyst would. ``sensors/analytics.py`` refreshes it after sends and
webhook ingestion.
"""

import base64
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    AssetSpec,
    FreshnessPolicy,
    MaterializeResult,
    MetadataValue,
    asset_check,
    multi_asset,
)

from email_platform import warehouse as core
from email_platform.assets.keys import ASSET_GROUP, asset_key
from email_platform.resources import AppDatabase
from email_platform.resources.warehouse import Warehouse

# With nothing new, the warehouse is still refreshed this often, so its freshness is provable.
HEARTBEAT_S = 3600
# A run with this tag set to "true" rebuilds the warehouse from scratch (a reconcile).
FULL_TAG = "email/analytics_full"

OPERATIONAL_TABLES = {
    "email_outbox": "Application events published by product code (the outbox).",
    "email_messages": "One row per event x route: the mail an event causes and its status.",
    "email_attempts": "One row per provider call, with its outcome and HTTP status.",
    "dead_letters": "Messages and events that could not be sent, and what became of them.",
    "email_events": "Normalized provider events from webhooks, each stored once.",
}


operational_tables = [
    AssetSpec(
        asset_key(name),
        group_name=ASSET_GROUP,
        description=description + " Lives in the application database; read-only here.",
        kinds={"sql"},
    )
    for name, description in OPERATIONAL_TABLES.items()
]

_freshness = FreshnessPolicy.time_window(
    fail_window=timedelta(seconds=3 * HEARTBEAT_S), warn_window=timedelta(seconds=HEARTBEAT_S + 600)
)
_specs = [
    AssetSpec(
        asset_key(model.name),
        group_name=ASSET_GROUP,
        description=model.description,
        deps=[asset_key(dep) for dep in model.deps],
        kinds={"duckdb"},
        freshness_policy=_freshness,
        metadata={
            # analytics/<name>.sql in a checkout (the package's sql symlink resolved), else the
            # installed package's copy.
            "sql": MetadataValue.path(os.path.realpath(str(core.sql_file(f"{model.name}.sql")))),
            "materialized_as": model.materialized_as,
        },
    )
    for model in core.MODELS
]


@multi_asset(
    name="analytics_warehouse",
    specs=_specs,
    can_subset=False,
    description=(
        "Loads what changed in the operational tables since the last load into the DuckDB "
        "warehouse, rebuilds the funnel rows it touches and publishes a new read-only snapshot."
    ),
)
def analytics_warehouse(
    context: AssetExecutionContext, email_database: AppDatabase, email_warehouse: Warehouse
):
    summary = core.refresh(
        email_database.get_engine(),
        email_warehouse.resolved_path(),
        full=context.run.tags.get(FULL_TAG) == "true",
        lookback_s=email_warehouse.lookback_s,
        memory_limit=email_warehouse.resolved_memory_limit(),
    )
    context.log.info(
        f"loaded {summary.total_loaded} rows ({summary.rows_loaded}); rebuilt "
        f"{summary.messages_rebuilt} funnel rows ({summary.messages_folded} folded) over "
        f"{summary.days_rebuilt} days"
        + (" (full build)" if summary.full_build else "")
        + f" in {summary.timings_s['total']:.2f}s"
    )
    for name in core.MODEL_NAMES:
        yield MaterializeResult(asset_key=asset_key(name), metadata=_metadata(name, summary))


# The staging models that read an operational table directly: their metadata counts its rows.
_SOURCE_OF = {
    model.name: dep for model in core.MODELS for dep in model.deps if dep in core.SOURCES_BY_NAME
}


def _metadata(name: str, summary: core.RefreshSummary) -> dict[str, MetadataValue]:
    """One model's metadata, in the order the UI lists it (it keeps ours): what the model
    holds first, how the refresh went last."""
    metadata: dict[str, MetadataValue] = {}
    if name == core.FUNNEL_DAILY:
        metadata.update(_rates_and_chart(summary.warehouse_path))
        metadata["dagster/row_count"] = MetadataValue.int(summary.table_rows[core.FUNNEL_DAILY])
        metadata["days_rebuilt"] = MetadataValue.int(summary.days_rebuilt)
    if name == core.FUNNEL:
        # The same funnel first here too: an analyst may open either asset first.
        rates = core.template_rates(summary.warehouse_path, days=core.RATE_WINDOW_DAYS)
        metadata["funnel"] = MetadataValue.md(core.funnel_md(rates))
        metadata["dagster/row_count"] = MetadataValue.int(summary.table_rows[core.FUNNEL])
        for key, value in summary.funnel.items():
            if value is None:
                continue
            metadata[key] = (
                MetadataValue.int(value)
                if isinstance(value, int)
                else MetadataValue.float(round(float(value), 6))
            )
        metadata["messages_rebuilt"] = MetadataValue.int(summary.messages_rebuilt)
        # Of those, the rows folded from their old row and only the new rows (warehouse.fold).
        metadata["messages_folded"] = MetadataValue.int(summary.messages_folded)
    source = _SOURCE_OF.get(name)
    if source:
        raw = core.SOURCES_BY_NAME[source].raw_table
        metadata["dagster/row_count"] = MetadataValue.int(summary.table_rows[raw])
        metadata["rows_loaded"] = MetadataValue.int(summary.rows_loaded[source])
        metadata["rows_read"] = MetadataValue.int(summary.rows_read[source])
        if source in summary.rows_removed:
            metadata["rows_removed"] = MetadataValue.int(summary.rows_removed[source])
        mark = summary.high_water_marks.get(source)
        if mark is not None:
            metadata["data_through"] = MetadataValue.timestamp(mark)
    metadata["refresh_s"] = MetadataValue.float(round(summary.timings_s["total"], 3))
    metadata["full_build"] = MetadataValue.bool(summary.full_build)
    metadata["warehouse"] = MetadataValue.path(summary.warehouse_path)
    return metadata


def _rates_and_chart(warehouse_path: str) -> dict[str, MetadataValue]:
    """The funnel and the rates over the last days, first things on the page: the funnel as
    short Markdown the UI shows inline, then the rates in percent, ranked so the UI's plots
    (sorted by label) start with them; the chart and the full table per template after."""
    rates = core.template_rates(warehouse_path, days=core.RATE_WINDOW_DAYS)
    metadata: dict[str, MetadataValue] = {"funnel": MetadataValue.md(core.funnel_md(rates))}
    metadata.update(
        {label: MetadataValue.float(value) for label, value in core.plotted_rates(rates).items()}
    )
    svg = core.funnel_chart_svg(
        rates.templates, title=f"Funnel by template, {rates.scope} (human opens)"
    )
    chart = Path(f"{warehouse_path}.funnel.svg")
    chart.write_text(svg)
    encoded = base64.b64encode(svg.encode()).decode()
    markdown = (
        f"![funnel by template](data:image/svg+xml;base64,{encoded})\n\n"
        + core.funnel_table_md(rates)
    )
    metadata["funnel_chart"] = MetadataValue.md(markdown)
    metadata["funnel_chart_svg"] = MetadataValue.path(chart)
    metadata["rates_window"] = MetadataValue.text(rates.window)
    metadata["rate_definitions"] = MetadataValue.text(
        "; ".join(f"{rate.name} = {rate.definition}" for rate in core.RATES)
    )
    return metadata


# ---------------------------------------------------------------------------------------------
# Checks: read the published snapshot, as an analyst would.


def _result(outcome: core.CheckOutcome) -> AssetCheckResult:
    return AssetCheckResult(
        passed=outcome.passed,
        severity=AssetCheckSeverity.ERROR
        if outcome.severity == "ERROR"
        else AssetCheckSeverity.WARN,
        description=outcome.description,
        metadata={key: _metadata_value(value) for key, value in outcome.metadata.items()},
    )


def _metadata_value(value: object) -> MetadataValue:
    """A check's plain value as metadata; a datetime as a timestamp (Dagster would refuse it,
    and an epoch float shows as a bare number), ``Markdown`` as Markdown."""
    if isinstance(value, MetadataValue):
        return value
    if isinstance(value, datetime):
        return MetadataValue.timestamp(value if value.tzinfo else value.replace(tzinfo=UTC))
    if isinstance(value, core.Markdown):
        return MetadataValue.md(str(value))
    if isinstance(value, bool):
        return MetadataValue.bool(value)
    if isinstance(value, int):
        return MetadataValue.int(value)
    if isinstance(value, float):
        return MetadataValue.float(value)
    return MetadataValue.text(str(value))


def _run(warehouse: Warehouse, check, *args) -> AssetCheckResult:  # type: ignore[no-untyped-def]
    connection = core.connect_read_only(warehouse.resolved_path())
    try:
        return _result(check(connection, *args))
    finally:
        connection.close()


@asset_check(
    asset=asset_key("email_funnel"),
    name="one_row_per_message",
    description="Exactly one funnel row per message loaded: none missing, none doubled.",
)
def one_row_per_message(email_warehouse: Warehouse) -> AssetCheckResult:
    return _run(email_warehouse, core.check_one_row_per_message)


@asset_check(
    asset=asset_key("email_funnel"),
    name="provider_events_joined",
    description=(
        "Every provider event joins to a message. Orphans (a webhook for mail we cannot match) "
        "are counted by type; any orphan is a warning."
    ),
)
def provider_events_joined(email_warehouse: Warehouse) -> AssetCheckResult:
    return _run(email_warehouse, core.check_provider_events_joined)


@asset_check(
    asset=asset_key("email_funnel"),
    name="no_negative_latencies",
    description=(
        "No latency between steps is negative (beyond the configured clock skew between our "
        "hosts and the provider's)."
    ),
)
def no_negative_latencies(email_warehouse: Warehouse) -> AssetCheckResult:
    return _run(email_warehouse, core.check_no_negative_latencies, email_warehouse.thresholds())


@asset_check(
    asset=asset_key("stg_dead_letters"),
    name="open_dead_letters",
    description="Dead letters waiting for an operator, by reason. Any open one is a warning.",
)
def open_dead_letters(email_warehouse: Warehouse) -> AssetCheckResult:
    return _run(email_warehouse, core.check_open_dead_letters)


@asset_check(
    asset=asset_key("email_funnel_daily"),
    name="bounce_rate_under_threshold",
    description=(
        "The daily bounce rate of each template x lane x provider over the last days stays "
        "under the threshold (Warehouse.bounce_rate_threshold). A breach is an error."
    ),
)
def bounce_rate_under_threshold(email_warehouse: Warehouse) -> AssetCheckResult:
    thresholds = email_warehouse.thresholds()
    return _run(
        email_warehouse, core.check_daily_rate, "bounce_rate", thresholds.bounce_rate, thresholds
    )


@asset_check(
    asset=asset_key("email_funnel_daily"),
    name="complaint_rate_under_threshold",
    description=(
        "The daily spam-complaint rate of each template x lane x provider over the last days "
        "stays under the threshold (Warehouse.complaint_rate_threshold). A breach is an error."
    ),
)
def complaint_rate_under_threshold(email_warehouse: Warehouse) -> AssetCheckResult:
    thresholds = email_warehouse.thresholds()
    return _run(
        email_warehouse,
        core.check_daily_rate,
        "complaint_rate",
        thresholds.complaint_rate,
        thresholds,
    )


analytics_checks = [
    one_row_per_message,
    provider_events_joined,
    no_negative_latencies,
    open_dead_letters,
    bounce_rate_under_threshold,
    complaint_rate_under_threshold,
]
