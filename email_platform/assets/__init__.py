"""Analytics assets (DuckDB): the email funnel and its checks (the sensor that refreshes it is
in ``email_platform.sensors.analytics``)."""

from email_platform.assets.analytics import (
    analytics_checks,
    analytics_warehouse,
    operational_tables,
)
from email_platform.assets.brake_check import bulk_brake
from email_platform.assets.sends import lane_sends

# What definitions.py registers as assets: the warehouse multi-asset, the operational tables it
# reads (external, for lineage), the asset checks, the bulk lane's brake over the warehouse, and
# each lane's observed sends.
analytics_assets: list = [
    analytics_warehouse,
    *operational_tables,
    *analytics_checks,
    bulk_brake,
    *lane_sends,
]

__all__ = [
    "analytics_assets",
    "analytics_checks",
    "analytics_warehouse",
    "operational_tables",
]
