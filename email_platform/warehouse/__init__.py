"""The analytics warehouse: operational tables loaded incrementally into DuckDB, then the funnel.

Framework-free (nothing here imports Dagster): plain functions the Dagster assets, the demo, the
benchmark and the tests call. ``refresh()`` loads what changed in the operational database into
a private writer file, rebuilds the funnel rows it touched and publishes the file as the
snapshot analysts open read-only. One module per part:

- ``sources``: the operational tables loaded, their keys and change markers.
- ``scanners``: the operational database attached through DuckDB's SQLite and PostgreSQL
  scanners.
- ``load``: staging what changed and writing it into the ``raw_*`` tables.
- ``build``: the models (``analytics/*.sql``) and building them, whole or incrementally.
- ``state``: the ``warehouse_state`` table (high-water marks, the models' fingerprint) and
  compaction.
- ``files``: the writer file, the lock, connections; publishing a snapshot and preparing the
  next writer file.
- ``refreshing``: ``refresh()``, one refresh from the lock to the published snapshot;
  ``summary``: ``RefreshSummary``, what it did.
- ``rates``: the funnel's rates (as ``analytics/email_funnel_daily.sql`` defines them) per
  template and overall over the newest days: ``template_rates``, for the metadata, the chart,
  the demo and the CLI.
- ``checks`` and ``report``: what the asset checks, the demo and the CLI read from a snapshot.
"""

from email_platform.warehouse.build import (
    FUNNEL,
    FUNNEL_DAILY,
    MODEL_NAMES,
    MODELS,
    STAGING_MODELS,
    Model,
    model_sql,
    sql_file,
)
from email_platform.warehouse.checks import (
    LATENCY_COLUMNS,
    CheckOutcome,
    Markdown,
    Thresholds,
    check_daily_rate,
    check_no_negative_latencies,
    check_one_row_per_message,
    check_open_dead_letters,
    check_provider_events_joined,
)
from email_platform.warehouse.files import (
    PATCH_CHUNK,
    connect_read_only,
    lock_path,
    writer_lock,
    writer_path,
)
from email_platform.warehouse.rates import (
    HEADLINE_RATES,
    RATE_WINDOW_DAYS,
    RATES,
    RATES_BY_NAME,
    FunnelRates,
    Rate,
    template_rates,
)
from email_platform.warehouse.refreshing import DEFAULT_LOOKBACK_S, refresh
from email_platform.warehouse.report import (
    FunnelReport,
    analytics_dir,
    funnel_chart_svg,
    funnel_md,
    funnel_report,
    funnel_row,
    funnel_table_md,
    funnel_totals,
    percent,
    plot_label,
    plotted_rates,
    question_names,
    question_sql,
    run_question,
)
from email_platform.warehouse.scanners import SourceUnavailableError
from email_platform.warehouse.sources import (
    DELETIONS,
    SOURCES,
    SOURCES_BY_NAME,
    Source,
    operational_fingerprint,
)
from email_platform.warehouse.summary import RefreshSummary

__all__ = [
    "DEFAULT_LOOKBACK_S",
    "DELETIONS",
    "FUNNEL",
    "FUNNEL_DAILY",
    "HEADLINE_RATES",
    "LATENCY_COLUMNS",
    "MODELS",
    "MODEL_NAMES",
    "PATCH_CHUNK",
    "RATES",
    "RATES_BY_NAME",
    "RATE_WINDOW_DAYS",
    "SOURCES",
    "SOURCES_BY_NAME",
    "STAGING_MODELS",
    "CheckOutcome",
    "FunnelRates",
    "FunnelReport",
    "Markdown",
    "Model",
    "Rate",
    "RefreshSummary",
    "Source",
    "SourceUnavailableError",
    "Thresholds",
    "analytics_dir",
    "check_daily_rate",
    "check_no_negative_latencies",
    "check_one_row_per_message",
    "check_open_dead_letters",
    "check_provider_events_joined",
    "connect_read_only",
    "funnel_chart_svg",
    "funnel_md",
    "funnel_report",
    "funnel_row",
    "funnel_table_md",
    "funnel_totals",
    "lock_path",
    "model_sql",
    "operational_fingerprint",
    "percent",
    "plot_label",
    "plotted_rates",
    "question_names",
    "question_sql",
    "refresh",
    "run_question",
    "sql_file",
    "template_rates",
    "writer_lock",
    "writer_path",
]
