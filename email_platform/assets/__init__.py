"""Analytics assets (DuckDB): the email funnel and its checks (the sensor that refreshes it is
in ``email_platform.sensors.analytics``)."""

from email_platform.assets.analytics import (
    analytics_checks,
    analytics_warehouse,
    operational_tables,
)

# What definitions.py registers as assets: the warehouse multi-asset, the operational tables it
# reads (external, for lineage) and the asset checks.
analytics_assets: list = [analytics_warehouse, *operational_tables, *analytics_checks]

__all__ = [
    "analytics_assets",
    "analytics_checks",
    "analytics_warehouse",
    "operational_tables",
]
