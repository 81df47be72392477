import math

from dagster import ConfigurableResource

from email_platform import warehouse
from email_platform.common import config


class Warehouse(ConfigurableResource):
    """The DuckDB analytics warehouse: where the funnel is built and published for analysts.

    ``path`` is the file analysts open read-only; empty means ``EMAIL_PLATFORM_WAREHOUSE`` or
    ``./.email_platform/warehouse.duckdb``. The assets build in a private ``<path>.writer`` file
    and swap a finished snapshot in, so a reader never blocks a refresh or sees half a table.
    ``refresh_interval_s`` (empty: ``EMAIL_PLATFORM_ANALYTICS_REFRESH_S``, default 60) is the
    most often ``analytics_refresh_sensor`` starts a refresh while data keeps changing, so the
    warehouse trails the operational tables by at most that plus one refresh.
    The thresholds drive the bounce and complaint rate checks, over the last
    ``rate_window_days`` days: a day x template x lane x provider is judged only when the rate's
    denominator (accepted messages for bounces, delivered for complaints) counts at least
    ``rate_check_min_messages``; below that the check passes and says it did not judge.
    """

    path: str | None = None
    lookback_s: float = warehouse.DEFAULT_LOOKBACK_S
    refresh_interval_s: float | None = None
    bounce_rate_threshold: float = warehouse.Thresholds.bounce_rate
    complaint_rate_threshold: float = warehouse.Thresholds.complaint_rate
    rate_check_min_messages: int = warehouse.Thresholds.min_messages
    rate_window_days: int = warehouse.Thresholds.window_days
    clock_skew_s: float = warehouse.Thresholds.clock_skew_s
    # The most memory a refresh may use, a full build's above all (a DuckDB size, "2GB"); empty:
    # EMAIL_PLATFORM_WAREHOUSE_MEMORY, default 2GB. It spills to disk beyond it.
    memory_limit: str | None = None

    def resolved_path(self) -> str:
        return self.path or config.warehouse_path()

    def resolved_memory_limit(self) -> str:
        if self.memory_limit is None:
            return config.warehouse_memory()
        return config.checked_memory(self.memory_limit, "memory_limit")

    def resolved_refresh_interval_s(self) -> float:
        if self.refresh_interval_s is None:
            return config.analytics_refresh_s()
        if not (self.refresh_interval_s > 0 and math.isfinite(self.refresh_interval_s)):
            raise ValueError(f"refresh_interval_s must be positive, got {self.refresh_interval_s}")
        return self.refresh_interval_s

    def thresholds(self) -> warehouse.Thresholds:
        return warehouse.Thresholds(
            bounce_rate=self.bounce_rate_threshold,
            complaint_rate=self.complaint_rate_threshold,
            min_messages=self.rate_check_min_messages,
            window_days=self.rate_window_days,
            clock_skew_s=self.clock_skew_s,
        )
