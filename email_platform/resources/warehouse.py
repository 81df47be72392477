from dagster import ConfigurableResource

from email_platform import config, warehouse


class Warehouse(ConfigurableResource):
    """The DuckDB analytics warehouse: where the funnel is built and published for analysts.

    ``path`` is the file analysts open read-only; empty means ``EMAIL_PLATFORM_WAREHOUSE`` or
    ``./.email_platform/warehouse.duckdb``. The assets build in a private ``<path>.writer`` file
    and swap a finished snapshot in, so a reader never blocks a refresh or sees half a table.
    The thresholds drive the bounce and complaint rate checks.
    """

    path: str | None = None
    lookback_s: float = warehouse.DEFAULT_LOOKBACK_S
    bounce_rate_threshold: float = warehouse.Thresholds.bounce_rate
    complaint_rate_threshold: float = warehouse.Thresholds.complaint_rate
    min_accepted_per_day: int = warehouse.Thresholds.min_accepted
    rate_window_days: int = warehouse.Thresholds.window_days
    clock_skew_s: float = warehouse.Thresholds.clock_skew_s

    def resolved_path(self) -> str:
        return self.path or config.warehouse_path()

    def thresholds(self) -> warehouse.Thresholds:
        return warehouse.Thresholds(
            bounce_rate=self.bounce_rate_threshold,
            complaint_rate=self.complaint_rate_threshold,
            min_accepted=self.min_accepted_per_day,
            window_days=self.rate_window_days,
            clock_skew_s=self.clock_skew_s,
        )
